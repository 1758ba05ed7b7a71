"""The router role: OpenAI-compatible front door with cache-aware PD routing. Torch-free.

**One pipeline, one plan** (:mod:`.pipeline`): every attempt of a request runs

1. *eligibility*: the tracks serving the request's ``model`` (unknown: 404), the track of its sticky key
   (``X-Ferry-Sticky-Key``, else the session ``X-Session-Id`` / OpenAI ``user``, else the request id), and
   that model version's decode replicas minus those the circuit breaker ejected (:mod:`.breaker`) and those
   already tried; when ejection empties the track, another track of the model takes the request;
2. *scoring*: expected cached tokens from the prefix index (:mod:`.prefix_index`, built from each replica's
   ``/v1/kv-events`` with the hybrid hit rule of ``engine.block_hash``) against load (queue depth, running
   requests, KV usage scraped from ``/metrics``); weights per pool (:mod:`.scoring`); the session breaks ties;
3. *PD decision*: the best prefill replica of the same model version and the one cost function
   (:mod:`.pd_cost`): local = prefill of ``N - h_decode`` on the decode replica, remote = prefill of
   ``N - h_prefill`` on the prefill replica + ``bytes(N)`` over the link + RTT;
4. *admission*: the plan's replicas are booked in the load tracker.

The resulting :class:`.pipeline.RoutePlan` names the decode and the prefill replica and the proxy
(:mod:`.app`) executes exactly that; a retry after a failure before the first byte runs the pipeline
again without the failed replica. Prompts are tokenized (one tokenizer per model version, from the
routing table's reference) and hashed off the event loop (:mod:`.prompt`), but for bodies of at most
``app.INLINE_BODY_BYTES``, whose work costs less than the hand-off to the thread pool.

Other modules: ``table`` (the routing table: tracks, pools, links, per-version KV layout, tokenizer and
digest salt), ``decisions`` (track split, load tracker), ``source`` (table pull/file watch, load scrape),
``auth`` (API keys, rate limits), ``breaker`` (circuit breaking), ``metrics``.
"""
