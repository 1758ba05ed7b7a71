"""Prefill/decode coordination during a rollout: no replica of a model version stops while the router can still
send that version traffic. The router splits requests by track weight and then sends a long prompt to a prefill
replica of the same model version (``inference_worker.router.decisions``); a prefill pool whose stable track
went to zero while the decode stable track still had weight made every long v1 prompt fall back to local
prefill (``ferry_router_decisions_total{decision="local_prefill_fallback",track="stable"}``).

Regression (README demo, prefill pool 1 replica, decode pool 2): on Resume of the final "pause until resumed"
step the canary went to 100% paced by the decode pool's second canary replica; the prefill pool's stable
track was scaled 1 -> 0 in that tick while the canary weight stayed at 50% for another 20 s.

The whole kind: every path that moves traffic (step to 100, promote, abort at a step or at 100%, finalize,
blue-green switch and switch-back), with prefill or decode slow to become ready and a router that applies
each table one tick late, is driven tick by tick; after every tick no model version that has weight in the
table the router applied, or in the one just published, is left without a desired replica in any pool.
"""

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.fleet.models import PoolTrack, Replica
from apps.fleet.selectors import routing_table_current
from apps.fleet.testing import router_for
from apps.rollouts import services
from apps.rollouts.controller import rollout_tick
from apps.rollouts.tests.conftest import due_now, table_weights

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quick_agent")]


class Backend:
    """Replicas follow the desired tracks; in a ``slow`` pool a new replica is ready one observation later."""

    def __init__(self, slow: tuple[str, ...] = (), endpoint: str = "") -> None:
        self.slow, self.endpoint, self.seen = slow, endpoint, set()

    def observe(self, pool, *, hold: tuple[str, ...] = ()) -> None:
        """``hold``: tracks whose new replicas do not become ready this time."""
        keep = []
        for track in PoolTrack.objects.filter(pool=pool).select_related("model_version"):
            version = track.model_version.version
            for i in range(track.replicas):
                name = f"{pool.name}-{track.name}-{i}"
                key = (name, version)
                ready = key in self.seen or (pool.name not in self.slow and track.name not in hold)
                if track.name not in hold:
                    self.seen.add(key)
                Replica.objects.update_or_create(pool=pool, name=name, defaults={
                    "track": track.name, "endpoint": self.endpoint or f"http://127.0.0.1:1/{name}", "ready": ready,
                    "alive": True, "version": version, "last_seen": timezone.now()})
                keep.append(name)
        gone = Replica.objects.filter(pool=pool).exclude(name__in=keep)
        self.seen -= {(r.name, r.version) for r in gone}
        gone.delete()


class Router:
    """The router's side: which table it applied (the fake ``/ready`` reports its version)."""

    def __init__(self, fake_http) -> None:
        self.http, self.applied = fake_http, None

    def apply(self) -> None:
        table = routing_table_current()
        self.http.router_version, self.applied = table.version, table.content


def stranded(pools, content) -> list[str]:
    """Pools left with no desired replica of a model version that has weight in the routing table ``content``."""
    out = []
    for track in (content or {}).get("tracks", []):
        if track["weight"] == 0:
            continue
        for pool in pools:
            replicas = sum(PoolTrack.objects.filter(pool=pool, model_version__version=track["model_version"])
                           .values_list("replicas", flat=True))
            if replicas == 0:
                out.append(f"{pool.name}: {track['model_version']} has {track['weight']}% ({track['name']}) "
                           "and no replica")
    return out


def drive_checked(plan, pools, backend, router, *, until, max_ticks=60) -> list[str]:
    """Tick until ``until`` holds (states, or a test of the plan; any cleanup done), the router applying the
    newest table every other tick; asserts after every tick that no version with traffic lost its replicas."""
    done = until if callable(until) else (lambda p: p.state in until and not p.progress.get("cleanup"))
    outcomes = []
    for i in range(max_ticks):
        plan.refresh_from_db()
        if done(plan):
            return outcomes
        for pool in pools:
            backend.observe(pool)
        if i % 2:
            router.apply()
        outcomes.append(rollout_tick(rollout_id=plan.pk, now=due_now(plan) + timedelta(milliseconds=1)))
        for content in (router.applied, routing_table_current().content):
            assert stranded(pools, content) == [], (outcomes, plan.message)
    plan.refresh_from_db()
    raise AssertionError(f"{plan.name} still {plan.state} after {max_ticks} ticks: {outcomes} ({plan.message})")


