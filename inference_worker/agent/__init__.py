"""The local agent: owns inference worker processes on one host over an authenticated HTTP API.

``python -m inference_worker agent`` (see ``inference_worker.cli.agent``) runs it; the control
plane's ``local`` orchestrator backend (``apps/orchestrators/local_backend.py``) drives it.
"""
