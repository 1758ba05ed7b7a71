"""The router's request pipeline: one plan per attempt (torch-free).

::

    eligibility -> scoring -> PD decision -> admission

1. **Eligibility** (:func:`eligibility`): the tracks of the requested ``model`` (every track in tables
   that name no models), the track of the sticky key (:func:`.decisions.choose_track`), and the decode
   or colocated replicas of its model version (same track first), minus ejected replicas and the ones
   already tried. When ejection (:mod:`.breaker`) or failed attempts took the track's last replica, or the
   table lists no ready replica of the track at all (a weight the control plane has not moved yet while the
   track's replicas went unready), the request goes to the track the sticky key picks among the model's
   other tracks that have a replica left (``failover_from`` names the emptied track; the router counts it):
   a release never costs a client its request because the one replica of a canary failed before the breaker
   ejected it, nor because traffic points at a track with no ready replica for a moment. An unknown model raises :class:`UnknownModel` (404);
   nothing left raises :class:`.decisions.NoReplicaAvailable` (503).
2. **Scoring** (:mod:`.scoring`): per candidate, expected cached tokens from the prefix index
   (:class:`.prefix_index.PrefixIndex`, the hybrid hit rule) against load (the uncached prefill this router
   sent it that has no first byte yet, the engine's queue, running requests, KV usage); the session breaks ties.
   ``least_loaded`` (load only, ties to the replica given the fewest requests) and ``round_robin``
   (benchmark references) use neither the index nor the session.
3. **PD decision**: the best-scoring prefill replica of the same model version (KV is only valid for the
   weights that produced it), then the one cost function (:mod:`.pd_cost`) with each replica's hits, the
   link's measured utilisation (``link_share_used``, from the table's link load) and the prefill replica's
   scraped queue depth (``prefill_queue_requests``, each queued request charged this prompt's prefill time):
   remote iff cheaper. The decode pool's bounds (:class:`.table.ThresholdBounds`) then clamp it on the
   *uncached* tokens ``u = N - h_decode``: ``u <= min`` stays local, ``u > max`` goes remote (reasons
   ``bound_min`` / ``bound_max`` when the bound overturned the cost function). The plan's
   ``threshold_tokens`` is the effective threshold: the cost function's cold-fleet crossover under the
   current link load and queue (:func:`.pd_cost.derived_threshold`), clamped to the bounds; on a cold fleet
   the decision is exactly ``N > threshold_tokens`` (bandwidth-aware routing, issue 24). A fixed
   ``threshold_tokens`` in the table overrides all of it on the *uncached* tokens.
4. **Admission**: :func:`admit` books the plan's replicas in the load tracker (admission limits plug in
   here).

The :class:`RoutePlan` fixes the decode replica and the prefill replica; the proxy executes exactly that.
A retry runs the pipeline again with the failed replica excluded (:func:`plan_route` with ``exclude``):
the next replica's hits may change the PD decision.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from inference_worker.router.decisions import LoadTracker, NoReplicaAvailable, choose_track
from inference_worker.router.pd_cost import PDCosts, PDProfile, derived_threshold, pd_costs
from inference_worker.router.prefix_index import PrefixIndex, group_windows
from inference_worker.router.scoring import ScoringWeights, score, session_rank
from inference_worker.router.table import DECODE_ROLES, Replica, RoutingTable, Track

LOCAL_PREFILL, REMOTE_PREFILL, LOCAL_PREFILL_FALLBACK = "local_prefill", "remote_prefill", "local_prefill_fallback"
DECISIONS = (LOCAL_PREFILL, REMOTE_PREFILL, LOCAL_PREFILL_FALLBACK)
"""``decision`` values: prefill on the decode replica; on a prefill replica; a prompt over the fixed
threshold with no same-version prefill replica (prefilled locally instead)."""
REASONS = ("cost", "threshold", "no_prefill_replica", "no_profile", "bound_min", "bound_max")
"""``reason`` values: the cost function decided; the fixed threshold did; no same-version prefill replica;
the cost function lacks an input (KV layout, link or prefill speed) so the prompt stays local; the decode
pool's ``remote_threshold_min_tokens`` kept local a prompt the cost function sent remote; its
``remote_threshold_max_tokens`` sent remote a prompt the cost function kept local."""
CACHE_STATES = ("on", "no_tokenizer", "no_digest_salt", "policy", "unhashable")
"""``cache`` values: cache scoring on; off because the model version has no tokenizer reference (or it did
not load); off because the digest salt (weights sha256, KV dtype) is missing; off by router policy; off
because the prompt's token ids are not valid (outside uint32: the worker refuses it)."""
POLICIES = ("cache_aware", "least_loaded", "round_robin")


