"""Reads for the dashboard: page data (fleet, pool, rollout, model versions) and websocket snapshots.

Live numbers come from the telemetry layer (Redis history written by the poller); desired state
and observed replicas from Postgres. Snapshots carry ``seq``, the last sequence number handed out
for the stream's channel-layer group, so a client ignores older messages and detects a gap.
"""

from __future__ import annotations

import time
from collections import defaultdict

from django.conf import settings
from django.db.models import Count, Prefetch, Q

from apps.catalog.models import KV_REPORT_TOKENS, ModelVersion
from apps.fleet.models import Cluster, ClusterLink, Pool, PoolTrack, Router
from apps.operations.models import Action
from apps.operations.tracks import POOL_TRACK_DELETE, POOL_TRACK_SET
from apps.rollouts.desired import requester as rollout_requester
from apps.rollouts.models import GateMeasurement, RolloutPlan
from apps.rollouts.steps import step_text
from apps.rollouts.transitions import allowed_verbs, state_label
from apps.rollouts.validators import COMPARISONS, GATE_ROLES, GATE_SIGNAL_UNITS, GATE_SIGNALS
from apps.telemetry.broadcast import FLEET_GROUP, pool_group
from apps.telemetry.history import SignalHistory
from apps.telemetry.models import Alert
from apps.telemetry.selectors import alert_list, telemetry_history, telemetry_snapshot
from apps.telemetry.services import alert_payload
from apps.telemetry.signals import SIGNAL_NAMES
from inference_worker.registry import BUILTIN_MODELS

SNAPSHOT_HISTORY_S = 300.0
"""Seconds of signal history a pool snapshot carries (charts start with the last five minutes)."""



def pool_stream(pool_id: int) -> str:
    """The client-side name of a pool's stream (``pool.<id>``), carried on every forwarded message."""
    return f"pool.{pool_id}"


def firing_alerts(*, pool_ids: list[int] | None = None) -> list[dict]:
    """Firing alerts (all pools, or ``pool_ids``) as ``alert_payload`` dicts, newest first (1 query)."""
    qs = alert_list(state=Alert.State.FIRING)
    if pool_ids is not None:
        qs = qs.filter(pool_id__in=pool_ids)
    return [alert_payload(a, silenced_until=a.silenced_until) for a in qs]


def _pools_with_counts():
    return (
        Pool.objects.select_related("cluster", "model_version")
        .prefetch_related(Prefetch("tracks", queryset=PoolTrack.objects.select_related("model_version")))
        .annotate(num_ready_replicas=Count("observed_replicas",
                                           filter=Q(observed_replicas__ready=True, observed_replicas__alive=True)))
    )


def pool_summary(pool: Pool, alerts: list[dict]) -> dict:
    """One pool as the fleet page and snapshots show it (``pool`` from ``_pools_with_counts``)."""
    tracks = [{"name": t.name, "replicas": t.replicas, "weight": t.weight, "active": t.active,
               "model_version": str(t.model_version)} for t in pool.tracks.all()]
    return {
        "id": pool.pk, "name": pool.name, "cluster": pool.cluster.name, "cluster_id": pool.cluster_id,
        "datacenter": pool.cluster.datacenter, "role": pool.role, "model_version": str(pool.model_version),
        "gpu": bool(pool.gpu_count), "replicas": sum(t["replicas"] for t in tracks),
        "ready_replicas": pool.num_ready_replicas, "tracks": tracks, "alerts": alerts,
    }


