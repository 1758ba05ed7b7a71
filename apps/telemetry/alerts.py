"""Alert rule evaluation on signals (pure), the default GPU-fleet rules, and their Prometheus export.

Semantics follow Prometheus alerting rules: a rule's condition ``signal <comparison>
threshold`` is checked at each poll. When it first holds the alert is *pending* since that
instant; once it has held continuously for ``for_seconds`` it *fires*, with ``started_at`` =
the instant it began to hold (Prometheus' ``activeAt``). The first evaluation at which it no
longer holds — including "no data": a missing signal never fires and ends a firing alert, as a
vanished series does in Prometheus — resolves it with ``ended_at`` = that instant.

Defaults (seeds 002/004, GPU fleets): GPU utilization < 60% for 5 min; TTFT P99 > 500 ms;
request failure rate > 1%; KV cache usage > 90% for 1 min (warning) and > 95% (critical);
KV-transfer failure rate > 1%.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from apps.telemetry.signals import SIGNAL_NAMES, SIGNAL_SPECS, Scope

COMPARISONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
SEVERITIES = ("warning", "critical")


@dataclass(frozen=True)
class RuleSpec:
    """One alert rule as the evaluator sees it. ``key`` identifies the rule (its database id)."""

    key: str
    name: str
    signal: str
    comparison: str
    threshold: float
    for_seconds: float = 0.0
    severity: str = "warning"
    description: str = ""
    enabled: bool = True

    def __post_init__(self):
        if self.signal not in SIGNAL_SPECS:
            raise ValueError(f"rule {self.name!r}: unknown signal {self.signal!r}; known: {', '.join(SIGNAL_NAMES)}")
        if self.comparison not in COMPARISONS:
            raise ValueError(f"rule {self.name!r}: comparison must be one of {', '.join(COMPARISONS)}")
        if self.for_seconds < 0:
            raise ValueError(f"rule {self.name!r}: for_seconds must be >= 0")
        if self.severity not in SEVERITIES:
            raise ValueError(f"rule {self.name!r}: severity must be one of {', '.join(SEVERITIES)}")

    def holds(self, value: float | None) -> bool:
        """Whether the condition holds for ``value``; ``None`` (no data) never holds."""
        return value is not None and COMPARISONS[self.comparison](value, self.threshold)


DEFAULT_RULES: tuple[dict, ...] = (
    {"name": "gpu-utilization-low", "signal": "gpu_utilization", "comparison": "<", "threshold": 0.60,
     "for_seconds": 300, "severity": "warning",
     "description": "GPU utilization under 60% for 5 minutes: the pool is over-provisioned."},
    {"name": "ttft-p99-high", "signal": "ttft_p99_s", "comparison": ">", "threshold": 0.500,
     "for_seconds": 0, "severity": "warning",
     "description": "TTFT P99 above 500 ms."},
    {"name": "request-failure-rate-high", "signal": "error_rate", "comparison": ">", "threshold": 0.01,
     "for_seconds": 0, "severity": "critical",
     "description": "More than 1% of requests fail with a server error."},
    {"name": "kv-cache-usage-high", "signal": "kv_cache_usage_max", "comparison": ">", "threshold": 0.90,
     "for_seconds": 60, "severity": "warning",
     "description": "A replica's KV cache is over 90% full for 1 minute: scale out before preemptions."},
    {"name": "kv-cache-usage-critical", "signal": "kv_cache_usage_max", "comparison": ">", "threshold": 0.95,
     "for_seconds": 0, "severity": "critical",
     "description": "A replica's KV cache is over 95% full: requests are being preempted."},
    {"name": "kv-transfer-failure-rate-high", "signal": "kv_transfer_failure_rate", "comparison": ">",
     "threshold": 0.01, "for_seconds": 0, "severity": "critical",
     "description": "More than 1% of KV cache transfers fail."},
)
"""Fleet-default rules (``pool`` empty); a pool rule with the same name overrides one for that pool."""


@dataclass(frozen=True)
class AlertTransition:
    """A rule started or stopped firing for a scope. Times are seconds; ``ended_at_s`` for resolutions."""

    kind: str  # "fired" | "resolved"
    rule_key: str
    scope_key: str
    started_at_s: float
    value: float | None
    ended_at_s: float | None = None


class AlertEvaluator:
    """Keeps pending/firing state per (rule, scope) between polls and reports transitions."""

    def __init__(self):
        self._pending_since: dict[tuple[str, str], float] = {}
        self._firing: dict[tuple[str, str], float] = {}

    def restore_firing(self, rule_key: str, scope_key: str, started_at_s: float) -> None:
        """Resume an alert that was firing before a restart (from the database)."""
        self._firing[(rule_key, scope_key)] = started_at_s
        self._pending_since[(rule_key, scope_key)] = started_at_s

    def firing(self) -> dict[tuple[str, str], float]:
        """(rule key, scope key) -> started_at_s of every firing alert."""
        return dict(self._firing)

    def evaluate(
        self, rules: Iterable[RuleSpec], scope_key: str, values: Mapping[str, float | None], at_s: float
    ) -> list[AlertTransition]:
        """Evaluate ``rules`` against one scope's signal ``values`` at ``at_s``.

        Firing alerts of this scope whose rule is not in ``rules`` any more (deleted, disabled,
        overridden) are resolved.
        """
        transitions: list[AlertTransition] = []
        seen: set[str] = set()
        for rule in rules:
            seen.add(rule.key)
            key = (rule.key, scope_key)
            value = values.get(rule.signal)
            if rule.holds(value):
                since = self._pending_since.setdefault(key, at_s)
                if key not in self._firing and at_s - since >= rule.for_seconds:
                    self._firing[key] = since
                    transitions.append(AlertTransition("fired", rule.key, scope_key, since, value))
            else:
                self._pending_since.pop(key, None)
                started = self._firing.pop(key, None)
                if started is not None:
                    transitions.append(AlertTransition("resolved", rule.key, scope_key, started, value, at_s))
        for key in [k for k in self._firing if k[1] == scope_key and k[0] not in seen]:
            started = self._firing.pop(key)
            self._pending_since.pop(key, None)
            transitions.append(AlertTransition("resolved", key[0], scope_key, started, None, at_s))
        return transitions



def create_default_rules(alert_rule_model) -> None:
    """Create the fleet-default rules (:data:`DEFAULT_RULES`, ``pool=None``) that do not exist yet; idempotent.

    ``alert_rule_model`` is ``AlertRule``: the migration's historical model (``0002_default_alert_rules``) or the
    current one (the test suite re-creates the defaults after a transactional test flushed every table).
    """
    for rule in DEFAULT_RULES:
        alert_rule_model.objects.get_or_create(name=rule["name"], pool=None,
                                               defaults={k: v for k, v in rule.items() if k != "name"})

def _duration(seconds: float) -> str:
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{round(seconds * 1000)}ms"


def prometheus_rules(
    rules: Iterable[tuple[RuleSpec, str | None]], *, window_s: float = 60.0, group: str = "ferry"
) -> dict:
    """A Prometheus alerting-rules document (dump as YAML) for ``(rule, pool name | None)`` pairs.

    Fleet defaults (pool ``None``) are evaluated per pool (``by (pool)``) and exclude pools that
    override the same rule name (a disabled override silences the default there); pool rules
    select their pool. Disabled rules are not emitted. Signals use the same PromQL as
    the Prometheus source over ``window_s``. Raises ``ValueError`` for a non-positive window.
    """
    if window_s <= 0:
        raise ValueError(f"window must be positive, got {window_s} s")
    rules = list(rules)
    overridden: dict[str, list[str]] = {}
    for rule, pool in rules:
        if pool is not None:  # a pool rule, enabled or not, replaces the default for its pool
            overridden.setdefault(rule.name, []).append(pool)
    out = []
    for rule, pool in rules:
        if not rule.enabled:
            continue
        if pool is not None:
            matchers = Scope(pool).matchers()
        else:
            excluded = sorted(overridden.get(rule.name, []))
            matchers = (("pool", "!~", "|".join(_regex_literal(p) for p in excluded)),) if excluded else (("pool", "!=", ""),)
        expr = SIGNAL_SPECS[rule.signal].promql(matchers, window_s, by=("pool",))
        entry = {
            "alert": _alert_name(rule.name),
            "expr": f"{expr} {rule.comparison} {rule.threshold:g}",
            # A pool rule carries its pool as a label, so it never duplicates the default's labels.
            "labels": {"severity": rule.severity, "ferry_rule": rule.name, **({"pool": pool} if pool else {})},
            "annotations": {"summary": rule.description or f"{rule.signal} {rule.comparison} {rule.threshold:g}",
                            "value": "{{ $value }}"},
        }
        if rule.for_seconds:
            entry["for"] = _duration(rule.for_seconds)
        out.append(entry)
    return {"groups": [{"name": group, "rules": out}]}


def _regex_literal(text: str) -> str:
    """``text`` with RE2 metacharacters escaped (pool names are DNS labels, usually nothing to do)."""
    return re.sub(r"[.^$*+?()\[\]{}|\\]", lambda match: "\\" + match.group(), text)


def _alert_name(name: str) -> str:
    return "Ferry" + "".join(part.capitalize() for part in name.replace("_", "-").split("-"))

