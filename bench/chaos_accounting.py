"""What a chaos cell counts, from the Actions of one rollout (pure functions over the Actions API's rows).

``bench/chaos.py`` reads ``GET /api/v1/actions/`` (dicts with the serializer's fields: ``id``, ``kind``,
``target_type``, ``target_id``, ``params``, ``idempotency_key``, ``status``, ``attempts``) and asks here:

* :func:`rollout_actions` — the rows that belong to rollout ``N``: its own ``rollout.*`` records
  (``target_type="rollout"``, ``target_id="N"``) and the pool-track Actions it requested
  (``params["requester"] == "rollout:N"``, idempotency key ``rollout-N:change-<n>``);
* :func:`steps_applied_twice` — a step the controller carried out more than once. The controller records each
  step it applies as one ``rollout.step`` Action (``params["step_index"]`` for a listed step,
  ``params["phase"]`` for blue-green's ``smoke`` and ``switch``) and each outcome as one ``rollout.complete``;
  a second record of the same step or outcome is a step applied twice. A pool-track change is applied twice
  when two of the rollout's ``pool.track_set`` Actions on the same track carry the same ``changes`` with no
  other change of that track between them (``pool_track_set`` records only fields that differ, so a repeat
  means the controller redid a write it had already made), or when a track is created twice without a
  ``pool.track_delete`` between;
* :func:`actions_lost` — a change the rollout counted but whose Action is missing (a gap in
  ``change-1 .. change-<num_track_changes>``, the count kept in the rollout's ``progress``), and Actions still
  pending or running once the cell has settled (nothing will ever run them);
* :func:`actions_reexecuted` — Actions claimed more than once (``attempts > 1``): a handler re-run after a lost
  lease. Handlers are idempotent (absolute desired state), so this is reported, not counted as applied twice.

No Django, no network: the unit test feeds rows as dicts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence

ACTIVE_STATUSES = ("pending", "running")
TRACK_SET = "pool.track_set"
TRACK_DELETE = "pool.track_delete"
_CHANGE_KEY = re.compile(r"^rollout-(\d+):change-(\d+)$")


def rollout_actions(actions: Iterable[dict], rollout_id: int) -> list[dict]:
    """The Actions of rollout ``rollout_id`` (its ``rollout.*`` records and the pool Actions it requested), by id."""
    requester = f"rollout:{rollout_id}"
    own = [a for a in actions
           if (a.get("target_type") == "rollout" and str(a.get("target_id")) == str(rollout_id))
           or (a.get("params") or {}).get("requester") == requester]
    return sorted(own, key=lambda a: a["id"])


def _step_identity(action: dict) -> str | None:
    params = action.get("params") or {}
    if action["kind"] == "rollout.step":
        if "step_index" in params:
            return f"step {params['step_index']}"
        if "phase" in params:
            return f"phase {params['phase']}"
        return None
    if action["kind"] == "rollout.complete":
        return "complete"
    return None


def steps_applied_twice(actions: Sequence[dict], rollout_id: int) -> list[str]:
    """Each step or change of rollout ``rollout_id`` applied more than once, in words (empty: none).

    ``actions`` may hold other rollouts' rows; they are ignored. See the module docstring for the rules.
    """
    own = rollout_actions(actions, rollout_id)
    found = []
    counts = Counter(identity for identity in map(_step_identity, own) if identity is not None)
    found += [f"{identity} recorded {n} times" for identity, n in sorted(counts.items()) if n > 1]
    last_change: dict[tuple[str, str], str] = {}
    created: set[tuple[str, str]] = set()
    for action in own:
        if action["kind"] not in (TRACK_SET, TRACK_DELETE):
            continue
        params = action.get("params") or {}
        track = (str(action.get("target_id")), str(params.get("track")))
        if action["kind"] == TRACK_DELETE:
            created.discard(track)
            last_change.pop(track, None)
            continue
        changes = params.get("changes") or {}
        if changes.get("created"):
            if track in created:
                found.append(f"pool {track[0]} track {track[1]} created twice (action #{action['id']})")
            created.add(track)
        signature = json.dumps(changes, sort_keys=True)
        if last_change.get(track) == signature:
            found.append(f"pool {track[0]} track {track[1]} change {signature} applied twice "
                         f"(action #{action['id']})")
        last_change[track] = signature
    return found


def actions_lost(actions: Sequence[dict], rollout_id: int, *, num_track_changes: int) -> list[str]:
    """The rollout's Actions that were lost, in words (empty: none).

    ``num_track_changes`` is the rollout's ``progress["num_track_changes"]``: changes ``1..n`` must each have
    an Action keyed ``rollout-<id>:change-<k>``. Any of the rollout's Actions still pending or running is lost
    too: call this once the cell has settled.

    Raises:
        ValueError: ``num_track_changes`` is negative.
    """
    if num_track_changes < 0:
        raise ValueError(f"num_track_changes must be >= 0, got {num_track_changes}")
    own = rollout_actions(actions, rollout_id)
    numbers = set()
    for action in own:
        match = _CHANGE_KEY.match(action.get("idempotency_key") or "")
        if match and int(match.group(1)) == rollout_id:
            numbers.add(int(match.group(2)))
    lost = [f"change {k}: no Action rollout-{rollout_id}:change-{k}"
            for k in range(1, num_track_changes + 1) if k not in numbers]
    lost += [f"action #{a['id']} {a['kind']} still {a['status']}" for a in own if a.get("status") in ACTIVE_STATUSES]
    return lost


def actions_reexecuted(actions: Sequence[dict], rollout_id: int) -> list[str]:
    """The rollout's Actions whose handler was started more than once (``attempts > 1``), in words."""
    return [f"action #{a['id']} {a['kind']} ran {a['attempts']} times"
            for a in rollout_actions(actions, rollout_id) if (a.get("attempts") or 0) > 1]


