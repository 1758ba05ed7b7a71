"""Manifests as data: exact labels, command, probes, resources, scheduling and the weights init step."""

import hashlib

import pytest

from apps.orchestrators import kubernetes_manifests as m
from apps.orchestrators.base import InvalidSpec, ModelRef, PoolRef, PoolTrackSpec, Resources, Toleration

SHA = "ab" * 32


def make_spec(**overrides):
    fields = dict(
        pool=PoolRef(pool_id=7, pool_name="decode-a", namespace="ferry"),
        role="decode",
        track="canary",
        model=ModelRef(name="gemma-3-270m", version="v2", image="registry.local/worker:v2",
                       weights_uri="https://models.local/gemma/model.gguf", sha256=SHA),
        replicas=3,
        resources=Resources(gpu_count=1, cpu="4", memory="16Gi"),
        node_selector={"nvidia.com/gpu.product": "H100"},
        tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),),
        drain_timeout_s=45,
        labels={"team": "serving"},
        env={"FERRY_LOG_LEVEL": "info"},
        extra_args=("--max-num-seqs", "16"),
    )
    fields.update(overrides)
    return PoolTrackSpec(**fields)


LABELS = {
    "team": "serving",
    "ferry.io/pool": "decode-a",
    "ferry.io/pool-id": "7",
    "ferry.io/role": "decode",
    "ferry.io/track": "canary",
    "ferry.io/model-version": "v2",
    "app.kubernetes.io/component": "inference-worker",
    "app.kubernetes.io/managed-by": "ferry",
}


