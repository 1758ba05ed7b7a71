"""Writes for the dashboard: the CPU alert-rule profile for demo fleets without GPUs.

The fleet-default rules (``apps.telemetry.alerts.DEFAULT_RULES``, seeds 002/004) describe GPU
fleets: TTFT P99 > 500 ms, GPU utilization < 60%. A CPU worker running Gemma 3 270M on a few
cores answers a short prompt in about a second and has no GPU at all, so those defaults would
fire forever or mean nothing. ``pool_alert_rules_apply_cpu`` gives one pool its own rules
(pool rules override defaults of the same name; see ``apps.telemetry.selectors.alert_rules_effective``):

- ``ttft-p99-high``: TTFT P99 > 10 s held for 30 s (a request queued behind a full batch);
- ``tpot-p99-high``: TPOT P99 > 1 s held for 30 s (decode stalled);
- ``engine-busy-high``: engine busy ratio > 0.95 held for 120 s (the CPU engine is saturated;
  the busy ratio is what CPU workers report instead of GPU utilization);
- ``gpu-utilization-low``: disabled for the pool (no GPU: the signal has no data).

Error-rate, KV cache and KV-transfer rules do not depend on the hardware and keep their defaults.
"""

from __future__ import annotations

from django.db import transaction

from apps.fleet.models import Pool
from apps.telemetry.models import AlertRule
from apps.telemetry.services import alert_rule_create, alert_rule_update

CPU_RULES: tuple[dict, ...] = (
    {"name": "ttft-p99-high", "signal": "ttft_p99_s", "comparison": ">", "threshold": 10.0, "for_seconds": 30,
     "severity": "warning", "enabled": True,
     "description": "CPU profile: TTFT P99 above 10 s for 30 s (requests queue behind a full batch)."},
    {"name": "tpot-p99-high", "signal": "tpot_p99_s", "comparison": ">", "threshold": 1.0, "for_seconds": 30,
     "severity": "warning", "enabled": True,
     "description": "CPU profile: TPOT P99 above 1 s for 30 s (decode is stalled)."},
    {"name": "engine-busy-high", "signal": "engine_busy_ratio", "comparison": ">", "threshold": 0.95,
     "for_seconds": 120, "severity": "warning", "enabled": True,
     "description": "CPU profile: the engine is busy over 95% of the time for 2 minutes; scale out."},
    {"name": "gpu-utilization-low", "signal": "gpu_utilization", "comparison": "<", "threshold": 0.60,
     "for_seconds": 300, "severity": "warning", "enabled": False,
     "description": "CPU profile: disabled, the pool has no GPU."},
)
"""The CPU profile: pool rules created or updated by ``pool_alert_rules_apply_cpu``."""


@transaction.atomic
def pool_alert_rules_apply_cpu(*, pool: Pool) -> list[AlertRule]:
    """Create or update ``pool``'s rules to the CPU profile (``CPU_RULES``); idempotent.

    Returns the pool's profile rules in ``CPU_RULES`` order. Raises ``ValueError`` for a pool
    with GPUs (``gpu_count > 0``): GPU pools keep the fleet defaults.
    """
    if pool.gpu_count:
        raise ValueError(f"Pool {pool} has {pool.gpu_count} GPU(s) ({pool.gpu_kind}); the CPU alert profile is for "
                         "pools without GPUs. Edit its rules in the admin instead.")
    existing = {r.name: r for r in AlertRule.objects.select_for_update().filter(pool=pool)}
    rules = []
    for spec in CPU_RULES:
        rule = existing.get(spec["name"])
        if rule is None:
            rules.append(alert_rule_create(pool=pool, **spec))
        else:
            changes = {k: v for k, v in spec.items() if k != "name"}
            rules.append(alert_rule_update(rule=rule, **changes))
    return rules
