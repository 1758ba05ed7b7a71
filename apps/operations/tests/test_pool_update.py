"""Operator pool updates (``apps.operations.pools.pool_update``): settings change in place; a new model version
moves the stable track through ``apps.operations.tracks`` (one ``pool.track_set`` Action with the user's name);
holds refuse moving a held pool. Moved from apps/fleet/tests/test_holds.py when the track write left fleet."""

import pytest

from apps.core.errors import ConflictError
from apps.fleet import holds
from apps.fleet.models import PoolTrack
from apps.operations.models import Action
from apps.operations.pools import pool_update

pytestmark = pytest.mark.django_db


@pytest.fixture
def held(monkeypatch):
    """A registry with one check that holds every pool named ``held``."""
    monkeypatch.setattr(holds, "_checks", {})
    holds.pool_hold_register("test", lambda pool: "a test hold" if pool.name == "held" else None)


def test_a_pool_no_check_holds_changes_freely_and_other_fields_always_change(held, make_pool, make_model_version):
    free = pool_update(pool=make_pool(name="free"), model_version=make_model_version("v9"))
    assert free.tracks.get(name="stable").model_version.version == "v9"
    assert pool_update(pool=make_pool(name="held"), drain_timeout_s=7).drain_timeout_s == 7


def test_a_new_model_version_is_one_track_action_by_the_user_and_a_settings_change_is_none(make_pool,
                                                                                         make_model_version,
                                                                                         django_user_model):
    otto = django_user_model.objects.create_user("otto")
    pool = make_pool(name="decode-b")
    pool_update(pool=pool, drain_timeout_s=9, requested_by=otto)
    assert Action.objects.count() == 0
    pool_update(pool=pool, model_version=make_model_version("v9"), requested_by=otto)
    action = Action.objects.get()
    assert (action.kind, action.status, action.pool_id, action.target_id, action.requested_by) == (
        "pool.track_set", "pending", None, str(pool.pk), otto)
    assert action.params == {"track": "stable", "changes": {"model_version": "v9"}, "requester": "otto"}
    assert action.idempotency_key == f"pool-{pool.pk}:model-version-{pool.model_version_id}:after-0"
    assert [line["message"] for line in action.log] == ["requested by otto"]
    pool_update(pool=pool, model_version=pool.model_version, requested_by=otto)  # the same version again: no change
    assert Action.objects.count() == 1


def test_a_held_pool_keeps_its_version_and_its_stable_track(held, make_pool, make_model_version):
    pool = make_pool(name="held")
    with pytest.raises(ConflictError):
        pool_update(pool=pool, model_version=make_model_version("v9"))
    assert PoolTrack.objects.get(pool=pool, name="stable").model_version.version == "v1"
    assert Action.objects.count() == 0
