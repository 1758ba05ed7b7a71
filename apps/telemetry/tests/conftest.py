"""Shared fixtures: a local cluster with a pool, a private Redis key prefix for the history."""

import uuid

import pytest

from apps.catalog.services import model_version_register
from apps.fleet.services import cluster_create, pool_create
from apps.telemetry.history import SignalHistory


@pytest.fixture
def model_version(db):
    return model_version_register(name="gemma-3-270m", version="v1", builtin_model="gemma-3-270m",
                                  weights_uri="file:///models/gemma.gguf", sha256="0" * 64)


@pytest.fixture
def cluster(db):
    return cluster_create(name="local-a", kind="local", datacenter="dc-a", agent_url="http://127.0.0.1:9300")


@pytest.fixture
def pool(cluster, model_version):
    return pool_create(replicas=1, model_version=model_version, name="decode-a", cluster=cluster, role="decode")


@pytest.fixture
def history():
    """A SignalHistory under a prefix of its own in the real Redis (REDIS_URL), removed after."""
    h = SignalHistory(prefix=f"ferry:test:{uuid.uuid4().hex}:")
    yield h
    h.clear()