def test_deployment_carries_labels_selector_and_replicas():
    dep = m.deployment_manifest(make_spec())
    assert dep["apiVersion"] == "apps/v1" and dep["kind"] == "Deployment"
    assert dep["metadata"] == {"name": "decode-a-canary", "namespace": "ferry", "labels": LABELS}
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["selector"] == {"matchLabels": {"ferry.io/pool": "decode-a", "ferry.io/track": "canary"}}
    assert dep["spec"]["template"]["metadata"]["labels"] == LABELS
    assert dep["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}


def test_worker_container_runs_the_serve_role_with_probes_and_gpu_resources():
    pod = m.deployment_manifest(make_spec())["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.local/worker:v2"
    assert container["command"] == ["python", "-m", "inference_worker"]
    assert container["args"] == [
        "serve", "--role", "decode", "--model", "gemma-3-270m", "--model-version", "v2",
        "--pool", "decode-a", "--track", "canary", "--drain-timeout", "45", "--max-num-seqs", "16",
        "--replica", "$(FERRY_REPLICA)", "--host", "0.0.0.0", "--port", "8000"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"},
    }
    assert container["env"] == [
        {"name": "FERRY_LOG_LEVEL", "value": "info"},
        {"name": "FERRY_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "FERRY_WEIGHTS_PATH", "value": "/models/model.gguf"},
        {"name": "FERRY_TERMINATION_MESSAGE_PATH", "value": "/dev/termination-log"},
        # the KV link secret by reference (README "Deploy on Kubernetes"), never as a value in the Deployment
        {"name": "FERRY_KV_LINK_SECRET", "valueFrom": {"secretKeyRef": {
            "name": "ferry-kv-link", "key": "FERRY_KV_LINK_SECRET", "optional": True}}},
    ]
    # FERRY_WORKER_ENV setting the secret as a value replaces the reference (one env var, not two)
    overridden = m.worker_container(make_spec(env={"FERRY_KV_LINK_SECRET": "k" * 32}))
    assert [e for e in overridden["env"] if e["name"] == "FERRY_KV_LINK_SECRET"] == [
        {"name": "FERRY_KV_LINK_SECRET", "value": "k" * 32}]
    # A worker that cannot load its model writes why there and exits 3; the kubelet keeps it as
    # lastState.terminated.message (other crashes: the log tail).
    assert (container["terminationMessagePath"], container["terminationMessagePolicy"]) == (
        "/dev/termination-log", "FallbackToLogsOnError")
    assert container["volumeMounts"] == [{"name": "weights", "mountPath": "/models"}]
    assert pod["terminationGracePeriodSeconds"] == 50
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["volumes"] == [{"name": "weights", "emptyDir": {}}]


def test_init_container_fetches_weights_and_checks_sha256():
    pod = m.deployment_manifest(make_spec())["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "fetch-weights"
    assert init["command"] == ["python", "-c", m.FETCH_WEIGHTS_SCRIPT]
    assert init["env"] == [
        {"name": "WEIGHTS_URI", "value": "https://models.local/gemma/model.gguf"},
        {"name": "WEIGHTS_SHA256", "value": SHA},
        {"name": "WEIGHTS_PATH", "value": "/models/model.gguf"},
    ]


def test_fetch_script_accepts_the_right_digest_and_rejects_a_wrong_one(tmp_path):
    import hashlib
    import subprocess
    import sys

    src = tmp_path / "w.bin"
    src.write_bytes(b"weights" * 1000)
    good = hashlib.sha256(src.read_bytes()).hexdigest()
    env = {"WEIGHTS_URI": src.as_uri(), "WEIGHTS_PATH": str(tmp_path / "out.bin"), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([sys.executable, "-c", m.FETCH_WEIGHTS_SCRIPT], env={**env, "WEIGHTS_SHA256": good},
                        capture_output=True, text=True)
    assert ok.returncode == 0 and (tmp_path / "out.bin").read_bytes() == src.read_bytes()
    (tmp_path / "out.bin").unlink()
    bad = subprocess.run([sys.executable, "-c", m.FETCH_WEIGHTS_SCRIPT], env={**env, "WEIGHTS_SHA256": "0" * 64},
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "sha256 mismatch" in bad.stderr
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.bin.part").exists()


def test_no_weights_uri_means_no_init_container_and_no_volume():
    spec = make_spec(model=ModelRef(name="gemma-3-270m", version="v1"), resources=Resources(),
                     node_selector={}, tolerations=())
    pod = m.deployment_manifest(spec)["spec"]["template"]["spec"]
    assert set(pod) == {"containers", "terminationGracePeriodSeconds"}
    assert pod["containers"][0]["resources"] == {"requests": {}, "limits": {}}


def test_headless_service_and_pdb_select_the_track():
    spec = make_spec()
    svc = m.headless_service_manifest(spec)
    assert svc["metadata"] == {"name": "decode-a-canary", "namespace": "ferry", "labels": LABELS}
    assert svc["spec"] == {
        "clusterIP": "None",
        "selector": {"ferry.io/pool": "decode-a", "ferry.io/track": "canary"},
        "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}],
        "publishNotReadyAddresses": False,
    }
    pdb = m.pod_disruption_budget_manifest(spec)
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1,
                           "selector": {"matchLabels": {"ferry.io/pool": "decode-a", "ferry.io/track": "canary"}}}
    assert [x["kind"] for x in m.track_manifests(spec)] == ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]


def test_pool_service_selects_the_active_track():
    svc = m.pool_service_manifest(PoolRef(1, "decode-a", "ferry"), "decode", "green", 9000)
    assert svc["metadata"]["name"] == "decode-a"
    assert svc["spec"]["selector"] == {"ferry.io/pool": "decode-a", "ferry.io/track": "green"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]


def test_router_deployment_and_service():
    router = m.RouterSpec(namespace="ferry", image="registry.local/worker:v2",
                          routing_table_url="http://web.ferry.svc:8000/api/v1/routing-table/",
                          token_secret_name="router-token", replicas=2)
    dep = m.router_deployment_manifest(router)
    assert dep["metadata"]["name"] == "ferry-router" and dep["spec"]["replicas"] == 2
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["router", "--routing-table", "http://web.ferry.svc:8000/api/v1/routing-table/",
                                 "--host", "0.0.0.0", "--port", "8000"]
    assert container["env"] == [{"name": "FERRY_SERVICE_TOKEN",
                                 "valueFrom": {"secretKeyRef": {"name": "router-token", "key": "token"}}},
                                {"name": "FERRY_ROUTER_API_KEY",
                                 "valueFrom": {"secretKeyRef": {"name": "router-token", "key": "client-api-key"}}}]
    svc = m.router_service_manifest(router)
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "ferry-router"}


@pytest.mark.parametrize("overrides, message", [
    ({"pool": None}, None),
    ({"role": "trainer"}, "role must be one of prefill, decode, colocated"),
    ({"track": "beta"}, "track must be one of stable, canary, blue, green"),
    ({"replicas": -1}, "replicas must be an integer in 0..1000"),
    ({"extra_args": ("--port", "1")}, "must not set --port"),
    ({"labels": {"ferry.io/track": "x"}}, "reserved"),
    ({"labels": {"team": "a b"}}, "not a valid label value"),
])
def test_invalid_specs_raise_clear_errors(overrides, message):
    if overrides == {"pool": None}:
        with pytest.raises(InvalidSpec, match="pool name 'Decode_A' must be lowercase"):
            PoolRef(1, "Decode_A")
        return
    with pytest.raises(InvalidSpec, match=message):
        make_spec(**overrides)


def test_model_with_weights_uri_requires_a_sha256():
    with pytest.raises(InvalidSpec, match="sha256 must be 64 lowercase hex"):
        ModelRef(name="gemma-3-270m", version="v1", weights_uri="https://x/y.gguf", sha256="abc")


@pytest.mark.parametrize(("engine", "command", "args", "ready"), [
    ("vllm", ["vllm"], ["serve", "/models/model", "--served-model-name", "gemma-3-270m", "--host", "0.0.0.0",
                        "--port", "8000"], "/health"),
    ("sglang", ["python3", "-m", "sglang.launch_server"],
     ["--model-path", "/models/model", "--served-model-name", "gemma-3-270m", "--host", "0.0.0.0", "--port", "8000",
      "--enable-metrics"], "/health_generate"),
])
def test_an_engine_pool_runs_the_engines_cli_on_a_checked_model_directory(engine, command, args, ready):
    spec = make_spec(engine=engine, role="colocated", extra_args=(), tolerations=(), node_selector={},
                     model=ModelRef(name="gemma-3-270m", version="v2", image=f"registry.local/{engine}:1",
                                    weights_uri="https://models.local/gemma-3-270m/", sha256=SHA))
    dep = m.deployment_manifest(spec)
    assert dep["metadata"]["labels"]["ferry.io/engine"] == engine
    assert dep["spec"]["template"]["spec"] == {
        "containers": [{
            "name": "worker",
            "image": f"registry.local/{engine}:1",
            "command": command,
            "args": args,
            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
            "env": [{"name": "FERRY_LOG_LEVEL", "value": "info"}],
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "resources": {"requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
                          "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}},
            "readinessProbe": {"httpGet": {"path": ready, "port": "http"}, "periodSeconds": 5, "failureThreshold": 1},
            "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "initialDelaySeconds": 30,
                              "periodSeconds": 10, "failureThreshold": 3},
            "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 360},
            "volumeMounts": [{"name": "weights", "mountPath": "/models"}],
        }],
        "terminationGracePeriodSeconds": 50,
        "initContainers": [{
            "name": "fetch-weights",
            "image": f"registry.local/{engine}:1",
            "command": ["python3", "-c", m.FETCH_MODEL_DIR_SCRIPT],
            "env": [{"name": "WEIGHTS_URI", "value": "https://models.local/gemma-3-270m/"},
                    {"name": "WEIGHTS_SHA256", "value": SHA},
                    {"name": "WEIGHTS_PATH", "value": "/models/model"}],
            "volumeMounts": [{"name": "weights", "mountPath": "/models"}],
        }],
        "volumes": [{"name": "weights", "emptyDir": {}}],
    }


def test_an_engine_pool_is_colocated_only():
    with pytest.raises(InvalidSpec, match="colocated pools only"):
        make_spec(engine="vllm", role="decode")
    with pytest.raises(InvalidSpec, match="engine must be one of"):
        make_spec(engine="tgi", role="colocated")


def test_the_model_directory_check_refuses_a_tampered_file(tmp_path):
    """The init script itself: a directory served over HTTP whose SHA256SUMS is pinned; one file changed after the
    sums were made is refused with its name, and nothing half-written stays."""
    import hashlib
    import os
    import subprocess
    import sys
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    src = tmp_path / "src"
    (src / "tokenizer").mkdir(parents=True)
    files = {"config.json": b'{"model_type": "gemma3"}', "tokenizer/tokenizer.json": b"{}", "model.safetensors": b"w" * 4096}
    for name, body in files.items():
        (src / name).write_bytes(body)
    sums = "".join(f"{hashlib.sha256(body).hexdigest()}  {name}\n" for name, body in files.items()).encode()
    (src / "SHA256SUMS").write_bytes(sums)
    pinned = hashlib.sha256(sums).hexdigest()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(src)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    def fetch(dest, sha):
        env = {**os.environ, "WEIGHTS_URI": url, "WEIGHTS_SHA256": sha, "WEIGHTS_PATH": str(dest)}
        return subprocess.run([sys.executable, "-c", m.FETCH_MODEL_DIR_SCRIPT], env=env, capture_output=True,
                              text=True, timeout=60)

    try:
        ok = fetch(tmp_path / "a", pinned)
        assert ok.returncode == 0, ok.stderr
        assert {p.relative_to(tmp_path / "a").as_posix() for p in (tmp_path / "a").rglob("*") if p.is_file()} == set(files)
        assert fetch(tmp_path / "b", "0" * 64).stderr.strip().endswith(f"{url}SHA256SUMS: want {'0' * 64}")
        (src / "model.safetensors").write_bytes(b"x" * 4096)
        bad = fetch(tmp_path / "c", pinned)
        assert bad.returncode == 1 and f"sha256 mismatch for {url}model.safetensors" in bad.stderr
        assert not (tmp_path / "c" / "model.safetensors").exists()
        assert not (tmp_path / "c" / "model.safetensors.part").exists()
    finally:
        server.shutdown()
        server.server_close()
TOKEN, PREVIOUS = "pool-token-0123456789abcdef", "old-pool-token-0123456789"


def test_the_pools_worker_token_is_a_secret_read_by_secret_key_ref_never_a_value_or_an_argument():
    spec = make_spec(worker_token=TOKEN, worker_token_previous=PREVIOUS)
    secret, deployment = m.track_manifests(spec)[:2]
    assert secret == {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "decode-a-worker-token", "namespace": "ferry",
                     "labels": {"ferry.io/pool": "decode-a", "app.kubernetes.io/managed-by": "ferry"}},
        "type": "Opaque",
        "stringData": {"FERRY_WORKER_TOKEN": TOKEN, "FERRY_WORKER_TOKEN_PREVIOUS": PREVIOUS},
    }
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["env"][-2:] == [
        {"name": "FERRY_WORKER_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "decode-a-worker-token", "key": "FERRY_WORKER_TOKEN"}}},
        {"name": "FERRY_WORKER_TOKEN_PREVIOUS", "valueFrom": {"secretKeyRef": {
            "name": "decode-a-worker-token", "key": "FERRY_WORKER_TOKEN_PREVIOUS"}}},
    ]
    assert TOKEN not in str(deployment) and PREVIOUS not in str(deployment) and TOKEN not in repr(spec)
    # a rotation changes the pod template (the digest annotation), so the Deployment rolls onto the new Secret
    digest = deployment["spec"]["template"]["metadata"]["annotations"]["ferry.io/worker-token-digest"]
    assert digest == hashlib.sha256(f"{TOKEN}\n{PREVIOUS}".encode()).hexdigest()[:16]
    rotated = m.deployment_manifest(make_spec(worker_token="new-pool-token-0123456789", worker_token_previous=TOKEN))
    assert rotated["spec"]["template"]["metadata"]["annotations"]["ferry.io/worker-token-digest"] != digest
    # after a rotation without grace the Secret's previous key is patched to "" (a merge patch keeps absent keys)
    assert m.worker_token_secret_manifest(make_spec(worker_token=TOKEN))["stringData"] == {
        "FERRY_WORKER_TOKEN": TOKEN, "FERRY_WORKER_TOKEN_PREVIOUS": ""}


def test_a_spec_without_a_worker_token_has_no_secret_and_env_may_not_smuggle_one():
    assert [d["kind"] for d in m.track_manifests(make_spec())] == [
        "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    with pytest.raises(InvalidSpec, match="env must not set FERRY_WORKER_TOKEN"):
        make_spec(env={"FERRY_WORKER_TOKEN": TOKEN})
    with pytest.raises(InvalidSpec, match="at least 16 printable ASCII"):
        make_spec(worker_token="short")


@pytest.mark.parametrize(("engine", "env_names", "args_tail"), [
    ("vllm", ["FERRY_WORKER_TOKEN", "FERRY_WORKER_TOKEN_PREVIOUS", "VLLM_API_KEY"], ["--port", "8000"]),
    ("sglang", ["FERRY_WORKER_TOKEN", "FERRY_WORKER_TOKEN_PREVIOUS"],
     ["--enable-metrics", "--api-key", "$(FERRY_WORKER_TOKEN)"]),
])
def test_an_engine_pool_requires_the_pools_worker_token_as_its_api_key(engine, env_names, args_tail):
    spec = make_spec(engine=engine, role="colocated", extra_args=(), worker_token="t" * 43)
    (container,) = m.deployment_manifest(spec)["spec"]["template"]["spec"]["containers"]
    assert [e["name"] for e in container["env"]] == ["FERRY_LOG_LEVEL", *env_names]
    assert all(e["valueFrom"]["secretKeyRef"]["name"] == "decode-a-worker-token" for e in container["env"][1:])
    assert container["args"][-len(args_tail):] == args_tail
    assert "t" * 43 not in str(container)
