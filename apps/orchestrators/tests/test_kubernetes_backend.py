"""KubernetesBackend over real HTTP: the official client against kmock's emulator and a fake controller."""

import json
import socket

import kmock
import pytest

from apps.orchestrators.base import (
    APPLIED,
    ROUTING_TABLE,
    BackendUnavailable,
    Conflict,
    InvalidSpec,
    ModelRef,
    NotFound,
    PoolRef,
    PoolTrackSpec,
)
from apps.orchestrators.kubernetes_backend import KubeconfigRef, KubernetesBackend
from apps.orchestrators.kubernetes_manifests import RouterSpec
from apps.orchestrators.tests.kube_mock import (
    DEPLOYMENTS,
    PDBS,
    PODS,
    SERVICES,
    FakeController,
    KubeMock,
    api_client,
)
from inference_worker.tests.support.agent import wait_for

NS = "ferry"
POOL = PoolRef(pool_id=3, pool_name="decode-a", namespace=NS)


def spec(replicas=1, track="stable", version="v1"):
    return PoolTrackSpec(pool=POOL, role="decode", track=track, replicas=replicas,
                         model=ModelRef(name="gemma-3-270m", version=version, image="worker:v1"))


@pytest.fixture
def mock():
    with KubeMock() as m:
        yield m


@pytest.fixture
def controller(mock):
    c = FakeController(mock.url, NS, ready_delay_s=0.3)
    c.start()
    yield c
    c.stop()
    assert c.errors == []  # the controller's own API calls never failed


@pytest.fixture
def sleeps():
    return []


@pytest.fixture
def backend(mock, tmp_path, sleeps):
    path = mock.kubeconfig(str(tmp_path / "kubeconfig"))
    return KubernetesBackend.from_kubeconfig(KubeconfigRef(path=path, context="mock"), backoff_s=0.01,
                                             max_attempts=3, sleep=sleeps.append)


def test_apply_creates_deployment_headless_service_and_pdb_with_labels_and_probes(mock, backend):
    backend.apply_pool_track(spec(replicas=2))
    dep = mock.obj(DEPLOYMENTS, NS, "decode-a-stable")
    labels = dep["metadata"]["labels"]
    assert {k: labels[k] for k in ("ferry.io/pool", "ferry.io/role", "ferry.io/model-version", "ferry.io/track")} == {
        "ferry.io/pool": "decode-a", "ferry.io/role": "decode", "ferry.io/model-version": "v1",
        "ferry.io/track": "stable"}
    assert dep["spec"]["replicas"] == 2
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["args"][:2] == ["serve", "--role"]
    assert mock.obj(SERVICES, NS, "decode-a-stable")["spec"]["clusterIP"] == "None"
    assert mock.obj(PDBS, NS, "decode-a-stable")["spec"]["maxUnavailable"] == 1


def test_apply_twice_patches_the_existing_objects(mock, backend):
    backend.apply_pool_track(spec(replicas=1, version="v1"))
    backend.apply_pool_track(spec(replicas=4, version="v2"))
    dep = mock.obj(DEPLOYMENTS, NS, "decode-a-stable")
    assert dep["spec"]["replicas"] == 4
    assert dep["metadata"]["labels"]["ferry.io/model-version"] == "v2"
    assert len(mock.requests("POST", "/namespaces/ferry/deployments")) == 2  # second one got 409
    assert len(mock.requests("PATCH", "/deployments/decode-a-stable")) == 1


def test_scale_patches_the_scale_subresource_and_readiness_follows(mock, backend, controller):
    backend.apply_pool_track(spec(replicas=1))
    backend.scale_track(POOL, "stable", 3)
    (patch,) = mock.requests("PATCH", "/deployments/decode-a-stable/scale")
    assert patch.data == {"spec": {"replicas": 3}}
    assert backend.wait_track_ready(POOL, "stable", 3, timeout_s=10) is True
    observed = backend.observe(POOL)
    track = observed.tracks["stable"]
    assert (track.desired_replicas, track.ready_replicas, len(track.replicas)) == (3, 3, 3)
    assert all(r.ready and r.alive and r.version == "v1" for r in track.replicas)
    assert all(r.endpoint.startswith("http://10.0.0.") and r.endpoint.endswith(":8000") for r in track.replicas)
    assert observed.active_track is None


def test_scale_to_the_current_count_writes_nothing(mock, backend):
    backend.apply_pool_track(spec(replicas=2))
    backend.scale_track(POOL, "stable", 2)
    assert mock.requests("PATCH", "/deployments/decode-a-stable/scale") == []