def _tracks(pool):
    return {t.name: (t.replicas, t.weight) for t in PoolTrack.objects.filter(pool=pool)}


@pytest.fixture
def demo_fleet(make_pool, v2, fake_http):
    """The README demo: a prefill pool with 1 replica and a decode pool scaled to 2."""
    prefill = make_pool("prefill", role="prefill", replicas=1)
    decode = make_pool("decode", role="decode", replicas=2)
    return prefill, decode


def _canary(pools, v2, fake_http, steps, **fields):
    plan = services.rollout_plan_create(pools=list(pools), target_model_version=v2, name="c", strategy="canary",
                                        steps=steps, router=router_for(fake_http.url), **fields)
    return services.rollout_start(plan=plan)


def test_resume_to_100_keeps_the_prefill_stable_replica_while_decode_stable_has_traffic(demo_fleet, v2, fake_http):
    prefill, decode = demo_fleet
    backend, router = Backend(), Router(fake_http)
    for pool in demo_fleet:
        backend.observe(pool)
    plan = _canary(demo_fleet, v2, fake_http, [{"set_weight": 50}, {"pause": {}}])
    drive_checked(plan, demo_fleet, backend, router, until=("paused",))
    assert (_tracks(prefill), _tracks(decode)) == ({"stable": (1, 50), "canary": (1, 50)},
                                                   {"stable": (1, 50), "canary": (1, 50)})
    router.apply()
    plan = services.rollout_resume(plan=plan)
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "to-100"
    assert _tracks(decode)["canary"] == (2, 50)  # the second decode canary starts
    for tick in range(2):  # ... and takes its time; the router is up to date
        backend.observe(prefill)
        backend.observe(decode, hold=("canary",))
        router.apply()
        assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"
        assert table_weights() == {"canary": ("v2", 50), "stable": ("v1", 50)}
        assert _tracks(prefill) == {"stable": (1, 50), "canary": (1, 50)}  # was (0, 50) in the first tick
        plan.refresh_from_db()
        assert plan.message == ("Waiting for dc-a/prefill stable to lose its traffic before its last replica stops "
                                "(gemma-like:v1 still gets 50%).")
    backend.observe(decode)  # the second decode canary is ready: the weight moves, replicas stay for the router
    backend.observe(prefill)
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"
    assert table_weights() == {"canary": ("v2", 100), "stable": ("v1", 0)}
    assert (_tracks(prefill)["stable"], _tracks(decode)["stable"]) == ((1, 0), (1, 0))
    router.apply()
    assert rollout_tick(rollout_id=plan.pk, now=due_now(plan)) == "waiting"
    assert (_tracks(prefill)["stable"], _tracks(decode)["stable"]) == ((0, 0), (0, 0))  # now they may go
    drive_checked(plan, demo_fleet, backend, router, until=("promoted",))
    assert (_tracks(prefill), _tracks(decode)) == ({"stable": (1, 100)}, {"stable": (2, 100)})


VERBS = {"steps to 100 and finalize": services.rollout_resume, "promote at a pause": services.rollout_promote,
         "abort at a pause": services.rollout_abort}
PATH_STEPS = [{"set_weight": 25}, {"pause": {"seconds": 1}}, {"set_weight": 50}, {"pause": {}}]


CANARY_CASES = [((1, 2), slow, path) for slow in ("prefill", "decode") for path in sorted(VERBS)] + [
    ((2, 3), slow, "steps to 100 and finalize") for slow in ("prefill", "decode")]


@pytest.mark.parametrize(("sizes", "slow", "path"), CANARY_CASES,
                         ids=[f"prefill{p}-decode{d}-{slow}-slow-{path.replace(' ', '-')}"
                              for (p, d), slow, path in CANARY_CASES])
