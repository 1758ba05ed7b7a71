"""Planning scenarios: a model, two accelerator types in two datacenters, a link, a workload, SLOs.

A scenario file is JSON or TOML (``tomllib``), e.g. ``scenarios/prfaas.toml``. Datacenter
``compute`` holds the compute-rich accelerators (remote prefill); datacenter ``bandwidth`` holds
the bandwidth-rich ones (decode, and local prefill of short prompts). Units are in the keys
(``_gbps`` Gbit/s, ``_ms``, ``_tflops`` 1e12 FLOP/s, ``_tbps`` 1e12 bytes/s, ``_gb`` 1e9 bytes).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inference_worker.config import DTYPE_BYTES
from inference_worker.planning.geometry import KVGeometry, hypothetical_model_config
from inference_worker.planning.profiles import Accelerator, RooflineProfile, attention_flops_per_kv_byte
from inference_worker.planning.workload import LengthDistribution

SCENARIO_DIR = Path(__file__).with_name("scenarios")
DATACENTERS = ("compute", "bandwidth")


class ScenarioError(ValueError):
    """A scenario file is malformed; the message names the field."""


@dataclass(frozen=True)
class Scenario:
    """Everything the planner and the simulator read."""

    name: str
    """Scenario name (the file's stem unless given)."""
    geometry: KVGeometry
    """The model's KV bytes."""
    profiles: dict[str, RooflineProfile]
    """Per datacenter (``compute``, ``bandwidth``): the replica profile of its accelerator type."""
    bandwidth_gbps: float
    """Cross-datacenter link, Gbit/s."""
    rtt_s: float
    """Link round-trip time, seconds."""
    prompt: LengthDistribution
    """Prompt tokens."""
    output: LengthDistribution
    """Output tokens."""
    ttft_slo_s: float
    """TTFT objective, seconds."""
    tpot_slo_s: float
    """TPOT objective, seconds per output token."""
    slo_attainment: float
    """Share of requests that must meet both objectives (goodput's definition)."""
    budget: float
    """Total accelerator cost every policy gets (cost units)."""
    max_num_seqs: int
    """Decode batch limit per replica."""
    max_link_share: float
    """Link utilisation the planner and the bandwidth-aware policy stay under (0..1)."""
    threshold_bounds: tuple[float, float]
    """Bandwidth-aware bounds as multiples of the planned threshold: (low, high)."""

    @property
    def link_bytes_per_s(self) -> float:
        """Link bandwidth in bytes/s (``bandwidth_gbps * 1e9 / 8``)."""
        return self.bandwidth_gbps * 1e9 / 8

    def with_changes(self, **changes: Any) -> Scenario:
        """A copy with fields replaced (e.g. a smaller budget for a test)."""
        return replace(self, **changes)

    def homogeneous(self, datacenter: str) -> Scenario:
        """The same scenario with both datacenters on ``datacenter``'s accelerator type (homogeneous PD).

        A homogeneous-PD fleet keeps prefill and decode in one datacenter on one type: planned and
        simulated as the ``bandwidth`` datacenter's pools (local prefill, decode) with this profile, at
        this type's cost per replica. Issue 24's baseline gets the better of the two types.

        Raises:
            ScenarioError: an unknown datacenter.
        """
        if datacenter not in self.profiles:
            raise ScenarioError(f"unknown datacenter {datacenter!r}; expected one of {sorted(self.profiles)}")
        profile = self.profiles[datacenter]
        return replace(self, name=f"{self.name}[{datacenter}]",
                       profiles={dc: profile for dc in self.profiles})


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file (``.toml`` or ``.json``), or a name under ``scenarios/`` (``"prfaas"``).

    Raises:
        ScenarioError: unreadable file, a missing key or an invalid value.
    """
    path = Path(path)
    if not path.suffix:
        path = SCENARIO_DIR / f"{path}.toml"
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc}") from exc
    return scenario_from_dict(data, default_name=path.stem)


def scenario_from_dict(data: dict[str, Any], *, default_name: str = "scenario") -> Scenario:
    """Build a :class:`Scenario` from the parsed file (see ``scenarios/prfaas.toml`` for the keys).

    Raises:
        ScenarioError: a missing key or an invalid value.
    """
    try:
        model, eff, work, slo = data["model"], data["efficiency"], data["workload"], data["slo"]
        config = hypothetical_model_config(
            num_layers=int(model["num_layers"]), num_full_layers=int(model["num_full_layers"]),
            sliding_window=model.get("sliding_window"), num_kv_heads=int(model["num_kv_heads"]),
            head_dim=int(model["head_dim"]), kv_dtype=str(model.get("kv_dtype", "bfloat16")))
        geometry = KVGeometry(config, dense=bool(model.get("dense", False)))
        query_heads = model.get("num_query_heads")
        attention = 0.0 if query_heads is None else attention_flops_per_kv_byte(
            int(query_heads), config.num_key_value_heads, DTYPE_BYTES[config.dtype])
        profiles = {}
        for dc in DATACENTERS:
            acc = data["accelerators"][dc]
            accelerator = Accelerator(str(acc.get("name", dc)), float(acc["peak_tflops"]) * 1e12,
                                      float(acc["memory_bandwidth_tbps"]) * 1e12, float(acc["memory_gb"]) * 1e9,
                                      float(acc["cost"]))
            profiles[dc] = RooflineProfile(
                accelerator, float(model["num_params"]), int(eff["accelerators_per_replica"]),
                float(eff["prefill_flops_utilisation"]), float(eff["decode_bandwidth_utilisation"]),
                float(eff["decode_flops_utilisation"]), kv_geometry=geometry,
                attention_flops_per_kv_byte=attention)
        cap = int(work["prompt_cap"])
        bounds = data.get("bandwidth_aware", {})
        return Scenario(
            name=str(data.get("name", default_name)), geometry=geometry, profiles=profiles,
            bandwidth_gbps=float(data["link"]["bandwidth_gbps"]), rtt_s=float(data["link"]["rtt_ms"]) / 1000,
            prompt=LengthDistribution(int(work["prompt_median"]), work.get("prompt_p90"), cap),
            output=LengthDistribution(int(work["output_median"]), work.get("output_p90"),
                                      int(work.get("output_cap", cap))),
            ttft_slo_s=float(slo["ttft_s"]), tpot_slo_s=float(slo["tpot_s"]),
            slo_attainment=float(slo.get("attainment", 0.9)), budget=float(data["fleet"]["budget"]),
            max_num_seqs=int(data["fleet"].get("max_num_seqs", 256)),
            max_link_share=float(bounds.get("max_link_share", 1.0)),
            threshold_bounds=(float(bounds.get("low", 0.5)), float(bounds.get("high", 2.0))),
        )
    except KeyError as exc:
        raise ScenarioError(f"scenario is missing {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"invalid scenario: {exc}") from exc
