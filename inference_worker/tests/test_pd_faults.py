"""The per-request KV fault header is a test hook, off unless FERRY_TEST_KV_FAULT_HEADER=1 (no model, fast)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from inference_worker import http_headers
from inference_worker.cli.serve import add_arguments, validate
from inference_worker.metrics import WorkerMetrics
from inference_worker.server.errors import OpenAIError
from inference_worker.server.pd import PDService, PDSettings, sign
from inference_worker.server.pd_faults import TEST_HEADER_ENV, fault_header_enabled, parse_fault

SECRET = b"ferry-test-link-secret-0123456789"


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "gemma-3-270m", "--port", "8000", *argv])


def pd_service(role: str, *, fault_kv: str | None = None, fault_header: bool = False) -> PDService:
    settings = PDSettings(role=role, link_secret=SECRET, model_version_id="v1", fault_kv=fault_kv,
                          fault_header=fault_header)
    return PDService(settings, WorkerMetrics({"model": "m", "role": role}))


def test_the_hook_reads_exactly_one_in_its_environment_variable():
    assert TEST_HEADER_ENV == "FERRY_TEST_KV_FAULT_HEADER"
    assert [fault_header_enabled(env) for env in ({}, {TEST_HEADER_ENV: "0"}, {TEST_HEADER_ENV: "true"},
                                                  {TEST_HEADER_ENV: "1"})] == [False, False, False, True]
    assert parse_fault("delay:2.5") == ("delay", 2.5) and parse_fault("header") == ("header", 0.0)


def test_fault_kv_header_is_refused_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv(TEST_HEADER_ENV, raising=False)
    validate(serve_args("--role", "prefill", "--fault-kv", "corrupt"))  # a rehearsal mode needs no hook
    with pytest.raises(ValueError, match="--fault-kv header is a test hook: it needs FERRY_TEST_KV_FAULT_HEADER=1"):
        validate(serve_args("--role", "prefill", "--fault-kv", "header"))
    with pytest.raises(ValueError, match="test hook"):
        pd_service("prefill", fault_kv="header")
    monkeypatch.setenv(TEST_HEADER_ENV, "1")
    validate(serve_args("--role", "prefill", "--fault-kv", "header"))


def test_decode_forwards_the_fault_header_only_with_the_hook_on():
    forwarded = []

    async def record(engine_loop, prefill_url, fault, *rest, **timeline_and_span):
        forwarded.append((prefill_url, fault))

    for enabled in (False, True):
        service = pd_service("decode", fault_header=enabled)
        service._continue_remote = record  # stands in for the KV hand-off; receives what would be forwarded
        run = service.remote_prefill_for("http://p0", {http_headers.FAULT_KV: "corrupt"})
        asyncio.run(run(None, "r1", [1, 2], None, {}, None))
    assert forwarded == [("http://p0", None), ("http://p0", "corrupt")]


def test_prefill_answers_400_naming_the_header_for_an_unknown_fault():
    service = pd_service("prefill", fault_kv="header", fault_header=True)
    body = json.dumps({"request_id": "r1", "prompt_token_ids": [1, 2], "kv_host": "127.0.0.1", "kv_port": 9,
                       "model_version_id": "v1"}).encode()
    headers = {http_headers.KV_SIGNATURE: sign(SECRET, body), http_headers.FAULT_KV: "melt"}
    with pytest.raises(OpenAIError) as info:
        asyncio.run(service.handle_prefill(None, body, headers))
    error = info.value.body()["error"]
    assert (info.value.status_code, error["param"], error["type"]) == (400, http_headers.FAULT_KV,
                                                                     "invalid_request_error")
    assert error["message"].startswith("--fault-kv must be one of")
