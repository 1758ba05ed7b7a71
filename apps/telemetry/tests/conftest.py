"""Telemetry fixtures (domain objects and API clients come from ``apps/conftest.py``)."""





