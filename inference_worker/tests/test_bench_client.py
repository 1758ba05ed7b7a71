"""The benches' streaming client (bench/serve_load.py) reads cached tokens, returned token ids and sessions.

The server side is httpx's MockTransport answering with the SSE bytes an OpenAI server streams.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from bench.serve_load import one_request, run_sessions
from bench.workloads import SESSION_HEADER, MultiTurnConfig, MultiTurnWorkload
from inference_worker import http_headers


def sse_body(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def stream(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_cached_tokens_come_from_usage_details_before_the_header():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["prompt"] == [2, 5, 6] and body["return_token_ids"] is True
        chunks = [{"choices": [{"index": 0, "text": "a", "token_ids": [11]}]},
                  {"choices": [{"index": 0, "text": "b", "token_ids": [12]}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                            "prompt_tokens_details": {"cached_tokens": 2}}}]
        return httpx.Response(200, headers={http_headers.CACHED_TOKENS: "1", http_headers.REPLICA: "decode-1",
                                            http_headers.DECISION: "local_prefill"}, content=sse_body(chunks))

    async def go():
        async with stream(handler) as client:
            return await one_request(client, "http://w/v1/completions", "m", [2, 5, 6], 2, False,
                                     return_token_ids=True)

    result = asyncio.run(go())
    assert result.ok and (result.num_cached_tokens, result.cached_tokens_from) == (2, "usage")
    assert (result.replica, result.decision) == ("decode-1", "local_prefill")
    assert (result.text, result.token_ids, result.num_prompt_tokens, result.num_output_tokens) == ("ab", [11, 12], 3, 2)


def test_cached_tokens_fall_back_to_the_header_then_to_zero():
    def handler_for(headers: dict[str, str]):
        def handler(request: httpx.Request) -> httpx.Response:
            chunks = [{"choices": [{"index": 0, "text": "x"}]},
                      {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}]
            return httpx.Response(200, headers=headers, content=sse_body(chunks))
        return handler

    async def go(headers):
        async with stream(handler_for(headers)) as client:
            return await one_request(client, "http://w/v1/completions", "m", "hi", 1, False)

    header = asyncio.run(go({http_headers.CACHED_TOKENS: "3"}))
    assert (header.num_cached_tokens, header.cached_tokens_from, header.token_ids) == (3, "header", None)
    absent = asyncio.run(go({}))
    assert (absent.num_cached_tokens, absent.cached_tokens_from) == (0, "absent")


def test_sessions_send_the_header_and_append_returned_ids_else_re_encoded_text():
    workload = MultiTurnWorkload.from_config(MultiTurnConfig(num_sessions=2, num_turns=2, num_system_tokens=3,
                                                             user_tokens=(2, 2), max_tokens=2))
    seen: list[tuple[str, list[int]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        session = request.headers[SESSION_HEADER]
        seen.append((session, prompt))
        # session-0's server returns token ids; session-1's only text ("7 8" re-encodes to [7, 8]).
        choice = {"index": 0, "text": "7 8"} | ({"token_ids": [70, 80]} if session == "session-0" else {})
        chunks = [{"choices": [choice]},
                  {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2, "total_tokens": 0}}]
        return httpx.Response(200, content=sse_body(chunks))

    turns, _ = asyncio.run(run_sessions("http://w", "m", workload, concurrency=1, session_rate=math.inf, seed=0,
                                        encode=lambda text: [int(t) for t in text.split()], timeout_s=5,
                                        transport=httpx.MockTransport(handler)))
    expected_answers = {"session-0": [70, 80], "session-1": [7, 8]}
    sources = {"session-0": "token_ids", "session-1": "retokenized"}
    # One session in flight: sessions in start order, each turn's prompt carrying the previous answer exactly.
    assert seen == [(s.session_id, s.prompt([expected_answers[s.session_id]] * k))
                    for s in workload.sessions for k in range(2)]
    assert [(t.session_id, t.turn, t.answer_source, t.answer) for t in turns] == [
        (s.session_id, k, sources[s.session_id], expected_answers[s.session_id])
        for s in workload.sessions for k in range(2)]


def test_streamed_token_id_deltas_are_joined_in_order_and_the_request_asks_for_them():
    """vLLM's return_token_ids stream: prompt_token_ids in the choice's first chunk, token_ids per chunk (one
    chunk may carry ids whose text is still held back); the client joins the deltas, never the prompt ids."""
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"index": 0, "text": "", "prompt_token_ids": [2, 5, 9], "token_ids": [301]}]},
                  {"choices": [{"index": 0, "text": "ab", "token_ids": [302, 303]}]},
                  {"choices": [{"index": 0, "text": "c", "token_ids": [1], "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                            "prompt_tokens_details": {"cached_tokens": 0}}}]
        return httpx.Response(200, content=sse_body(chunks))

    async def go():
        async with stream(handler) as client:
            return await one_request(client, "http://w/v1/completions", "m", [2, 5, 9], 4, False,
                                     return_token_ids=True)

    result = asyncio.run(go())
    assert bodies[0]["return_token_ids"] is True and bodies[0]["prompt"] == [2, 5, 9]
    assert (result.ok, result.token_ids, result.text, result.num_output_tokens) == (True, [301, 302, 303, 1], "abc", 4)


def test_kv_events_subscriber_counts_batches_events_and_bytes_received():
    from bench.multi_turn import KVEventsSubscriber

    lines = [{"worker_id": "ab", "seq": 1, "snapshot": True, "events": [{"type": "cleared"}]},
             {"worker_id": "ab", "seq": 3, "snapshot": False,
              "events": [{"type": "stored", "digest": "01", "parent": "00", "group": "full_attention", "tier": "device"},
                         {"type": "removed", "digest": "01", "group": "full_attention", "tier": "device"}]},
             {"worker_id": "ab", "seq": 3, "snapshot": False, "events": []}]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"})

    subscriber = KVEventsSubscriber("http://w", transport=httpx.MockTransport(handler))
    subscriber.wait_snapshot(timeout_s=5)
    subscriber.join(timeout_s=5)
    assert paths == ["/v1/kv-events"]
    assert subscriber.counts() == (3, 3, len(body)) and subscriber.error is None


def test_routing_placement_counts_later_turns_served_elsewhere_and_bounds_are_exact():
    from bench.workloads import placement_bounds, session_moves

    records = [{"session_id": s, "turn": k, "replica": r, "decision": d} for s, k, r, d in (
        ("a", 1, "d1", "local_prefill"), ("a", 0, "d0", "local_prefill"), ("a", 2, "d1", "remote_prefill"),
        ("b", 0, "d0", "local_prefill"), ("b", 1, "d0", "local_prefill"))]
    assert session_moves(records) == {"later_turns": 3, "moved": 1, "remote": 1}
    # one session, 2 turns, block 2: turn 0 = 4 system + 2 user ids, turn 1 = those + 2 answer + 2 user ids (10)
    workload = MultiTurnWorkload.from_config(MultiTurnConfig(num_sessions=1, num_turns=2, num_system_tokens=4,
                                                             user_tokens=(2, 2), max_tokens=2))
    bounds = placement_bounds(workload, block_size=2, num_replicas=1)
    # sticky = random with one replica: 6 computed, then 10 - 6 cached (3 blocks of prompt; the answer's
    # last token never fed back, so its block [answer0, answer1] is not stored) = 4
    assert bounds == {"sticky_prefill_tokens": 10, "random_prefill_tokens": 10, "random_over_sticky": 1.0,
                      "sticky_computed_p50": 5.0, "random_computed_p50": 5.0, "random_over_sticky_p50": 1.0}


def test_a_stream_cut_before_done_or_ending_in_an_error_event_is_a_failed_request():
    """What a client of a killed replica sees: tokens, then the connection ends without ``[DONE]`` (before the
    router framed such breaks), or the router's ``upstream_stream_broken`` event. Neither is a success."""
    token = f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a'}]})}\n\n".encode()
    error = f"data: {json.dumps({'error': {'message': 'broke off', 'code': 'upstream_stream_broken'}})}\n\n".encode()

    async def go(content: bytes):
        async with stream(lambda request: httpx.Response(200, content=content)) as client:
            return await one_request(client, "http://w/v1/completions", "m", "hi", 3, False)

    cut, broken = asyncio.run(go(token * 2)), asyncio.run(go(token + error + b"data: [DONE]\n\n"))
    assert (cut.ok, cut.error, cut.text) == (False, "stream ended without [DONE] after 2 chunks", "aa")
    assert (broken.ok, broken.error) == (False, "broke off")


