"""Capacity planning for prefill/decode fleets across datacenters (torch-free).

Modules: ``geometry`` (a model's KV bytes, from :mod:`inference_worker.config`'s one formula and
:class:`inference_worker.kv_transfer.layout.KVLayout`), ``profiles`` (prefill time vs prompt length and
decode step time vs batch: roofline from public specs, or fitted from measurements), ``workload``
(prompt/output length distributions), ``scenario`` (scenario files, JSON or TOML), ``planner``
(replicas per pool, remote-prefill threshold, link load, predicted TTFT/TPOT), ``simulator`` (the
same system as a discrete-event model with ``simpy``) and ``policies`` (the router policies the
simulator compares). Nothing here imports torch: the control plane and the router import it.

The remote-prefill threshold comes from the router's one PD cost function
(:mod:`inference_worker.router.pd_cost`): :func:`inference_worker.planning.planner.latency_threshold` feeds it
the planner's speeds, queue waits and link share; with none of those it is the router's cold-fleet threshold.
Benchmark: ``bench/planner_prfaas.py``.
"""
