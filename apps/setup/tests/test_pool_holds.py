"""A pool in an active rollout is held (apps.fleet.holds, registered by the rollouts app): the pools API
refuses to move it to another model version or to delete it, and refuses nothing once the plan is gone."""

import pytest

from apps.rollouts.services import rollout_plan_create, rollout_plan_delete


@pytest.fixture
def pool(make_pool):
    return make_pool(name="colocated", role="colocated")


@pytest.fixture
def planned(pool, make_model_version):
    v2 = make_model_version("v2")
    plan = rollout_plan_create(pools=[pool], target_model_version=v2, name="hold", strategy="canary",
                               steps=[{"set_weight": 50}, {"pause": {}}])
    return plan, v2


def test_pending_rollout_holds_its_pool_against_a_version_change_and_delete(admin_api, pool, planned):
    plan, v2 = planned
    moved = admin_api.patch(f"/api/v1/pools/{pool.pk}/", {"model_version": v2.pk}, format="json")
    assert moved.status_code == 409
    assert moved.json()["detail"] == (f"Pool {pool} is part of an active rollout; finish or abort it before "
                                      "changing model_version.")
    deleted = admin_api.delete(f"/api/v1/pools/{pool.pk}/")
    assert deleted.status_code == 409
    assert deleted.json()["detail"] == f"Pool {pool} is part of an active rollout; finish or abort it first."
    rollout_plan_delete(plan=plan)
    assert admin_api.patch(f"/api/v1/pools/{pool.pk}/", {"model_version": v2.pk}, format="json").status_code == 200
    assert admin_api.delete(f"/api/v1/pools/{pool.pk}/").status_code == 204
