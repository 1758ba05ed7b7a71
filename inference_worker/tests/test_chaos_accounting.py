"""bench/chaos_accounting.py: steps applied twice and Actions lost, counted from Action rows (pure logic)."""

from __future__ import annotations

import pytest

from bench.chaos_accounting import (
    actions_lost,
    actions_reexecuted,
    failed_requests,
    render_table,
    rss_growth,
    steps_applied_twice,
)


def step(id_: int, rollout: int, **params) -> dict:
    return {"id": id_, "kind": "rollout.step", "target_type": "rollout", "target_id": str(rollout),
            "params": params, "idempotency_key": None, "status": "succeeded", "attempts": 1}


def track_set(id_: int, rollout: int, change: int, *, pool: int = 1, track: str = "canary",
              status: str = "succeeded", attempts: int = 1, **changes) -> dict:
    return {"id": id_, "kind": "pool.track_set", "target_type": "pool", "target_id": str(pool),
            "params": {"track": track, "changes": changes, "requester": f"rollout:{rollout}"},
            "idempotency_key": f"rollout-{rollout}:change-{change}", "status": status, "attempts": attempts}


def track_delete(id_: int, rollout: int, change: int, *, pool: int = 1, track: str = "canary") -> dict:
    return {"id": id_, "kind": "pool.track_delete", "target_type": "pool", "target_id": str(pool),
            "params": {"track": track, "requester": f"rollout:{rollout}"},
            "idempotency_key": f"rollout-{rollout}:change-{change}", "status": "succeeded", "attempts": 1}


def clean_canary(rollout: int = 7) -> list[dict]:
    return [
        track_set(1, rollout, 1, created=True, replicas=0, weight=0),
        track_set(2, rollout, 2, replicas=1),
        step(3, rollout, step_index=0, step={"set_weight": 50}),
        track_set(4, rollout, 3, weight=50),
        step(5, rollout, step_index=1, step={"pause": {"seconds": 5}}),
        track_set(6, rollout, 4, weight=100),
        track_delete(7, rollout, 5),
        {"id": 8, "kind": "rollout.complete", "target_type": "rollout", "target_id": str(rollout), "params": {},
         "idempotency_key": None, "status": "succeeded", "attempts": 1},
    ]


def test_a_clean_rollout_has_nothing_applied_twice_or_lost():
    actions = clean_canary()
    assert steps_applied_twice(actions, 7) == []
    assert actions_lost(actions, 7, num_track_changes=5) == []
    assert actions_reexecuted(actions, 7) == []


def test_every_kind_of_repeat_is_counted_once_per_repeat():
    actions = clean_canary() + [
        step(9, 7, phase="switch"), step(10, 7, phase="switch"),          # blue-green switch recorded twice
        step(11, 7, step_index=1, step={"pause": {"seconds": 5}}),        # a listed step recorded twice
        track_set(12, 7, 6, weight=100, track="stable"), track_set(13, 7, 7, weight=100, track="stable"),
        track_set(14, 7, 8, created=True, replicas=0, weight=0, track="green"),
        track_set(15, 7, 9, created=True, replicas=0, weight=0, track="green"),
        {"id": 16, "kind": "rollout.complete", "target_type": "rollout", "target_id": "7", "params": {},
         "idempotency_key": None, "status": "succeeded", "attempts": 1},
    ]
    found = steps_applied_twice(actions, 7)
    assert found == [
        "complete recorded 2 times",
        "phase switch recorded 2 times",
        "step 1 recorded 2 times",
        'pool 1 track stable change {"weight": 100} applied twice (action #13)',
        "pool 1 track green created twice (action #15)",
        'pool 1 track green change {"created": true, "replicas": 0, "weight": 0} applied twice (action #15)',
    ]


def test_a_change_repeated_after_a_delete_or_on_another_track_or_rollout_is_not_a_repeat():
    actions = [
        track_set(1, 7, 1, created=True, replicas=1, weight=0),
        track_delete(2, 7, 2),
        track_set(3, 7, 3, created=True, replicas=1, weight=0),           # recreated after its delete
        track_set(4, 7, 4, replicas=2, pool=1), track_set(5, 7, 5, replicas=2, pool=2),
        track_set(6, 8, 1, replicas=2, pool=1),                           # rollout 8's rows are ignored
        step(7, 8, step_index=0), step(8, 8, step_index=0),
    ]
    assert steps_applied_twice(actions, 7) == []
    assert steps_applied_twice(actions, 8) == ["step 0 recorded 2 times"]


