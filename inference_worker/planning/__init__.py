"""Capacity planning for prefill/decode fleets across datacenters (torch-free).

Modules: ``geometry`` (a model's KV bytes, from :mod:`inference_worker.config`'s one formula and
:class:`inference_worker.kv_transfer.layout.KVLayout`), ``profiles`` (prefill time vs prompt length and
decode step time vs batch: roofline from public specs, or fitted from measurements), ``workload``
(prompt/output length distributions), ``scenario`` (scenario files, JSON or TOML), ``planner``
(replicas per pool, remote-prefill threshold, link load, predicted TTFT/TPOT), ``simulator`` (the
same system as a discrete-event model with ``simpy``) and ``policies`` (the router policies the
simulator compares). Nothing here imports torch: the control plane and the router import it.

The router's ``derived_threshold`` (``inference_worker/router/table.py``) is the link-only special case
of :func:`inference_worker.planning.planner.latency_threshold` (remote prefill free, no queues, the whole
link); a test keeps them equal until the router's one PD cost function calls the planner's instead.
Benchmark: ``bench/planner_prfaas.py``.
"""
