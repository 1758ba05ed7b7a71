"""KV transfer between prefill and decode workers: wire format, TCP transport, byte accounting.

Modules: ``layout`` (which KV is sent, torch-free), ``errors`` (typed failures with their metric
reason), ``wire`` (frame encode/decode), ``bucket`` (token-bucket bandwidth cap), ``transport``
(sender, re-exports the receiver), ``receiver`` (decode-side server), ``connection`` (plain socket
or TLS stream), ``recorder`` (transfer metrics). Import submodules directly; this package imports nothing so that
the torch-free parts stay torch-free.
"""
