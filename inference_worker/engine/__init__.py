"""Inference engine: torch-free scheduling and KV block accounting, plus the model runner that owns tensors."""
