"""Metric sources: Prometheus (``prometheus.py``) and direct scrape of replicas (``scrape.py``)."""
