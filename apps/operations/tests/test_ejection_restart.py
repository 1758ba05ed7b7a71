"""Reconcile restarts a replica the routers' circuit breaker keeps ejecting (seed 003 9.1: eject, then restart).

The telemetry poller stores each replica's ejection counter (``ferry_router_ejections_total`` summed over
routers) in the pool's records; reconcile counts the increases since the replica's last restart and, at
``FERRY_EJECTIONS_BEFORE_RESTART``, asks for a ``pool.restart_replica`` Action naming the ejections.
"""

import time

import pytest

from apps.operations.models import Action
from apps.operations.pool_actions import POOL_RESTART_REPLICA
from apps.operations.reconcile import pool_converge, replicas_ejected_repeatedly
from apps.orchestrators.base import ObservedReplica, ObservedState, ObservedTrack


def test_ejections_are_counter_increases_after_the_last_restart_with_router_restarts_as_resets():
    records = [{"at": 1.0, "ejections": {"r0": 4.0, "r1": 0.0}},
               {"at": 2.0, "ejections": {"r0": 5.0, "r1": 1.0}},
               {"at": 3.0, "ejections": {"r0": 6.0, "r1": 1.0}},
               {"at": 4.0, "ejections": {"r0": 1.0, "r1": 1.0}},  # the router restarted: r0's 1 is new
               {"at": 5.0, "ejections": {"r0": 1.0, "r1": 2.0}},
               {"at": 6.0}]
    assert replicas_ejected_repeatedly(records, since_s={}, limit=1) == {"r0": 3, "r1": 2}
    assert replicas_ejected_repeatedly(records, since_s={}, limit=3) == {"r0": 3}
    # restarted at t=2: only the increases between records after it count (r0: 6 -> 1 is a reset: 1)
    assert replicas_ejected_repeatedly(records, since_s={"r0": 2.0}, limit=1) == {"r0": 1, "r1": 2}
    assert replicas_ejected_repeatedly(records, since_s={"r0": 5.0, "r1": 5.0}, limit=1) == {}


def observed(pool, restart_count=0):
    replicas = tuple(ObservedReplica(name=f"decode-stable-{i}", track="stable", endpoint=f"http://127.0.0.1:{9000 + i}",
                                     ready=True, alive=True, version="v1", restart_count=restart_count)
                     for i in range(2))
    return ObservedState(pool_name=pool.name, tracks={"stable": ObservedTrack("stable", 2, 2, replicas)})


@pytest.mark.django_db
def test_a_replica_ejected_three_times_is_restarted_once_and_counting_starts_again(pool, default_history, settings):
    settings.FERRY_EJECTIONS_BEFORE_RESTART, settings.FERRY_EJECTION_RESTART_WINDOW_S = 3, 600
    now = time.time()
    for i, count in enumerate((0.0, 1.0, 2.0)):
        default_history.append(f"pool:{pool.pk}", now - 30 + i, {"at": now - 30 + i, "ejections": {"decode-stable-1": count}})
    assert pool_converge(pool, observed(pool)) is None  # two ejections: not yet
    assert not Action.objects.filter(kind=POOL_RESTART_REPLICA).exists()
    default_history.append(f"pool:{pool.pk}", now - 20, {"at": now - 20, "ejections": {"decode-stable-1": 3.0}})
    assert pool_converge(pool, observed(pool)) == POOL_RESTART_REPLICA
    action = Action.objects.get(kind=POOL_RESTART_REPLICA)
    assert action.params == {"replica": "decode-stable-1", "reason": "replica decode-stable-1 was ejected 3 times "
                                                                     "by the router's circuit breaker in the last 600 s"}
    Action.objects.filter(pk=action.pk).update(status=Action.Status.SUCCEEDED)
    # after the restart the older ejections no longer count: no second restart
    assert pool_converge(pool, observed(pool, restart_count=1)) is None
    assert Action.objects.filter(kind=POOL_RESTART_REPLICA).count() == 1
    later = time.time() + 1
    for i, count in enumerate((3.0, 4.0, 5.0, 6.0)):
        default_history.append(f"pool:{pool.pk}", later + i, {"at": later + i, "ejections": {"decode-stable-1": count}})
    assert pool_converge(pool, observed(pool, restart_count=1)) == POOL_RESTART_REPLICA
    assert Action.objects.filter(kind=POOL_RESTART_REPLICA).count() == 2
