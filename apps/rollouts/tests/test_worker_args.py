"""A rollout's ``worker_args``: checked on input (400 naming the option), copied to the canary or preview
track's ``extra_args``, carried by ``track_spec`` to the local agent's command and the Kubernetes container
args after the global ``FERRY_WORKER_EXTRA_ARGS``, shown by the pool API; on promotion they stay with the
track serving the new version, and a rollback goes back to the stable track's previous options."""

import pytest

from apps.fleet.models import Pool, PoolTrack
from apps.operations.backends import track_spec
from apps.orchestrators import kubernetes_manifests
from apps.rollouts import services
from apps.rollouts.models import RolloutPlan
from apps.rollouts.tests.conftest import drive, observe

pytestmark = pytest.mark.django_db


def _body(pool, target, **over):
    return {"name": "rehearsal", "pools": [pool.pk], "target_model_version": target.pk, "strategy": "canary",
            "steps": [{"set_weight": 50}], **over}


@pytest.mark.parametrize(
    ("worker_args", "message"),
    [
        ("--fault-error-rate 2", "--fault-error-rate must be in [0, 1], got 2.0"),
        ("--fault-eror-rate 0.5", "unrecognized arguments: --fault-eror-rate 0.5"),
        ("--track stable", "--track is set by Ferry"),
        ("--max-num-seqs 'two", "No closing quotation"),
    ],
)
def test_invalid_worker_args_are_400_naming_the_option(operator_api, make_pool, v2, worker_args, message):
    pool = make_pool("chat", role="colocated", replicas=1)
    r = operator_api.post("/api/v1/rollouts/", _body(pool, v2, worker_args=worker_args), format="json")
    assert r.status_code == 400, r.json()
    assert list(r.json()) == ["worker_args"]
    assert message in r.json()["worker_args"][0]
    assert RolloutPlan.objects.count() == 0
    created = operator_api.post("/api/v1/rollouts/", _body(pool, v2), format="json").json()
    r = operator_api.patch(f"/api/v1/rollouts/{created['id']}/", {"worker_args": worker_args}, format="json")
    assert r.status_code == 400 and message in r.json()["worker_args"][0]
    assert RolloutPlan.objects.get(pk=created["id"]).worker_args == ""


def test_canary_track_runs_the_plans_worker_args_after_the_global_ones(operator_api, make_pool, v2, settings):
    settings.FERRY_WORKER_EXTRA_ARGS = "--max-num-seqs 2 --fault-error-rate 0"
    pool = make_pool("chat", role="colocated", replicas=1)
    observe(pool)
    # fault injection is a rehearsal: refused while the cluster is production, accepted once it is not
    r = operator_api.post("/api/v1/rollouts/", _body(pool, v2, worker_args="--fault-error-rate 0.5 --fault-seed 3"),
                          format="json")
    assert (r.status_code, list(r.json())) == (400, ["worker_args"])
    assert "refused on a production cluster" in r.json()["worker_args"][0]
    pool.cluster.production = False
    pool.cluster.save(update_fields=["production"])
    r = operator_api.post("/api/v1/rollouts/", _body(pool, v2, worker_args="--fault-error-rate 0.5 --fault-seed 3"),
                          format="json")
    assert r.status_code == 201, r.json()
    assert r.json()["worker_args"] == "--fault-error-rate 0.5 --fault-seed 3"
    plan = RolloutPlan.objects.get(pk=r.json()["id"])
    services.rollout_start(plan=plan)
    tracks = {t["name"]: t["extra_args"] for t in operator_api.get(f"/api/v1/pools/{pool.pk}/").json()["tracks"]}
    assert tracks == {"canary": "--fault-error-rate 0.5 --fault-seed 3", "stable": ""}

    canary = track_spec(pool, PoolTrack.objects.get(pool=pool, name="canary"))
    # argparse keeps the last value: the track's --fault-error-rate 0.5 overrides the global 0
    assert canary.worker_args()[-8:] == ["--max-num-seqs", "2", "--fault-error-rate", "0", "--fault-error-rate", "0.5",
                                         "--fault-seed", "3"]
    stable = track_spec(pool, PoolTrack.objects.get(pool=pool, name="stable"))
    assert stable.worker_args()[-4:] == ["--max-num-seqs", "2", "--fault-error-rate", "0"]
    (container,) = kubernetes_manifests.deployment_manifest(canary)["spec"]["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--fault-seed") - 2:][:4] == [
        "--fault-error-rate", "0.5", "--fault-seed", "3"]


def test_promotion_keeps_the_new_releases_args_and_rollback_restores_the_old_ones(make_pool, v2):
    pool = make_pool("chat", role="colocated", replicas=1)
    PoolTrack.objects.filter(pool=pool, name="stable").update(extra_args="--max-num-seqs 4")
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="v2", strategy="canary",
                                        steps=[{"set_weight": 100}], worker_args="--max-num-seqs 8")
    services.rollout_start(plan=plan)
    drive(plan)
    assert [(t.name, t.model_version.version, t.extra_args) for t in pool.tracks.all()] == [
        ("stable", "v2", "--max-num-seqs 8")]
    back = services.rollout_rollback(plan=plan)
    assert back.worker_args == "--max-num-seqs 4"
    drive(back)
    assert Pool.objects.get(pk=pool.pk).model_version.version == "v1"
    assert [(t.name, t.model_version.version, t.extra_args) for t in pool.tracks.all()] == [
        ("stable", "v1", "--max-num-seqs 4")]


def test_blue_green_preview_gets_the_args_and_keeps_them_after_the_switch(make_pool, v2, settings, fake_http):
    settings.FERRY_AGENT_TOKEN = "agent-token"  # the local backend answers switch_active without a request
    pool = make_pool("chat", role="colocated", replicas=1)
    observe(pool)
    plan = services.rollout_plan_create(pools=[pool], target_model_version=v2, name="bg", strategy="blue_green",
                                        steps=[], scale_down_delay_s=1, worker_args="--max-num-seqs 8")
    services.rollout_start(plan=plan)
    assert {t.name: t.extra_args for t in pool.tracks.all()} == {"green": "--max-num-seqs 8", "stable": ""}
    drive(plan, endpoint=fake_http.url)
    assert [(t.name, t.model_version.version, t.extra_args) for t in pool.tracks.all()] == [
        ("green", "v2", "--max-num-seqs 8")]


@pytest.mark.parametrize(("line", "message"), [
    ("--kv-host 0.0.0.0", "--kv-host cannot be set in worker arguments"),
    ("--kv-link-secret aaaaaaaaaaaaaaaaaaaa", "--kv-link-secret cannot be set in worker arguments"),
    ("--kv-port 9000", "--kv-port cannot be set in worker arguments"),
    ("--device meta", "--device cannot be set in worker arguments"),
    ("--max-num-seqs 100000", "--max-num-seqs must be within 1..1024"),
    ("--kv-cache-memory 4TiB", "--kv-cache-memory must be at most"),
    ("--kv-timeout 100000", "--kv-timeout must be within 0.1..600"),
])
def test_worker_args_outside_the_operator_allowlist_or_bounds_are_400(operator_api, make_pool, v2, line, message):
    """Issue 19: listen addresses, secrets and unbounded sizes never come from an operator's worker_args."""
    pool = make_pool("chat", role="colocated", replicas=1)
    r = operator_api.post("/api/v1/rollouts/", _body(pool, v2, worker_args=line), format="json")
    assert (r.status_code, list(r.json())) == (400, ["worker_args"])
    assert message in r.json()["worker_args"][0]
