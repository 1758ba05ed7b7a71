"""Model versions and their architecture (parsed by ``inference_worker.config``)."""
