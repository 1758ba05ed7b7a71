"""Validators for a rollout plan's ``steps`` and ``gates`` JSON.

Steps (a list; each item is an object with exactly one key):
``{"set_weight": 0..100}`` (canary traffic percent), ``{"pause": {}}`` (until promoted) or
``{"pause": {"seconds": N}}``, ``{"analysis": {"gates": [...], "duration_s": N}}`` (both optional;
no gates = the plan's gates). Gates: ``{"signal", "threshold", "comparison", "window_s",
"failure_limit", "relative_to_stable", "role"}`` (the last three optional); a gate passes while
``value <comparison> threshold`` holds, and the rollout aborts after more than ``failure_limit``
consecutive failed evaluations. ``relative_to_stable`` compares new/stable instead of the raw
value; ``role`` (prefill, decode, colocated) picks the pools it is measured on (default: the
serving pools). Gate signal names map to telemetry signals in ``GATE_SIGNALS``.
"""

from __future__ import annotations

import math
from typing import Any

from django.core.exceptions import ValidationError

GATE_SIGNALS = {
    "error_rate": "error_rate",
    "ttft_p99_seconds": "ttft_p99_s",
    "tpot_p99_seconds": "tpot_p99_s",
    "kv_transfer_error_rate": "kv_transfer_failure_rate",
    "num_requests_waiting": "num_requests_waiting",
    "ejected_replicas": "router_ejected_replicas",
}
"""Gate signal name -> telemetry signal name (``apps.telemetry.signals.SIGNAL_SPECS``)."""
GATE_SIGNAL_UNITS = {
    "error_rate": "ratio 0..1 of requests",
    "ttft_p99_seconds": "s",
    "tpot_p99_seconds": "s",
    "kv_transfer_error_rate": "ratio 0..1 of KV transfers",
    "num_requests_waiting": "requests",
    "ejected_replicas": "replicas",
}
"""Gate signal name -> the unit its threshold is in (the rollout editor shows it beside the threshold)."""
GATE_ROLES = ("prefill", "decode", "colocated")
COMPARISONS = ("<", "<=", ">", ">=")
MAX_WINDOW_S = 86_400
MAX_PAUSE_S = 7 * 86_400
MAX_STEPS = 100


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_gate(gate: Any, where: str) -> None:
    if not isinstance(gate, dict):
        raise ValidationError(f"{where} must be an object.")
    keys = {"signal", "threshold", "comparison", "window_s", "failure_limit", "relative_to_stable", "role"}
    unknown, missing = sorted(set(gate) - keys), sorted({"signal", "threshold", "comparison", "window_s"} - set(gate))
    if unknown or missing:
        raise ValidationError(f"{where}: unknown keys {unknown}, missing keys {missing}.")
    if gate["signal"] not in GATE_SIGNALS:
        raise ValidationError(f"{where}: signal must be one of {', '.join(GATE_SIGNALS)}.")
    threshold = gate["threshold"]
    if not isinstance(threshold, int | float) or isinstance(threshold, bool) or not math.isfinite(threshold):
        raise ValidationError(f"{where}: threshold must be a finite number.")
    if gate["comparison"] not in COMPARISONS:
        raise ValidationError(f"{where}: comparison must be one of {' '.join(COMPARISONS)}.")
    if not _is_int(gate["window_s"]) or not 1 <= gate["window_s"] <= MAX_WINDOW_S:
        raise ValidationError(f"{where}: window_s must be an integer in 1..{MAX_WINDOW_S}.")
    if not isinstance(gate.get("relative_to_stable", False), bool):
        raise ValidationError(f"{where}: relative_to_stable must be true or false.")
    if "role" in gate and gate["role"] not in GATE_ROLES:
        raise ValidationError(f"{where}: role must be one of {', '.join(GATE_ROLES)}.")
    limit = gate.get("failure_limit", 0)
    if not _is_int(limit) or not 0 <= limit <= 1000:
        raise ValidationError(f"{where}: failure_limit must be an integer in 0..1000.")


def validate_gates(value: Any) -> None:
    """A list of gates (see module docstring)."""
    if not isinstance(value, list):
        raise ValidationError("Gates must be a JSON list.")
    for i, gate in enumerate(value):
        _check_gate(gate, f"Gate {i + 1}")


def validate_steps(value: Any) -> None:
    """A list of steps (see module docstring)."""
    if not isinstance(value, list):
        raise ValidationError("Steps must be a JSON list.")
    if len(value) > MAX_STEPS:
        raise ValidationError(f"At most {MAX_STEPS} steps.")
    for i, step in enumerate(value, start=1):  # operators count steps from 1
        if not isinstance(step, dict) or len(step) != 1:
            raise ValidationError(f"Step {i} must be an object with exactly one key: set_weight, pause or analysis.")
        (kind, arg), = step.items()
        if kind == "set_weight":
            if not _is_int(arg) or not 0 <= arg <= 100:
                raise ValidationError(f"Step {i}: set_weight must be an integer percent in 0..100, got {arg!r}.")
        elif kind == "pause":
            if not isinstance(arg, dict) or set(arg) - {"seconds"}:
                raise ValidationError(f'Step {i}: pause takes {{}} (until promoted) or {{"seconds": N}}.')
            if "seconds" in arg and (not _is_int(arg["seconds"]) or not 1 <= arg["seconds"] <= MAX_PAUSE_S):
                raise ValidationError(f"Step {i}: pause seconds must be an integer in 1..{MAX_PAUSE_S}.")
        elif kind == "analysis":
            if not isinstance(arg, dict) or set(arg) - {"gates", "duration_s"}:
                raise ValidationError(f"Step {i}: analysis takes an object with optional gates and duration_s.")
            if "gates" in arg:
                if not isinstance(arg["gates"], list):
                    raise ValidationError(f"Step {i}: analysis gates must be a list.")
                for j, gate in enumerate(arg["gates"]):
                    _check_gate(gate, f"Step {i} gate {j + 1}")
            if "duration_s" in arg and (not _is_int(arg["duration_s"]) or not 1 <= arg["duration_s"] <= MAX_WINDOW_S):
                raise ValidationError(f"Step {i}: analysis duration_s must be an integer in 1..{MAX_WINDOW_S}.")
        else:
            raise ValidationError(f"Step {i}: unknown step {kind!r}; use set_weight, pause or analysis.")