def test_injected_409_is_retried_after_a_re_read_and_the_final_replicas_are_right(mock, backend):
    backend.apply_pool_track(spec(replicas=1))
    injected = []

    def concurrent_writer_wins(request):
        if injected:
            return NotImplemented  # from now on the emulator serves the patch
        injected.append(request.data)
        # kmock has already stored our write (it records writes before reactions run), so this
        # models the race exactly: someone else scaled the Deployment between our read and our write: we lose with 409.
        mock.k.objects[DEPLOYMENTS, NS, "decode-a-stable"].patch({"spec": {"replicas": 7}})
        raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")

    mock.k["patch", DEPLOYMENTS, kmock.subresource("scale")] << concurrent_writer_wins
    backend.scale_track(POOL, "stable", 4)
    assert injected == [{"spec": {"replicas": 4}}]
    assert len(mock.requests("PATCH", "/deployments/decode-a-stable/scale")) == 2
    assert len(mock.requests("GET", "/deployments/decode-a-stable/scale")) == 2  # re-read before retry
    assert mock.obj(DEPLOYMENTS, NS, "decode-a-stable")["spec"]["replicas"] == 4


def test_conflicts_beyond_the_retry_budget_raise_conflict(mock, mock_backend_small_budget):
    backend = mock_backend_small_budget
    backend.apply_pool_track(spec(replicas=1))

    def always_conflict():
        # kmock stores a write before reactions run; a competing writer puts its value back every time.
        mock.k.objects[DEPLOYMENTS, NS, "decode-a-stable"].patch({"spec": {"replicas": 5}})
        raise kmock.KubernetesError(status=409, reason="Conflict", message="modified")

    mock.k["patch", DEPLOYMENTS, kmock.subresource("scale")] << always_conflict
    with pytest.raises(Conflict):
        backend.scale_track(POOL, "stable", 2)
    assert len(mock.requests("PATCH", "/deployments/decode-a-stable/scale")) == 3  # 1 + 2 retries
    assert mock.obj(DEPLOYMENTS, NS, "decode-a-stable")["spec"]["replicas"] == 5


@pytest.fixture
def mock_backend_small_budget(mock):
    return KubernetesBackend(KubernetesBackend.configure(_configuration(mock.url)), max_conflict_retries=2,
                             sleep=lambda s: None)


def _configuration(url):
    return api_client(url).configuration


def test_5xx_is_retried_with_exponential_backoff_then_backend_unavailable(mock, backend, sleeps):
    backend.apply_pool_track(spec(replicas=1))
    mock.k["get", DEPLOYMENTS, kmock.subresource("scale")] << 503 << {"kind": "Status", "code": 503}
    with pytest.raises(BackendUnavailable, match="read_namespaced_deployment_scale failed 3 times"):
        backend.scale_track(POOL, "stable", 2)
    assert len(mock.requests("GET", "/deployments/decode-a-stable/scale")) == 3
    assert sleeps == [0.01, 0.02]


def test_one_5xx_then_success_completes_the_call(mock, backend, sleeps):
    backend.apply_pool_track(spec(replicas=1))
    failed = []

    def fail_once():
        if failed:
            return NotImplemented
        failed.append(1)
        raise kmock.KubernetesError(status=500, reason="InternalError", message="etcd timeout")

    mock.k["get", DEPLOYMENTS, kmock.subresource("scale")] << fail_once
    backend.scale_track(POOL, "stable", 2)
    assert mock.obj(DEPLOYMENTS, NS, "decode-a-stable")["spec"]["replicas"] == 2
    assert sleeps == [0.01]


def test_unreachable_api_server_is_backend_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave the block: connection refused
    sleeps = []
    backend = KubernetesBackend(api_client(f"http://127.0.0.1:{port}"), max_attempts=2, backoff_s=0.01,
                                sleep=sleeps.append)
    with pytest.raises(BackendUnavailable) as info:
        backend.observe(POOL)
    assert info.value.retryable is True and sleeps == [0.01]


