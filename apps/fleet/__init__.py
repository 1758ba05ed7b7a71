"""Clusters, the links between them, and pools of workers with per-track desired replicas."""