def fleet_overview() -> dict:
    """Clusters grouped by datacenter, links, and pools with desired/ready replicas and firing alerts.

    Returns ``{"datacenters": [{"name", "clusters": [{"id", "name", "kind", "status", "pools": [...]}]}],
    "links": [{"id", "source", "destination", "source_id", "destination_id", "bandwidth_gbps", "rtt_ms",
    "source_pool_ids"}]}``.
    Constant query count (5) whatever the fleet size.
    """
    alerts_by_pool: dict[int, list[dict]] = defaultdict(list)
    for alert in firing_alerts():
        alerts_by_pool[alert["pool_id"]].append(alert)
    pools_by_cluster: dict[int, list[dict]] = defaultdict(list)
    for pool in _pools_with_counts():
        pools_by_cluster[pool.cluster_id].append(pool_summary(pool, alerts_by_pool.get(pool.pk, [])))
    by_dc: dict[str, list[dict]] = defaultdict(list)
    for cluster in Cluster.objects.order_by("datacenter", "name"):
        by_dc[cluster.datacenter or "(no datacenter)"].append(
            {"id": cluster.pk, "name": cluster.name, "kind": cluster.kind, "status": cluster.status,
             "pools": pools_by_cluster.get(cluster.pk, [])})
    links = []
    for link in ClusterLink.objects.select_related("source", "destination"):
        # KV leaves a cluster from its prefill pools: their wire bytes/s are the link's live KV throughput.
        senders = [p["id"] for p in pools_by_cluster.get(link.source_id, []) if p["role"] == Pool.Role.PREFILL]
        links.append({"id": link.pk, "source": link.source.name, "destination": link.destination.name,
                      "source_id": link.source_id, "destination_id": link.destination_id,
                      "bandwidth_gbps": link.bandwidth_gbps, "rtt_ms": link.rtt_ms, "source_pool_ids": senders})
    return {"datacenters": [{"name": dc, "clusters": cs} for dc, cs in by_dc.items()], "links": links}


def pool_detail(pool_id: int) -> dict:
    """A pool's summary (``pool_summary``) with autoscaling bounds. Raises ``Pool.DoesNotExist``."""
    pool = _pools_with_counts().get(pk=pool_id)
    out = pool_summary(pool, firing_alerts(pool_ids=[pool.pk]))
    out.update(min_replicas=pool.min_replicas, max_replicas=pool.max_replicas,
               autoscaling_enabled=pool.autoscaling_enabled)
    return out


def fleet_snapshot(*, history: SignalHistory | None = None) -> dict:
    """What the fleet websocket sends on connect and on resync."""
    history = history or SignalHistory()
    seq = history.current_seq(FLEET_GROUP)  # read before the record: later messages have larger numbers
    return {"type": "snapshot", "stream": "fleet", "seq": seq,
            "record": telemetry_snapshot(pool_id=None, history=history), "alerts": firing_alerts(),
            "overview": fleet_overview()}


def pool_snapshot(pool_id: int, *, history: SignalHistory | None = None,
                  history_s: float = SNAPSHOT_HISTORY_S) -> dict:
    """What a pool websocket sends on connect and on resync: the last ``history_s`` seconds of records
    (oldest first), the firing alerts and the pool's desired/ready replicas. Raises ``Pool.DoesNotExist``."""
    history = history or SignalHistory()
    seq = history.current_seq(pool_group(pool_id))
    return {"type": "snapshot", "stream": pool_stream(pool_id), "seq": seq,
            "records": telemetry_history(pool_id=pool_id, since_s=time.time() - history_s, history=history),
            "alerts": firing_alerts(pool_ids=[pool_id]), "pool": pool_detail(pool_id)}


def rollout_pool_ids(rollout_id: int) -> list[int]:
    """Ids of the pools a rollout moves. Raises ``RolloutPlan.DoesNotExist``."""
    plan = RolloutPlan.objects.get(pk=rollout_id)
    return sorted(plan.pools.values_list("pk", flat=True))


def rollout_detail(rollout_id: int, *, history: bool = True) -> dict:
    """A rollout plan's state, phase, steps and gates (with the telemetry signal of each gate signal,
    ``apps.rollouts.validators.GATE_SIGNALS``) and its pools; with ``history`` (the page, not the websocket
    snapshot: the page reads it once and extends it live) also its recorded weight, replicas, gate measurements
    and step starts.

    Raises ``RolloutPlan.DoesNotExist``.
    """
    plan = RolloutPlan.objects.select_related("target_model_version", "stable_model_version").get(pk=rollout_id)
    gates = [{**g, "telemetry_signal": GATE_SIGNALS.get(g.get("signal"))} for g in plan.gates]
    out = {
        "id": plan.pk, "name": plan.name, "strategy": plan.strategy, "state": plan.state, "phase": plan.phase,
        "current_step_index": plan.current_step_index, "steps": plan.steps, "gates": gates,
        "target_model_version": str(plan.target_model_version), "message": plan.message,
        "target_model_version_id": plan.target_model_version_id,
        "state_label": state_label(plan.state, is_rollback=plan.rollback_of_id is not None),
        "pools": [pool_summary(p, []) for p in _pools_with_counts().filter(rollouts=plan).order_by("pk")],
        "allowed_verbs": allowed_verbs(plan.state),
        "rollback_of": plan.rollback_of_id,
        "rollbacks": list(RolloutPlan.objects.filter(rollback_of=plan).order_by("pk").values_list("pk", flat=True)),
    }
    if history:
        out.update(weight_history=rollout_weight_history(plan), replica_history=rollout_replica_history(plan),
                   measurement_history=rollout_measurement_history(plan), step_marks=rollout_step_marks(plan))
    return out