def test_injected_410_on_a_watch_leads_to_a_re_list(mock, backend, controller):
    controller.ready_delay_s = 1.0
    backend.apply_pool_track(spec(replicas=2))
    gone = []

    def gone_once():
        if gone:
            return NotImplemented
        gone.append(1)
        event = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                             "code": 410, "reason": "Expired", "message": "too old resource version"}}
        return (json.dumps(event).encode() + b"\n",)

    mock.k[{"watch": "True"}, DEPLOYMENTS] << gone_once
    assert backend.wait_track_ready(POOL, "stable", 2, timeout_s=15) is True
    selector = "ferry.io/pool=decode-a,ferry.io/track=stable"
    lists = [r for r in mock.requests("GET", "/namespaces/ferry/deployments", labelSelector=selector)
             if "watch" not in r.params]
    watches = mock.requests("GET", "/namespaces/ferry/deployments", labelSelector=selector, watch="True")
    assert gone == [1]
    assert len(lists) == 2  # the first list, and the re-list after 410 Gone
    assert len(watches) >= 1


def test_wait_times_out_when_never_ready(backend):
    backend.apply_pool_track(spec(replicas=1))  # no controller: status never written
    assert backend.wait_track_ready(POOL, "stable", 1, timeout_s=2) is False


def test_switch_active_points_the_pool_service_at_the_track(mock, backend):
    backend.apply_pool_track(spec(track="blue"))
    backend.apply_pool_track(spec(track="green", version="v2"))
    assert backend.switch_active(POOL, "blue") == APPLIED
    assert backend.switch_active(POOL, "green") == APPLIED
    svc = mock.obj(SERVICES, NS, "decode-a")
    assert svc["spec"]["selector"] == {"ferry.io/pool": "decode-a", "ferry.io/track": "green"}
    assert backend.observe(POOL).active_track == "green"
    assert backend.set_traffic_weights(POOL, {"blue": 0, "green": 100}) == ROUTING_TABLE
    with pytest.raises(InvalidSpec, match="sum to 100"):
        backend.set_traffic_weights(POOL, {"blue": 10, "green": 80})


def test_delete_track_removes_its_objects_and_is_idempotent(mock, backend):
    backend.apply_pool_track(spec(track="canary"))
    backend.delete_track(POOL, "canary")
    backend.delete_track(POOL, "canary")
    for resource in (DEPLOYMENTS, SERVICES, PDBS):
        assert mock.obj(resource, NS, "decode-a-canary") is None
    assert backend.observe(POOL).tracks == {}


def pending_deletion(mock, name, *, answer_409=False, deleting=True):
    """Make DELETEs of Deployment ``name`` act as on an API server whose foreground deletion of it is pending
    (kmock deletes at once): the object stays, with ``deletionTimestamp`` and the ``foregroundDeletion``
    finalizer, and the DELETE answers 200 with it (or 409, as while another delete updates its finalizers).
    ``deleting=False`` keeps the object as it was (a 409 on an object nobody is deleting)."""
    kept = mock.obj(DEPLOYMENTS, NS, name)
    if deleting:
        kept["metadata"].update(deletionTimestamp="2026-12-01T12:36:30Z", finalizers=["foregroundDeletion"])

    def keep(request):
        if not request.url.path.endswith(f"/deployments/{name}"):
            return NotImplemented  # another object: the emulator (or another reaction) serves it
        mock.k.objects[DEPLOYMENTS, NS, name].create(kept)
        if answer_409:
            raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
        return kept

    mock.k["delete", DEPLOYMENTS] << keep


def test_deleting_a_track_already_being_deleted_succeeds_and_observe_leaves_it_out(mock, backend):
    backend.apply_pool_track(spec(replicas=2, track="canary"))
    assert backend.observe(POOL).tracks["canary"].desired_replicas == 2
    pending_deletion(mock, "decode-a-canary")
    backend.delete_track(POOL, "canary")  # the rollout's pool.track_delete: the pods drain first
    backend.delete_track(POOL, "canary")  # a second writer while it is still going away
    assert mock.obj(DEPLOYMENTS, NS, "decode-a-canary")["metadata"]["deletionTimestamp"] == "2026-12-01T12:36:30Z"
    assert (mock.obj(SERVICES, NS, "decode-a-canary"), mock.obj(PDBS, NS, "decode-a-canary")) == (None, None)
    assert len(mock.requests("DELETE", "/deployments/decode-a-canary")) == 2
    assert backend.observe(POOL).tracks == {}  # going away: not a track that reconcile would delete again


