"""Names of Ferry's own HTTP headers (``X-Ferry-*``), shared by the router, the worker server and tests.

This module is the only place that spells them (a test checks every other module's string constants).
Names are lowercase, the form ASGI servers and HTTP/2 deliver; HTTP header names are case-insensitive
(RFC 9110, section 5.1), and Starlette's and httpx's header mappings look them up case-insensitively, so
a client may send ``X-Ferry-Sticky-Key`` and the router reads it as :data:`STICKY_KEY`.

Router -> decode worker (request): :data:`TRACK`, :data:`MODEL_VERSION`, :data:`DECISION` and, when the
router chose remote prefill, :data:`PREFILL_ENDPOINT` (the prefill replica's URL).
Router -> client (response): :data:`REPLICA`, :data:`TRACK`, :data:`DECISION`, :data:`DECISION_REASON`; worker -> client: :data:`CACHED_TOKENS`.
Client -> router (request): :data:`STICKY_KEY` (the key hashed to pick a track; default the request id).
Control plane's profiler -> worker (request): :data:`PROFILING`.
Decode worker -> prefill worker (``POST /internal/prefill``): :data:`KV_SIGNATURE` (hex HMAC-SHA256 of
the body under the per-link secret) and, only in test runs, :data:`FAULT_KV` (see
:mod:`inference_worker.server.pd_faults`).
"""

PREFIX = "x-ferry-"
"""Common prefix of every Ferry header name."""

STICKY_KEY = "x-ferry-sticky-key"
"""Client -> router: key hashed to choose the track (requests with the same key land on the same track)."""
TRACK = "x-ferry-track"
"""Router -> decode worker and client: the track (stable, canary, blue, green ...) that served the request."""
MODEL_VERSION = "x-ferry-model-version"
"""Router -> decode worker: the model version of the chosen track."""
DECISION = "x-ferry-decision"
"""Router -> decode worker and client: ``local_prefill`` or ``remote_prefill``."""
DECISION_REASON = "x-ferry-decision-reason"
"""Router -> client: what decided the PD placement (``cost``, ``threshold``, ``no_prefill_replica``, ``no_profile``)."""
REPLICA = "x-ferry-replica"
"""Router -> client: name of the decode replica that answered."""
PREFILL_ENDPOINT = "x-ferry-prefill-endpoint"
"""Router -> decode worker: base URL of the prefill replica to hand the prompt to (remote prefill)."""
KV_SIGNATURE = "x-ferry-kv-signature"
"""Decode -> prefill worker: hex HMAC-SHA256 of the ``/internal/prefill`` body under the link secret."""
CACHED_TOKENS = "x-ferry-cached-tokens"
"""Worker -> router -> client (response): prompt tokens served from the prefix cache (known at the first byte)."""
PROFILING = "x-ferry-profiling"
"""Profiler -> worker (request, any value): a profiling sweep's request (:mod:`apps.planning.profiling`), served like
any other but left out of the latency and request-length histograms, which describe the clients' traffic (to the
planner, the autoscaler and the rollout gates)."""
FAULT_KV = "x-ferry-fault-kv"
"""TEST ONLY, decode -> prefill worker: a KV hand-off fault for this request (honoured only when the
workers run with the test hook enabled, see :mod:`inference_worker.server.pd_faults`)."""

ALL = (STICKY_KEY, TRACK, MODEL_VERSION, DECISION, DECISION_REASON, REPLICA, PREFILL_ENDPOINT, KV_SIGNATURE, CACHED_TOKENS,
       PROFILING, FAULT_KV)
"""Every header name above."""