def target_share(weights: dict[str, int], versions: dict[str, str | None], target: str) -> int:
    """Percent of a pool's traffic on the ``target`` version from its tracks' weights (percent) and versions
    (track name -> version): 100 when every track runs it (whatever the split between them: the finalize moves
    weight between two tracks of the target, and its two writes are recorded one after the other), else the sum
    of the weights of the tracks that run it."""
    if versions and all(v == target for v in versions.values()):
        return 100
    return sum(w for name, w in weights.items() if versions.get(name) == target)


def rollout_weight_history(plan: RolloutPlan) -> dict[str, list[list]]:
    """Traffic on the rollout's target version (percent) over the rollout, per pool: ``{pool id (str): [[ISO time,
    percent], ...]}``, a point each time it changed (:func:`target_share`), from the ``pool.track_set`` and
    ``pool.track_delete`` Actions the rollout asked for (requester ``rollout:<id>``) in the order they were recorded.

    Before them each pool's stable track (``progress.stable_tracks``) serves 100% on ``stable_model_version``; a
    track the rollout created runs the target unless its Action says otherwise. What is
    charted is the version, not a track: when a canary finalizes, the stable track takes the new version and the
    traffic split between the two tracks (e.g. 50/50 by ready replicas) is all on the target, so the chart stays at
    100% instead of reading as a partial rollback; a rollback rollout charts the previous version coming back. A
    page opened after the fact draws the whole rollout from it, then extends it live. One query.
    """
    target = plan.target_model_version.version
    stable_version = plan.stable_model_version.version if plan.stable_model_version_id else None
    stable_tracks = (plan.progress or {}).get("stable_tracks") or {}
    weights: dict[str, dict[str, int]] = {}
    versions: dict[str, dict[str, str | None]] = {}
    out: dict[str, list[list]] = {}
    actions = (Action.objects.filter(kind__in=(POOL_TRACK_SET, POOL_TRACK_DELETE), target_type="pool",
                                     params__requester=rollout_requester(plan))
               .order_by("created_at", "pk").values_list("kind", "target_id", "created_at", "params"))
    for kind, pool_id, at, params in actions:
        key, track, changes = str(pool_id), params.get("track", ""), params.get("changes") or {}
        if key not in weights:
            stable = stable_tracks.get(key)
            weights[key] = {stable: 100} if stable else {}
            versions[key] = {stable: stable_version} if stable else {}
        if kind == POOL_TRACK_DELETE:
            weights[key].pop(track, None)
            versions[key].pop(track, None)
        elif "weight" in changes or "model_version" in changes:
            versions[key].setdefault(track, target)  # a track the rollout created runs the target until told
            if "weight" in changes:
                weights[key][track] = changes["weight"]
            else:
                weights[key].setdefault(track, 0)
            if "model_version" in changes:
                versions[key][track] = changes["model_version"]
        else:
            continue
        if not weights[key]:
            continue
        share = target_share(weights[key], versions[key], target)
        series = out.setdefault(key, [])
        if not series or series[-1][1] != share:
            series.append([at.isoformat(), share])
    return out


