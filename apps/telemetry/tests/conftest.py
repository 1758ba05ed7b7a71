"""Telemetry fixtures (domain objects and API clients come from ``apps/conftest.py``)."""

import uuid

import pytest

from apps.telemetry.history import SignalHistory


@pytest.fixture
def history():
    """A SignalHistory under a prefix of its own in the real Redis (REDIS_URL), removed after."""
    h = SignalHistory(prefix=f"ferry:test:{uuid.uuid4().hex}:")
    yield h
    h.clear()
