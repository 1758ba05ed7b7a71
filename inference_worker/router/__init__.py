"""The router role: OpenAI-compatible front door with PD routing and length-aware remote prefill.

Modules: ``table`` (routing table model and derived threshold), ``decisions`` (track split, placement,
least-loaded), ``source`` (table pull/file watch, queue-depth scrape), ``auth`` (API keys, rate
limits), ``prompt`` (prompt token counting), ``metrics``, ``app`` (the HTTP proxy). Torch-free.
"""