def rollout_replica_history(plan: RolloutPlan) -> dict[str, dict[str, list[list]]]:
    """Desired replicas per track over the rollout, per pool: ``{pool id (str): {track: [[ISO time, replicas],
    ...]}}`` in recorded order. The first point of each pool is its stable track at the pool total when the rollout
    started (the ``rollout.start`` Action's time, ``progress.totals``); then every ``pool.track_set`` that set
    ``replicas`` and every ``pool.track_delete`` (0) the rollout asked for (requester ``rollout:<id>``). 2 queries.
    """
    out: dict[str, dict[str, list[list]]] = {}
    start = (Action.objects.filter(kind="rollout.start", target_type="rollout", target_id=str(plan.pk))
             .order_by("created_at", "pk").values_list("created_at", flat=True).first())
    prog = plan.progress or {}
    if start is not None:
        for pool_id, total in (prog.get("totals") or {}).items():
            stable = (prog.get("stable_tracks") or {}).get(pool_id)
            if stable:
                out.setdefault(str(pool_id), {})[stable] = [[start.isoformat(), int(total)]]
    actions = (Action.objects.filter(kind__in=(POOL_TRACK_SET, POOL_TRACK_DELETE), target_type="pool",
                                     params__requester=rollout_requester(plan))
               .order_by("created_at", "pk").values_list("kind", "target_id", "created_at", "params"))
    for kind, pool_id, at, params in actions:
        changes = params.get("changes") or {}
        if kind == POOL_TRACK_DELETE:
            replicas = 0
        elif "replicas" in changes:
            replicas = changes["replicas"]
        else:
            continue
        out.setdefault(str(pool_id), {}).setdefault(params.get("track", ""), []).append([at.isoformat(), replicas])
    return out


MAX_CHARTED_MEASUREMENTS = 5000
"""Gate measurements a rollout page starts with (the newest ones; a gate is measured every tick)."""


def rollout_measurement_history(plan: RolloutPlan) -> list[dict]:
    """The rollout's gate measurements, oldest first (the newest :data:`MAX_CHARTED_MEASUREMENTS`): ``[{"id",
    "gate_index", "step_index", "pool", "track", "signal", "value" (None: no data), "threshold", "comparison",
    "passed", "measured_at" (ISO)}]``, the fields of ``/api/v1/rollout-measurements/``. 1 query."""
    rows = (GateMeasurement.objects.filter(rollout=plan).order_by("-measured_at", "-id")
            .values("id", "gate_index", "step_index", "pool", "track", "signal", "value", "threshold", "comparison",
                    "passed", "measured_at")[:MAX_CHARTED_MEASUREMENTS])
    return [{**r, "measured_at": r["measured_at"].isoformat()} for r in reversed(rows)]


def rollout_step_marks(plan: RolloutPlan) -> list[list]:
    """When each step started: ``[[ISO time, "step N: <step>"], ...]`` from the rollout's ``rollout.step`` Actions
    (``params.step_index``, 0-based in the API, numbered from 1 here). 1 query."""
    marks = []
    for at, params in (Action.objects.filter(kind="rollout.step", target_type="rollout", target_id=str(plan.pk))
                       .order_by("created_at", "pk").values_list("created_at", "params")):
        index = (params or {}).get("step_index")
        if isinstance(index, int) and 0 <= index < len(plan.steps):
            marks.append([at.isoformat(), f"step {index + 1}: {step_text(plan.steps[index])}"])
    return marks


def rollout_form(pool_ids: list[int] | None = None) -> dict:
    """Choices of the rollout create form and its default target version.

    Returns ``{"pools": [{"id", "label", "role", "model", "model_version_id"}] (by cluster, name),
    "versions": [{"id", "label", "model"}] (newest first: created_at, then id), "default_target": id | None}``.
    ``default_target`` is the newest version of the chosen pools' models (``pool_ids``; None: every pool)
    that none of them runs (``Pool.model_version``), else the newest version none runs, else None: a
    canary from the page moves pools to a version they do not run yet. ``rollouts.js`` applies the same
    rule when the pool selection changes. Also the editor's pickers (:func:`rollout_editor_choices`). 3 queries.
    """
    pools = [{"id": p.pk, "label": f"{p.cluster.name}/{p.name} ({p.role})", "role": p.role,
              "model": p.model_version.name, "model_version_id": p.model_version_id}
             for p in Pool.objects.select_related("cluster", "model_version").order_by("cluster__name", "name")]
    versions = [{"id": mv.pk, "label": str(mv), "model": mv.name}
                for mv in ModelVersion.objects.order_by("-created_at", "-pk")]
    chosen = [p for p in pools if pool_ids is None or p["id"] in pool_ids]
    return {"pools": pools, "versions": versions, "default_target": newest_version_not_run(chosen, versions),
            **rollout_editor_choices()}


