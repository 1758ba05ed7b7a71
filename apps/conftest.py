"""Fixtures for the control-plane apps: API clients per role and small domain objects."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from rest_framework.test import APIClient

from apps.accounts.services import user_create_with_role
from apps.catalog.services import model_version_register
from apps.fleet.services import cluster_create, pool_create

# An HF config.json shaped like Gemma 3 270M's (18 layers, 5 sliding : 1 full, W=512, 1 KV head, head_dim 256).
GEMMA_LIKE_CONFIG = {
    "model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
    "max_position_embeddings": 32768, "sliding_window": 512,
}
SHA_A = "a" * 64


def _client(role: str, username: str) -> APIClient:
    created = user_create_with_role(username=username, role=role)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {created.token}")
    client.user = created.user
    client.token = created.token
    return client


@pytest.fixture
def viewer_api(db) -> APIClient:
    return _client("viewer", "vera")


@pytest.fixture
def operator_api(db) -> APIClient:
    return _client("operator", "otto")


@pytest.fixture
def admin_api(db) -> APIClient:
    return _client("admin", "ada")


@pytest.fixture
def make_model_version(db):
    def make(version: str = "v1", name: str = "gemma-like"):
        return model_version_register(name=name, version=version, weights_uri=f"s3://models/{name}/{version}",
                                      sha256=SHA_A, config=GEMMA_LIKE_CONFIG)

    return make


@pytest.fixture
def model_version(make_model_version):
    return make_model_version("v1")


@pytest.fixture
def make_cluster(db):
    def make(name: str = "dc-a", **fields):
        fields = {"kind": "local", "agent_url": "http://127.0.0.1:9300", "datacenter": name, **fields}
        return cluster_create(name=name, **fields)

    return make


@pytest.fixture
def cluster(make_cluster):
    return make_cluster("dc-a")


@pytest.fixture
def make_pool(cluster, model_version):
    def make(name: str = "decode", role: str = "decode", replicas: int = 2, **fields):
        fields = {"cluster": cluster, "model_version": model_version, **fields}
        return pool_create(name=name, role=role, replicas=replicas, **fields)

    return make


@pytest.fixture
def pool(make_pool):
    return make_pool()


@pytest.fixture
def history():
    """A SignalHistory under a prefix of its own in the real Redis (REDIS_URL), removed after."""
    from apps.telemetry.history import SignalHistory

    h = SignalHistory(prefix=f"ferry:test:{uuid.uuid4().hex}:")
    yield h
    h.clear()


@pytest.fixture
def default_history():
    """The SignalHistory under its default prefix (what gates and reconcile read), emptied before and after."""
    from apps.telemetry.history import SignalHistory

    h = SignalHistory()

    def empty() -> None:
        for key in h.client.scan_iter(match=f"{h.prefix}history:*"):
            h.client.delete(key)

    empty()
    yield h
    empty()


@pytest.fixture
def webhook():
    """A loopback HTTP server recording JSON POST bodies."""
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", received
    server.shutdown()
    server.server_close()
