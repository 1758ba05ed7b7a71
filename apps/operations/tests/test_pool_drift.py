"""Reconcile's drift rule, table-driven: what observed state makes a pool track need an apply.

Regression: a local agent restarted after a clean stop kept each track's template (desired count 2) but
no processes; the old rule compared only the stored desired count and never re-applied the track.
"""

import pytest

from apps.operations.reconcile import pool_drift
from apps.orchestrators.base import ObservedReplica, ObservedState, ObservedTrack


def _replicas(n: int, *, alive: bool = True, version: str = "v1") -> tuple[ObservedReplica, ...]:
    return tuple(ObservedReplica(name=f"decode-stable-{i}", track="stable", endpoint=f"http://127.0.0.1:{9000 + i}",
                                 ready=alive, alive=alive, version=version) for i in range(n))


@pytest.mark.parametrize(
    ("observed_tracks", "expected"),
    [
        ({"stable": ObservedTrack("stable", 2, 2, _replicas(2))}, {}),
        ({"stable": ObservedTrack("stable", 2, 0, _replicas(2, alive=False))}, {}),  # dead: restarted elsewhere
        ({"stable": ObservedTrack("stable", 2, 3, _replicas(3))}, {}),  # a pod still terminating
        ({"stable": ObservedTrack("stable", 2, 0, ())}, {"stable": "backend runs 0 replicas, desired 2"}),
        ({"stable": ObservedTrack("stable", 2, 1, _replicas(1))}, {"stable": "backend runs 1 replicas, desired 2"}),
        ({"stable": ObservedTrack("stable", 1, 1, _replicas(1))}, {"stable": "backend replicas 1 != desired 2"}),
        ({}, {"stable": "missing in the backend (desired 2)"}),
        ({"stable": ObservedTrack("stable", 2, 2, _replicas(2, version="v0"))},
         {"stable": "replicas ['decode-stable-0', 'decode-stable-1'] run another version than v1"}),
        ({"stable": ObservedTrack("stable", 2, 2, _replicas(2)), "canary": ObservedTrack("canary", 1, 1, ())},
         {"canary": "not desired"}),
    ],
)
def test_drift_from_observed_state(pool, observed_tracks, expected):
    assert pool.tracks.get(name="stable").replicas == 2
    assert pool.tracks.get(name="stable").model_version.version == "v1"
    assert pool_drift(pool, ObservedState(pool_name=pool.name, tracks=observed_tracks)) == expected
