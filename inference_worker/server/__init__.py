"""OpenAI-compatible HTTP server of a Ferry worker (FastAPI on uvicorn).

Modules: ``protocol`` (request schemas and validation), ``errors`` (OpenAI error JSON),
``engine_loop`` (the engine stepping in its own thread, bridged to asyncio), ``streaming``
(per-request detokenization, SSE framing), ``app`` (routes, health, readiness, metrics) and
``lifecycle`` (uvicorn server with SIGTERM drain).
"""
