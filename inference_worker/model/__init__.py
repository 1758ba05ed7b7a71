"""Decoder-only transformer with per-layer attention type (Gemma 3, Llama), loaders and tokenizer.

This package module imports nothing, so torch-free users (``inference_worker.config``) can import
``inference_worker.model.gguf_header`` without pulling in torch.
"""
