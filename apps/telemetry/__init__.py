"""Telemetry: metric sources, signals, the poller's history and stream, and alert rules."""