def test_ttft_by_computed_tokens_fits_the_line_bins_and_deciles_exactly():
    from bench.workloads import ttft_by_computed_tokens

    # TTFT = 100 ms + 3 ms per computed token, exactly: the fit recovers it; bins of 50 tokens hold their medians
    computed = [60, 80, 100, 120, 140, 400]
    records = [{"num_computed_tokens": n, "ttft_s": (100 + 3 * n) / 1e3} for n in computed]
    out = ttft_by_computed_tokens(records)
    assert out["fit"]["intercept_ms"] == pytest.approx(100.0, abs=1e-9)
    assert out["fit"]["ms_per_token"] == pytest.approx(3.0, abs=1e-12)
    # numpy-style linear interpolation: p50 between 100 and 120; p90 at rank 4.5 between 140 and 400
    assert (out["computed_tokens_p50"], out["computed_tokens_p90"]) == (110.0, 270.0)
    assert out["median_ttft_ms_by_bin"] == {"50-99": (pytest.approx(310.0), 2), "100-149": (pytest.approx(460.0), 3),
                                            "400-449": (pytest.approx(1300.0), 1)}
    one = ttft_by_computed_tokens([{"num_computed_tokens": 90, "ttft_s": 0.5}])
    assert (one["fit"], one["computed_tokens_p50"], one["computed_tokens_p90"]) == (None, 90, 90)
    with pytest.raises(ValueError):
        ttft_by_computed_tokens([])