def rollout_editor_choices() -> dict:
    """The rollout editor's pickers: ``{"routers": [{"id", "label", "cluster_id"}] (the router registry,
    ``fleet.Router``), "gate_signals": [{"name", "telemetry_signal", "unit"}] (the gate signals the validators
    accept whose telemetry signal exists, ``telemetry.signals.SIGNAL_NAMES``), "comparisons", "gate_roles"}``.
    1 query."""
    routers = [{"id": r.pk, "label": f"{r.name} ({r.cluster.name}, {r.url})", "cluster_id": r.cluster_id}
               for r in Router.objects.select_related("cluster").order_by("name")]
    signals = [{"name": name, "telemetry_signal": telemetry, "unit": GATE_SIGNAL_UNITS.get(name, "")}
               for name, telemetry in GATE_SIGNALS.items() if telemetry in SIGNAL_NAMES]
    return {"routers": routers, "gate_signals": signals, "comparisons": list(COMPARISONS),
            "gate_roles": list(GATE_ROLES)}


def newest_version_not_run(pools: list[dict], versions: list[dict]) -> int | None:
    """Id of the first of ``versions`` (newest first) of a model some of ``pools`` serve that none of them
    runs; else the first that none runs; None when every version is run (``rollout_form`` dicts)."""
    running = {p["model_version_id"] for p in pools}
    models = {p["model"] for p in pools}
    free = [v for v in versions if v["id"] not in running]
    same_model = [v for v in free if v["model"] in models]
    return (same_model or free or [{"id": None}])[0]["id"]


def model_version_pools() -> dict[int, list[dict]]:
    """Which pools run each model version: ``{model version id: [{"id", "label", "role", "tracks": [{"name",
    "replicas", "weight"}]}]}`` from the pools' tracks (a rollout's canary or preview track runs the new version
    beside the stable one); a pool without tracks counts under its ``model_version``. Ordered by cluster and pool
    name. 2 queries."""
    out: dict[int, dict[int, dict]] = defaultdict(dict)
    pools = list(Pool.objects.select_related("cluster").order_by("cluster__name", "name"))
    by_pool: dict[int, list[PoolTrack]] = defaultdict(list)
    for track in PoolTrack.objects.filter(pool__in=pools).order_by("name"):
        by_pool[track.pool_id].append(track)
    for pool in pools:
        label = {"id": pool.pk, "label": f"{pool.cluster.name}/{pool.name}", "role": pool.role}
        for track in by_pool[pool.pk]:
            entry = out[track.model_version_id].setdefault(pool.pk, {**label, "tracks": []})
            entry["tracks"].append({"name": track.name, "replicas": track.replicas, "weight": track.weight})
        if not by_pool[pool.pk]:
            out[pool.model_version_id].setdefault(pool.pk, {**label, "tracks": []})
    return {mv_id: list(pools_.values()) for mv_id, pools_ in out.items()}


def model_version_rows() -> list[dict]:
    """Every model version's architecture and KV bytes: per token per layer type, and resident at
    8K/32K/128K tokens hybrid vs all-full (``ModelVersion.kv_bytes``, the one formula in
    ``inference_worker.config``), with the all-full/hybrid ratio; its weights (URI, sha256, architecture
    source) and the pools that run it (:func:`model_version_pools`)."""
    rows = []
    running = model_version_pools()
    for mv in ModelVersion.objects.all():
        kv = []
        for n in KV_REPORT_TOKENS:
            hybrid, full = mv.kv_bytes(n, hybrid=True), mv.kv_bytes(n, hybrid=False)
            kv.append({"tokens": n, "hybrid_bytes": hybrid, "all_full_bytes": full,
                       "ratio": round(full / hybrid, 2) if hybrid else None})
        rows.append({
            "id": mv.pk, "name": mv.name, "version": mv.version, "model_type": mv.model_type,
            "num_hidden_layers": mv.num_hidden_layers, "num_full_layers": mv.num_full_layers,
            "num_sliding_layers": mv.num_sliding_layers, "sliding_window": mv.sliding_window,
            "num_attention_heads": mv.num_attention_heads, "num_key_value_heads": mv.num_key_value_heads,
            "head_dim": mv.head_dim, "dtype": mv.dtype,
            "kv_bytes_per_token_full": mv.kv_bytes_per_token("full_attention"),
            "kv_bytes_per_token_sliding": (mv.kv_bytes_per_token("sliding_attention")
                                           if mv.num_sliding_layers else None),
            "kv": kv, "weights_uri": mv.weights_uri, "sha256": mv.sha256,
            "architecture_source": mv.architecture_source, "pools": running.get(mv.pk, []),
        })
    return rows