def test_canary_paths_never_leave_a_version_with_traffic_without_replicas(make_pool, v2, fake_http, sizes, slow,
                                                                         path):
    pools = (make_pool("prefill", role="prefill", replicas=sizes[0]),
             make_pool("decode", role="decode", replicas=sizes[1]))
    backend, router = Backend(slow=(slow,)), Router(fake_http)
    for pool in pools:
        backend.observe(pool)
    plan = _canary(pools, v2, fake_http, PATH_STEPS)
    drive_checked(plan, pools, backend, router, until=("paused",))
    VERBS[path](plan=plan)
    final = "aborted" if path.startswith("abort") else "promoted"
    drive_checked(plan, pools, backend, router, until=(final,))
    version = "v1" if final == "aborted" else "v2"
    for pool, size in zip(pools, sizes, strict=True):
        assert {t.name: (t.model_version.version, t.replicas) for t in pool.tracks.all()} == {"stable": (version, size)}


@pytest.mark.parametrize("slow", ["prefill", "decode"])
def test_abort_at_100_keeps_the_canary_prefill_until_decode_stable_serves_again(make_pool, v2, fake_http, slow):
    pools = (make_pool("prefill", role="prefill", replicas=1), make_pool("decode", role="decode", replicas=2))
    backend, router = Backend(slow=(slow,)), Router(fake_http)
    for pool in pools:
        backend.observe(pool)
    plan = _canary(pools, v2, fake_http, [{"set_weight": 100}, {"pause": {}}])
    drive_checked(plan, pools, backend, router, until=("paused",))
    assert table_weights() == {"canary": ("v2", 100), "stable": ("v1", 0)}
    assert [_tracks(p)["stable"] for p in pools] == [(0, 0), (0, 0)]  # nothing of v1 left running
    plan = services.rollout_abort(plan=plan)
    assert table_weights() == {"canary": ("v2", 100), "stable": ("v1", 0)}  # stable has no ready replica yet
    drive_checked(plan, pools, backend, router, until=("aborted",))
    assert [_tracks(p) for p in pools] == [{"stable": (1, 100)}, {"stable": (2, 100)}]


def test_without_surge_room_traffic_moves_before_the_last_replica_stops(make_pool, v2, fake_http):
    """max_surge 0 (Kubernetes' maxUnavailable 1): the last stable replica can only go after its traffic moved,
    so the weight goes to the target on the ready canaries first instead of the rollout waiting forever."""
    pools = (make_pool("prefill", role="prefill", replicas=2), make_pool("decode", role="decode", replicas=2))
    backend, router = Backend(slow=("decode",)), Router(fake_http)
    for pool in pools:
        backend.observe(pool)
    plan = _canary(pools, v2, fake_http, [{"set_weight": 50}, {"set_weight": 100}], max_surge=0)
    outcomes = drive_checked(plan, pools, backend, router, until=("promoted",))
    assert outcomes.count("set_weight") == 2
    assert [_tracks(p) for p in pools] == [{"stable": (2, 100)}, {"stable": (2, 100)}]


@pytest.mark.parametrize("abort", [False, True], ids=["switch", "switch-back"])
@pytest.mark.parametrize("slow", ["prefill", "decode"])
def test_blue_green_switch_and_switch_back_keep_replicas_for_every_version_with_traffic(make_pool, v2, fake_http,
                                                                                       settings, abort, slow):
    settings.FERRY_AGENT_TOKEN = "agent-token"  # the local backend answers switch_active without a request
    pools = (make_pool("prefill", role="prefill", replicas=1), make_pool("decode", role="decode", replicas=2))
    backend, router = Backend(slow=(slow,), endpoint=fake_http.url), Router(fake_http)
    for pool in pools:
        backend.observe(pool)
    plan = services.rollout_plan_create(pools=list(pools), target_model_version=v2, name="bg",
                                        strategy="blue_green", steps=[], router=router_for(fake_http.url),
                                        scale_down_delay_s=0 if not abort else 3600)
    plan = services.rollout_start(plan=plan)
    if not abort:
        drive_checked(plan, pools, backend, router, until=("promoted",))
        assert [_tracks(p) for p in pools] == [{"green": (1, 100)}, {"green": (2, 100)}]
        return
    drive_checked(plan, pools, backend, router, until=lambda p: "switched_at" in p.progress)  # in the delay
    assert table_weights() == {"green": ("v2", 100), "stable": ("v1", 0)}
    plan = services.rollout_abort(plan=plan)
    assert [_tracks(p)["green"] for p in pools] == [(1, 0), (2, 0)]  # traffic left; replicas wait for the router
    drive_checked(plan, pools, backend, router, until=("aborted",))
    assert [_tracks(p) for p in pools] == [{"stable": (1, 100)}, {"stable": (2, 100)}]
