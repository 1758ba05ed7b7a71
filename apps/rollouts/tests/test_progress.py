"""``RolloutProgress``: the progress JSON round-trips, bad values raise a clear error, older rows (with
``mode``) still load, and migration 0004 moves ``mode`` into ``phase``."""

import importlib
from datetime import UTC, datetime

import pytest
from django.apps import apps as django_apps

from apps.rollouts import services
from apps.rollouts.models import RolloutPlan
from apps.rollouts.progress import Analysis, ProgressError, RolloutProgress

migration = importlib.import_module("apps.rollouts.migrations.0004_typed_phase_and_progress")

STORED = {"totals": {"3": 2}, "stable_tracks": {"3": "stable"}, "new_tracks": {}, "stable_worker_args": {"3": ""},
          "weight": 50, "applied_weight": 20, "await_version": 7, "cleanup": False, "switched_services": {},
          "switch_actions": {}, "num_track_changes": 4,
          "analysis": {"step": 1, "until": "2026-12-01T10:00:00+00:00", "failures": {"0:3": 1}}}


def test_round_trip_keeps_the_keys_and_leaves_out_none():
    progress = RolloutProgress.from_json(STORED)
    assert progress.analysis == Analysis(step=1, until=datetime(2026, 12, 1, 10, tzinfo=UTC), failures={"0:3": 1})
    assert (progress.weight, progress.await_version, progress.switched_at, progress.started) == (50, 7, None, True)
    assert progress.to_json() == STORED
    assert "switched_at" not in progress.to_json()


def test_an_empty_or_missing_progress_is_a_rollout_that_has_not_started():
    assert RolloutProgress.from_json({}) == RolloutProgress.from_json(None) == RolloutProgress()
    assert RolloutProgress().started is False


def test_an_older_row_with_mode_still_loads_and_drops_it():
    assert RolloutProgress.from_json({**STORED, "mode": "canary"}).to_json() == STORED


@pytest.mark.parametrize(("stored", "message"), [
    ({"weight": 150}, "progress.weight must be a percentage 0..100, got 150"),
    ({"weight": True}, "progress.weight must be a percentage 0..100, got True"),
    ({"totals": {"3": -1}}, "progress.totals must be an object of replica counts, got {'3': -1}"),
    ({"cleanup": "yes"}, "progress.cleanup must be true or false, got 'yes'"),
    ({"switched_at": "yesterday"}, "progress.switched_at must be an ISO-8601 time or null, got 'yesterday'"),
    ({"phase": "steps"}, "progress has unknown key(s) ['phase']; known: "),
    ({"analysis": {"until": None}}, "progress.analysis must be an object with a step, got {'until': None}"),
    ({"analysis": {"step": 0, "failures": {"0:1": "x"}}},
     "progress.analysis.failures must be an object of counts, got {'0:1': 'x'}"),
    ([], "progress must be a JSON object, got list"),
])
def test_a_bad_value_raises_a_clear_error(stored, message):
    with pytest.raises(ProgressError) as exc:
        RolloutProgress.from_json(stored)
    assert str(exc.value).startswith(message)


@pytest.mark.django_db
def test_the_model_writes_the_typed_progress_back_on_save(make_pool, v2):
    plan = services.rollout_plan_create(pools=[make_pool(role="colocated")], target_model_version=v2, name="p", strategy="canary",
                                        steps=[{"set_weight": 50}])
    plan.typed_progress.weight = 30
    plan.save()
    assert RolloutPlan.objects.get(pk=plan.pk).progress["weight"] == 30
    RolloutPlan.objects.filter(pk=plan.pk).update(progress={"weight": 40})
    plan.refresh_from_db()
    assert plan.typed_progress.weight == 40


@pytest.mark.django_db
@pytest.mark.parametrize(("strategy", "state", "phase", "mode", "migrated"), [
    ("canary", "progressing", "steps", "canary", "steps"),
    ("canary", "progressing", "", "finalize", "finalizing"),
    ("canary", "aborted", "reverting", "revert", "reverting"),
    ("blue_green", "progressing", "smoke", "preview", "smoke"),
    ("blue_green", "progressing", "odd", "switched", "switched"),
    ("canary", "promoted", "", "finalize", ""),
])
def test_migration_0004_moves_mode_into_phase(make_pool, v2, strategy, state, phase, mode, migrated):
    plan = services.rollout_plan_create(pools=[make_pool(role="colocated")], target_model_version=v2, name="old", strategy=strategy,
                                        steps=[{"pause": {}}])
    RolloutPlan.objects.filter(pk=plan.pk).update(state=state, phase=phase, progress={"weight": 10, "mode": mode})
    migration.mode_to_phase(django_apps, None)
    row = RolloutPlan.objects.get(pk=plan.pk)
    assert (row.phase, row.progress) == (migrated, {"weight": 10})
    migration.phase_to_mode(django_apps, None)
    reverse = {"steps": "canary", "finalizing": "finalize", "reverting": "revert", "smoke": "preview",
               "switched": "switched"}
    expected = {"weight": 10, "mode": reverse[migrated]} if migrated in reverse else {"weight": 10}
    assert RolloutPlan.objects.get(pk=plan.pk).progress == expected
