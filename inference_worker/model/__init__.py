"""Decoder-only transformer with per-layer attention type (Gemma 3, Llama), loaders and tokenizer.

Config parsing (HF ``config.json``, GGUF metadata and header) is torch-free and lives in
:mod:`inference_worker.config`; this package imports it, never the reverse.
"""