class UnknownModel(LookupError):
    """The request names a model no track serves (the router answers 404)."""


@dataclass(frozen=True)
class PromptInfo:
    """The request's prompt as the router sees it (computed off the event loop, but for short bodies)."""

    num_tokens: int
    digests: tuple[bytes, ...] = ()
    """Block digests with the model version's root (empty when cache scoring is off)."""
    cache: str = "on"
    """One of :data:`CACHE_STATES`."""


@dataclass(frozen=True)
class Eligible:
    """Step 1's result."""

    track: Track
    decode: tuple[Replica, ...]
    prefill: tuple[Replica, ...]
    failover_from: str | None = None
    """The track the sticky key chose when it had no replica left (ejected, tried, or none ready in the table;
    ``track`` is then another track), else None."""


@dataclass(frozen=True)
class RoutePlan:
    """Where one attempt of a request goes."""

    track: Track
    decode: Replica
    prefill: Replica | None
    """The prefill replica for ``remote_prefill``, else None."""
    decision: str
    reason: str
    cache: str
    num_prompt_tokens: int
    predicted_cached_tokens: int
    """Tokens the index expects the decode replica to find cached (hybrid hit rule)."""
    prefill_cached_tokens: int = 0
    costs: PDCosts | None = None
    threshold_tokens: float | None = None
    """The effective remote-prefill threshold in uncached tokens (module docstring, step 3): the fixed one, or
    the cost function's crossover clamped to the decode pool's bounds (``inf``: remote never wins, ``-1``: it
    always does); None when no prefill replica or no profile left nothing to compare."""

    @property
    def decode_prefill_tokens(self) -> int:
        """Prompt tokens the decode replica computes: the uncached ones for a local prefill, 0 for remote."""
        return 0 if self.prefill is not None else max(self.num_prompt_tokens - self.predicted_cached_tokens, 0)


def models_served(table: RoutingTable) -> list[str]:
    """OpenAI model names with a track, in table order (empty for tables that name no models)."""
    names = [table.model_info[t.model_version].model for t in table.tracks]
    return list(dict.fromkeys(n for n in names if n))


def eligibility(table: RoutingTable, *, model: str | None, sticky_key: str, exclude: frozenset[str] = frozenset(),
                ejected: frozenset[str] = frozenset(), track: str | None = None) -> Eligible:
    """Step 1 (module docstring); ``track``: a router pinned to one track considers only that track.

    Raises:
        UnknownModel: ``model`` is given, the table names models, and none is ``model``.
        NoReplicaAvailable: the track's model version has no decode replica left, or the pinned
            ``track`` is not in the table (for ``model``).
    """
    tracks = table.tracks
    if model and models_served(table):
        tracks = tuple(t for t in tracks if table.model_info[t.model_version].model == model)
        if not tracks:
            raise UnknownModel(f"model {model!r} is not served here; available: {models_served(table)}")
    if track is not None:
        tracks = tuple(t for t in tracks if t.name == track)
        if not tracks:
            raise NoReplicaAvailable(f"this router serves track {track!r} only, and the routing table has none")
    track = choose_track(tracks, sticky_key)
    skip = exclude | ejected
    decode = _decode_candidates(table, track)
    left = [r for r in decode if r.name not in skip]
    failover_from = None
    if not left:  # emptied by ejection or failed attempts, or no ready replica in the table at all
        others = tuple(t for t in tracks if t is not track
                       and any(r.name not in skip for r in _decode_candidates(table, t)))
        if others:
            failover_from, track = track.name, choose_track(others, sticky_key)
            left = [r for r in _decode_candidates(table, track) if r.name not in skip]
    version = track.model_version
    if not left:
        raise NoReplicaAvailable(f"no decode replica left for model version {version!r} (track {track.name!r}; "
                                 f"{len(exclude)} tried, {len(ejected)} ejected)")
    prefill = tuple(r for r in table.replicas if r.role == "prefill" and r.model_version == version
                    and r.name not in skip)
    return Eligible(track, tuple(left), prefill, failover_from)


def _decode_candidates(table: RoutingTable, track: Track) -> list[Replica]:
    """The decode or colocated replicas of the track's model version, those of the track itself if any."""
    decode = [r for r in table.replicas if r.role in DECODE_ROLES and r.model_version == track.model_version]
    return [r for r in decode if r.track == track.name] or decode