def test_a_409_on_deleting_a_track_being_deleted_is_success_and_on_one_not_being_deleted_is_conflict(mock, backend):
    backend.apply_pool_track(spec(track="canary"))
    pending_deletion(mock, "decode-a-canary", answer_409=True)
    backend.delete_track(POOL, "canary")
    assert len(mock.requests("GET", "/deployments/decode-a-canary")) == 1  # read once: deletionTimestamp set
    assert mock.obj(SERVICES, NS, "decode-a-canary") is None

    backend.apply_pool_track(spec(track="blue"))
    pending_deletion(mock, "decode-a-blue", answer_409=True, deleting=False)
    with pytest.raises(Conflict, match="^delete_namespaced_deployment: Conflict$"):
        backend.delete_track(POOL, "blue")
    assert mock.obj(SERVICES, NS, "decode-a-blue") is not None  # stopped at the Deployment


def test_restart_replica_deletes_the_pod_and_the_controller_replaces_it(mock, backend, controller):
    backend.apply_pool_track(spec(replicas=1))
    assert backend.wait_track_ready(POOL, "stable", 1, timeout_s=10)
    (old,) = backend.observe(POOL).tracks["stable"].replicas
    backend.restart_replica(POOL, old.name)
    assert mock.obj(PODS, NS, old.name) is None

    def replaced_and_ready():
        replicas = backend.observe(POOL).tracks["stable"].replicas
        return len(replicas) == 1 and replicas[0].name != old.name and replicas[0].ready

    # Not wait_track_ready: right after the delete the Deployment status is stale (still 1 ready).
    assert wait_for(replaced_and_ready, 10, 0.05)
    with pytest.raises(NotFound):
        backend.restart_replica(POOL, "decode-a-stable-missing")


def test_logs_read_the_worker_container_tail_capped_as_text(mock, backend):
    mock.k["get", PODS, kmock.subresource("log")] << b"loaded weights\x1b[0m\nready\n"
    assert backend.logs(POOL, "decode-a-stable-00000", tail=2) == "loaded weights[0m\nready\n"
    (request,) = mock.requests("GET", "/pods/decode-a-stable-00000/log")
    assert request.params == {"container": "worker", "tailLines": "2", "limitBytes": str(4 * 2**20)}


def test_apply_router_creates_its_deployment_and_service(mock, backend):
    backend.apply_router(RouterSpec(namespace=NS, image="worker:v1", token_secret_name="router-token",
                                    routing_table_url="http://web:8000/api/v1/routing-table/"))
    assert mock.obj(DEPLOYMENTS, NS, "ferry-router")["spec"]["replicas"] == 2
    assert mock.obj(SERVICES, NS, "ferry-router")["spec"]["selector"] == {"app.kubernetes.io/name": "ferry-router"}


def test_secret_reference_without_resolver_is_invalid():
    with pytest.raises(InvalidSpec, match="needs a secret_resolver"):
        KubernetesBackend.from_kubeconfig(KubeconfigRef(secret_name="cluster-a"))


def test_secret_reference_is_resolved_by_the_callable(mock, tmp_path):
    doc = json.load(open(mock.kubeconfig(str(tmp_path / "kc"))))
    backend = KubernetesBackend.from_kubeconfig(KubeconfigRef(secret_name="cluster-a", context="mock"),
                                                secret_resolver={"cluster-a": doc}.__getitem__)
    backend.apply_pool_track(spec())
    assert mock.obj(DEPLOYMENTS, NS, "decode-a-stable") is not None


def test_a_crash_looping_worker_is_observed_with_its_exit_code_death_time_and_termination_message(
        mock, backend, controller):
    """A worker whose model fails to load exits 3 after writing why to /dev/termination-log; the kubelet
    restarts it with CrashLoopBackOff (the pod stays Running) and keeps the death in lastState."""
    backend.apply_pool_track(spec(replicas=1))
    assert wait_for(lambda: len(backend.observe(POOL).tracks["stable"].replicas) == 1, 10, 0.05)
    (pod,) = backend.observe(POOL).tracks["stable"].replicas
    controller.stop()  # nobody marks it ready while we write the kubelet's view
    message = "model failed to load: FileNotFoundError: /models/model.gguf"
    controller.core.patch_namespaced_pod_status(pod.name, NS, {"status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [{
            "name": "worker", "ready": False, "restartCount": 4, "image": "worker:v1", "imageID": "",
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": message + "\n",
                                         "finishedAt": "2026-12-01T14:00:05Z"}},
        }]}})
    (observed,) = backend.observe(POOL).tracks["stable"].replicas
    assert (observed.alive, observed.ready, observed.restart_count, observed.exit_code, observed.message,
            observed.exited_at) == (True, False, 4, 3, message, 1796133605.0)