def test_lost_actions_are_gaps_in_the_change_numbers_and_actions_never_finished():
    actions = clean_canary()
    del actions[3]  # change-3 never written
    actions[1] = track_set(2, 7, 2, replicas=1, status="running", attempts=2)
    actions.append(track_set(20, 7, 6, replicas=0, status="pending"))
    assert actions_lost(actions, 7, num_track_changes=7) == [
        "change 3: no Action rollout-7:change-3",
        "change 7: no Action rollout-7:change-7",
        "action #2 pool.track_set still running",
        "action #20 pool.track_set still pending",
    ]
    assert actions_reexecuted(actions, 7) == ["action #2 pool.track_set ran 2 times"]
    with pytest.raises(ValueError, match="num_track_changes"):
        actions_lost(actions, 7, num_track_changes=-1)


def test_failed_requests_counts_the_window_only_and_lists_each_error_once():
    results = [(0.5, True, ""), (1.0, False, "HTTP 503"), (2.0, False, "HTTP 503"), (3.0, False, "ReadError"),
               (9.0, False, "late")]
    assert failed_requests(results, 1.0, 9.0) == (3, 3, ["HTTP 503", "ReadError"])
    assert failed_requests(results, 0.0, 1.0) == (1, 0, [])


def test_rss_growth_from_the_baseline_minute_to_the_end_and_the_table():
    samples = [{"minute": m, "rss_bytes": {"web": 100 + m, "router": 200}} for m in range(7)]
    samples[-1]["rss_bytes"]["model:decode-stable-0"] = 50
    growth = rss_growth(samples, baseline_minute=5)
    assert growth["web"] == {"base_minute": 5, "end_minute": 6, "base_bytes": 105, "end_bytes": 106,
                             "growth": pytest.approx(1 / 105)}
    assert growth["router"]["growth"] == 0.0
    assert growth["model:decode-stable-0"]["growth"] is None
    with pytest.raises(ValueError, match="minute 9"):
        rss_growth(samples, baseline_minute=9)
    table = render_table([{"scenario": "canary", "target": "worker", "phase": "scaling", "killed_at_phase": True,
                           "num_failed": 0, "num_requests": 40, "final_state": "promoted", "final_state_ok": True,
                           "applied_twice": [], "lost": [], "restarted_s": 1.04, "recover_s": 12.34}])
    assert table.splitlines()[1].split() == ["canary", "worker", "scaling", "yes", "0/40", "promoted", "0", "0",
                                             "1.0", "12.3"]


def pool_row(*tracks: tuple[str, int, int, int]) -> dict:
    return {"id": 2, "tracks": [{"name": n, "model_version": v, "replicas": r, "weight": w} for n, v, r, w in tracks]}


def test_kill_phases_are_read_from_the_rollout_and_the_decode_pool():
    from bench.chaos import KILL_PHASES, SCENARIOS, TARGETS, kill_name, phase_reached

    assert set(KILL_PHASES) == set(SCENARIOS) and all(set(p) == set(TARGETS) for p in KILL_PHASES.values())
    canary = {"state": "progressing", "phase": "steps", "strategy": "canary", "target_model_version": 2}
    decode = pool_row(("stable", 1, 1, 50), ("canary", 2, 1, 50))
    loading = [{"track": "canary", "ready": False, "alive": True}, {"track": "stable", "ready": True, "alive": True}]
    assert phase_reached("scaling", canary, decode, loading) is True
    assert phase_reached("scaling", canary, decode, [{**r, "ready": True} for r in loading]) is False
    assert phase_reached("finalizing", {**canary, "phase": "finalizing"}, decode, []) is True
    assert phase_reached("reverting", {**canary, "state": "aborted", "phase": "reverting"}, decode, []) is True
    assert phase_reached("switch", {**canary, "strategy": "blue_green", "phase": "switched"}, decode, []) is True
    assert phase_reached("preview_ready", {**canary, "strategy": "blue_green", "phase": "smoke"}, decode, []) is True
    with pytest.raises(ValueError, match="unknown phase"):
        phase_reached("later", canary, decode, [])
    assert kill_name("model:new", canary, decode) == "model:decode:canary"
    assert kill_name("model:stable", canary, decode) == "model:decode:stable"
    assert kill_name("router", canary, decode) == "router"
    with pytest.raises(LookupError, match="no new track"):
        kill_name("model:new", canary, pool_row(("stable", 1, 1, 100), ("canary", 2, 0, 0)))


def test_final_check_wants_one_track_per_pool_on_the_expected_version():
    from bench.chaos import final_check

    promoted = {"state": "promoted", "message": "", "target_model_version": 2}
    assert final_check("canary", promoted, {"decode": pool_row(("stable", 2, 1, 100))}, 1) == []
    assert final_check("rollback", {**promoted, "state": "aborted"}, {"decode": pool_row(("stable", 1, 1, 100))},
                       1) == []
    left = final_check("canary", promoted, {"decode": pool_row(("stable", 2, 1, 100), ("canary", 2, 0, 0))}, 1)
    assert left == ["pool decode: tracks [('stable', 2, 1), ('canary', 2, 0)] (expected one track on version 2)"]
    assert final_check("rollback", promoted, {"decode": pool_row(("stable", 1, 1, 100))}, 1) == ["rollout promoted ()"]