def model_version_register_choices() -> dict:
    """The register form's choices: ``{"builtin_models": [{"name", "description"}], "model_roots": [dir, ...]}``
    (``inference_worker.registry.BUILTIN_MODELS``, ``settings.FERRY_MODEL_ROOTS``: where a GGUF may be)."""
    return {"builtin_models": [{"name": name, "description": m.description} for name, m in BUILTIN_MODELS.items()],
            "model_roots": [str(r) for r in settings.FERRY_MODEL_ROOTS]}


def _link_pool(pool: Pool) -> dict:
    return {"id": pool.pk, "name": pool.name, "role": pool.role, "cluster": pool.cluster.name}


def link_detail(link_id: int) -> dict:
    """A link for its page: both ends, configured bandwidth (Gbit/s) and RTT (ms), and the pools whose KV
    counters measure it.

    ``forward_senders``: the source cluster's prefill pools (their wire bytes/s are the source -> destination
    KV throughput, as on the fleet page); ``forward_receivers``: the destination's decode and colocated pools;
    ``reverse_senders`` / ``reverse_receivers``: the same the other way (KV from the destination's prefill
    pools). Raises ``ClusterLink.DoesNotExist``. 2 queries.
    """
    link = ClusterLink.objects.select_related("source", "destination").get(pk=link_id)
    pools = list(Pool.objects.select_related("cluster").filter(cluster_id__in=(link.source_id, link.destination_id))
                 .order_by("name", "pk"))

    def pick(cluster_id: int, roles: tuple[str, ...]) -> list[dict]:
        return [_link_pool(p) for p in pools if p.cluster_id == cluster_id and p.role in roles]

    senders, receivers = (Pool.Role.PREFILL,), (Pool.Role.DECODE, Pool.Role.COLOCATED)
    ends = {name: {"id": c.pk, "name": c.name, "datacenter": c.datacenter or "(no datacenter)"}
            for name, c in (("source", link.source), ("destination", link.destination))}
    return {"id": link.pk, **ends, "bandwidth_gbps": link.bandwidth_gbps, "rtt_ms": link.rtt_ms,
            "forward_senders": pick(link.source_id, senders), "forward_receivers": pick(link.destination_id, receivers),
            "reverse_senders": pick(link.destination_id, senders), "reverse_receivers": pick(link.source_id, receivers)}


RESOLVED_ALERTS_SHOWN = 100


def alert_page_rows() -> dict:
    """The alerts page: every firing alert and the ``RESOLVED_ALERTS_SHOWN`` latest resolved ones, as
    ``alert_payload`` dicts (with ``silenced_until``, ``acknowledged_by``) plus ``pool_name``, newest first;
    and the silence durations offered. 2 queries.
    """
    firing = list(alert_list(state=Alert.State.FIRING).select_related("pool"))
    resolved = list(alert_list(state=Alert.State.RESOLVED).select_related("pool")
                    .order_by("-ended_at", "-pk")[:RESOLVED_ALERTS_SHOWN])
    rows = [{**alert_payload(a, silenced_until=a.silenced_until), "pool_name": a.pool.name}
            for a in (*firing, *resolved)]
    return {"alerts": rows, "silence_choices_s": [900, 3600, 4 * 3600, 24 * 3600]}


def planning_choices() -> dict:
    """What the planning page offers: pools (id, name, cluster, datacenter, role, model version) and links
    (id, ends, Gbit/s, ms). Two queries."""
    pools = [{"id": p.pk, "name": p.name, "cluster": p.cluster.name, "cluster_id": p.cluster_id,
              "datacenter": p.cluster.datacenter, "role": p.role, "model_version": str(p.model_version),
              "model_version_id": p.model_version_id}
             for p in Pool.objects.select_related("cluster", "model_version").order_by("id")]
    links = [{"id": link.pk, "source": link.source.name, "source_id": link.source_id,
              "destination": link.destination.name, "destination_id": link.destination_id,
              "bandwidth_gbps": link.bandwidth_gbps, "rtt_ms": link.rtt_ms}
             for link in ClusterLink.objects.select_related("source", "destination").order_by("id")]
    return {"pools": pools, "links": links}