def _best(candidates: tuple[Replica, ...], table: RoutingTable, prompt: PromptInfo, loads: LoadTracker,
          index: PrefixIndex | None, session: str | None, policy: str) -> tuple[Replica, int]:
    """Step 2: the best candidate and its predicted hit tokens."""
    if policy == "round_robin":
        return min(candidates, key=lambda r: loads.assigned[r.name]), 0
    info = table.model_info[candidates[0].model_version]
    layout = table.models.get(candidates[0].model_version)
    use_index = policy == "cache_aware" and index is not None and prompt.digests and layout is not None
    groups = group_windows(layout) if use_index else {}
    ranked = []
    for r in candidates:
        hit, expected = (index.hit_tokens(r.name, prompt.digests, prompt.num_tokens, groups, info.block_size)
                         if use_index else (0, 0.0))
        weights = ScoringWeights.with_overrides(table.pool_weights.get(r.pool))
        tie = session_rank(session, r.name) if session and policy == "cache_aware" else 0
        signals = loads.cache_signals(r) if policy == "cache_aware" else loads.signals(r)
        ranked.append(((score(expected, signals, weights), tie, -loads.assigned[r.name]), r, hit))
    best = max(ranked, key=lambda item: item[0])
    return best[1], best[2]


def plan_route(table: RoutingTable, *, eligible: Eligible, prompt: PromptInfo, loads: LoadTracker,
               index: PrefixIndex | None = None, session: str | None = None, policy: str = "cache_aware") -> RoutePlan:
    """Steps 2 and 3 for the replicas of ``eligible`` (module docstring); changes no state.

    Raises:
        ValueError: unknown ``policy``.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    cache = prompt.cache if policy == "cache_aware" else "policy"
    decode, h_decode = _best(eligible.decode, table, prompt, loads, index, session, policy)
    n = prompt.num_tokens
    base = dict(track=eligible.track, decode=decode, cache=cache, num_prompt_tokens=n, predicted_cached_tokens=h_decode)
    fixed = table.threshold_tokens
    if not eligible.prefill:
        long_prompt = fixed is not None and n - h_decode > fixed
        return RoutePlan(prefill=None, decision=LOCAL_PREFILL_FALLBACK if long_prompt else LOCAL_PREFILL,
                         reason="no_prefill_replica", **base)
    prefill, h_prefill = _best(eligible.prefill, table, prompt, loads, index, session, policy)
    if fixed is not None:
        remote = n - h_decode > fixed
        return RoutePlan(prefill=prefill if remote else None, decision=REMOTE_PREFILL if remote else LOCAL_PREFILL,
                         reason="threshold", prefill_cached_tokens=h_prefill, threshold_tokens=fixed, **base)
    profile = table.profile_for(prefill, decode, prefill_queue_requests=loads.queue_depth.get(prefill.name, 0.0))
    if profile is None:
        return RoutePlan(prefill=None, decision=LOCAL_PREFILL, reason="no_profile", **base)
    costs = pd_costs(profile, n, decode_hit_tokens=h_decode, prefill_hit_tokens=h_prefill)
    bounds = table.bounds_for(decode.pool)
    remote, reason, uncached = costs.remote, "cost", n - h_decode
    if remote and bounds.min_tokens is not None and uncached <= bounds.min_tokens:
        remote, reason = False, "bound_min"
    elif not remote and bounds.max_tokens is not None and uncached > bounds.max_tokens:
        remote, reason = True, "bound_max"
    return RoutePlan(prefill=prefill if remote else None, decision=REMOTE_PREFILL if remote else LOCAL_PREFILL,
                     reason=reason, prefill_cached_tokens=h_prefill, costs=costs,
                     threshold_tokens=bounds.clamp(cost_threshold(profile, table.max_tokens)), **base)


@functools.lru_cache(maxsize=4096)
def cost_threshold(profile: PDProfile, max_tokens: int) -> float:
    """:func:`.pd_cost.derived_threshold` as a number: ``inf`` when remote does not win up to ``max_tokens``.

    Cached per (profile, max_tokens): the bisection costs a few dozen cost evaluations, and the profile only
    changes with the link load (every second) and the prefill replica's queue depth (every scrape)."""
    threshold = derived_threshold(profile, max_tokens)
    return math.inf if threshold is None else float(threshold)


def admit(plan: RoutePlan, loads: LoadTracker) -> None:
    """Step 4: book the plan's replicas (the decode replica's request is in flight until :meth:`LoadTracker.end`,
    its :attr:`RoutePlan.decode_prefill_tokens` pending until :meth:`LoadTracker.prefill_done`)."""
    loads.begin(plan.decode, plan.decode_prefill_tokens)
    if plan.prefill is not None:
        loads.assign(plan.prefill)
