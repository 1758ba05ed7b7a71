"""Orchestrator backends (Kubernetes, local agent) behind one interface; no Django models here."""