def failed_requests(results: Iterable[tuple[float, bool, str]], start: float, end: float) -> tuple[int, int, list[str]]:
    """``(num_requests, num_failed, distinct errors)`` of client results ``(started_at, ok, error)`` with
    ``start <= started_at < end`` (seconds on one clock); errors are listed once each, first seen first."""
    window = [r for r in results if start <= r[0] < end]
    errors = list(dict.fromkeys(r[2] for r in window if not r[1]))
    return len(window), sum(1 for r in window if not r[1]), errors


TABLE_COLUMNS = ("scenario", "target", "phase", "at phase", "failed/requests", "final state", "applied twice",
                 "lost", "restart s", "recover s")


def cell_row(cell: dict) -> list[str]:
    """One table row of a cell's JSON record (see ``bench/chaos.py``: ``Cell.to_json``)."""
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    final = cell.get("final_state", "")
    if not cell.get("final_state_ok", False):
        final += " (expected " + str(cell.get("expected_state", "?")) + ")"
    return [cell["scenario"], cell["target"], cell["phase"], "yes" if cell.get("killed_at_phase") else "no",
            f"{cell.get('num_failed', 0)}/{cell.get('num_requests', 0)}", final,
            str(len(cell.get("applied_twice", []))), str(len(cell.get("lost", []))),
            seconds(cell.get("restarted_s")), seconds(cell.get("recover_s"))]


def render_table(cells: Sequence[dict]) -> str:
    """A fixed-width text table of the cells (``TABLE_COLUMNS``)."""
    rows = [list(TABLE_COLUMNS)] + [cell_row(c) for c in cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def rss_growth(samples: Sequence[dict], *, baseline_minute: int) -> dict[str, dict]:
    """Per process, its RSS at ``baseline_minute`` and at the last sample, and the growth between them.

    ``samples`` are ``{"minute": m, "rss_bytes": {process: bytes}}`` in time order. A process missing at the
    baseline or at the end is reported with ``growth`` None. Growth is ``(end - base) / base``.

    Raises:
        ValueError: no sample at or after ``baseline_minute``.
    """
    later = [s for s in samples if s["minute"] >= baseline_minute]
    if not later:
        raise ValueError(f"no RSS sample at or after minute {baseline_minute}")
    base, last = later[0], samples[-1]
    names = sorted(set(base["rss_bytes"]) | set(last["rss_bytes"]))
    growth = {}
    for name in names:
        start, end = base["rss_bytes"].get(name), last["rss_bytes"].get(name)
        ratio = (end - start) / start if start and end is not None else None
        growth[name] = {"base_minute": base["minute"], "end_minute": last["minute"], "base_bytes": start,
                        "end_bytes": end, "growth": ratio}
    return growth
