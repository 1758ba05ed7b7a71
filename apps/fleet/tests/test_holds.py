"""Pool holds (apps.fleet.holds): a registered check refuses moving a pool to another version or cluster.

A free pool's move (its stable track follows, through operations) is tested in
apps/operations/tests/test_pool_update.py."""

import pytest

from apps.core.errors import ConflictError
from apps.fleet import holds
from apps.fleet.services import pool_update


@pytest.fixture
def held(monkeypatch):
    """A registry with one check that holds every pool named ``held``."""
    monkeypatch.setattr(holds, "_checks", {})
    holds.pool_hold_register("test", lambda pool: "a test hold" if pool.name == "held" else None)


def test_a_held_pool_keeps_its_model_version(held, make_pool, make_model_version):
    pool = make_pool(name="held")
    with pytest.raises(ConflictError) as info:
        pool_update(pool=pool, model_version=make_model_version("v9"))
    assert str(info.value) == ("Pool dc-a/held is part of a test hold; finish or abort it before changing "
                               "model_version.")


def test_registering_the_same_name_twice_keeps_one_check(monkeypatch, make_pool):
    monkeypatch.setattr(holds, "_checks", {})
    holds.pool_hold_register("x", lambda pool: "first")
    holds.pool_hold_register("x", lambda pool: None)
    assert holds.pool_hold_reason(make_pool(name="any")) is None
