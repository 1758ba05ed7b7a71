"""OpenAI-API load generator: TTFT, TPOT, ITL, throughput and goodput under SLOs.

Works against any OpenAI-compatible base URL (a Ferry worker, the Ferry router, another server).
Requests arrive as a Poisson process (``--request-rate`` per second; ``inf`` sends them all at
once) and are capped at ``--concurrency`` in flight; several concurrency levels run one after the
other against the same server, and the first level is the reference the others are compared with
(throughput ratio). Prompts are synthetic with mixed lengths drawn from a fixed seed (``bench/workloads.py``:
:func:`~bench.workloads.word_prompts`, arrivals :func:`~bench.workloads.poisson_gaps`); outputs use
``ignore_eos`` so each request generates exactly its drawn length.

With ``--sessions N`` each level runs N multi-turn sessions instead (``bench/workloads.py``: a shared
system prompt, appended user tokens, each answer's token ids appended to the next prompt, the session
header ``X-Ferry-Sticky-Key``): sessions arrive as a Poisson process at ``--request-rate`` per second, at
most ``--concurrency`` in flight, turns of a session one after another; ``num_cached_tokens`` sums the
server's reported prompt-cache hits. ``bench/multi_turn.py`` runs the same sessions with caching off and on.

Definitions (as serving benchmarks such as vLLM's ``benchmark_serving`` use them):
TTFT = time to the first streamed token; TPOT = (e2e - TTFT) / (output tokens - 1) per request;
ITL = gaps between consecutive streamed chunks; goodput = completed requests per second that met
every SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``).

Example::

    python bench/serve_load.py --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --num-prompts 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import (  # noqa: E402
    SESSION_HEADER,
    MultiTurnConfig,
    MultiTurnWorkload,
    Request,
    Session,
    poisson_gaps,
    think_times,
    word_prompts,
)
from inference_worker import http_headers  # noqa: E402


@dataclass
class RequestResult:
    """One request's outcome; times in seconds (``started_s`` on the ``time.perf_counter`` clock).

    ``num_cached_tokens`` is the server's ``usage.prompt_tokens_details.cached_tokens`` or else its
    ``X-Ferry-Cached-Tokens`` header (``cached_tokens_from`` says which; ``absent``: neither, counted 0).
    ``token_ids`` are the generated ids when the server returns them per choice (``return_token_ids``, as vLLM
    names it), else None; ``text`` is the generated text.
    """

    prompt_words: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    started_s: float = math.nan
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_from: str = "absent"
    replica: str = ""
    """The router's ``X-Ferry-Replica`` (the decode replica that served it; empty without a router)."""
    decision: str = ""
    """The router's ``X-Ferry-Decision`` (``local_prefill`` / ``remote_prefill`` / ...; empty without a router)."""
    text: str = ""
    token_ids: list[int] | None = None

    @property
    def tpot_s(self) -> float:
        if self.num_output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int], max_tokens: int,
                      chat: bool, *, headers: dict[str, str] | None = None,
                      return_token_ids: bool = False) -> RequestResult:
    """Send one streaming request (greedy, ``ignore_eos``) and time its chunks.

    TTFT is the time to the first chunk carrying text or token ids. ``prompt`` is text or token ids
    (``/v1/completions`` only). Failures are recorded in the result (``ok`` False, ``error``), never raised:
    a non-200 answer, an error event in the stream, no token at all, or a stream cut before ``data: [DONE]``.
    """
    words = len(prompt.split()) if isinstance(prompt, str) else 0
    result = RequestResult(prompt_words=words, max_tokens=max_tokens)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if return_token_ids:
        body["return_token_ids"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    start = result.started_s = time.perf_counter()
    last = None
    done = False
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            result.replica = response.headers.get(http_headers.REPLICA, "")
            result.decision = response.headers.get(http_headers.DECISION, "")
            if http_headers.CACHED_TOKENS in response.headers:
                result.num_cached_tokens = int(response.headers[http_headers.CACHED_TOKENS])
                result.cached_tokens_from = "header"
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = data["error"].get("message", "stream error")
                    return result
                if data.get("usage"):
                    usage = data["usage"]
                    result.num_output_tokens = usage["completion_tokens"]
                    result.num_prompt_tokens = usage["prompt_tokens"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if cached is not None:
                        result.num_cached_tokens, result.cached_tokens_from = cached, "usage"
                choices = data.get("choices") or []
                texts = [c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices]
                ids = [t for c in choices for t in (c.get("token_ids") or [])]
                if ids:
                    result.token_ids = (result.token_ids or []) + ids
                pieces += texts
                if any(texts) or ids:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.e2e_s = time.perf_counter() - start
        result.text = "".join(pieces)
        result.ok = last is not None and done
        if last is None:
            result.error = "no tokens streamed"
        elif not done:  # the server (or a proxy) cut the stream: the client never got its whole answer
            result.error = f"stream ended without [DONE] after {len(pieces)} chunks"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer $FERRY_CLIENT_API_KEY`` when that variable is set (``make run`` generates the key
    and gives it to the load generator; a router started with ``--no-auth`` needs none)."""
    key = os.environ.get("FERRY_CLIENT_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def run_level(base_url: str, model: str, workload: list[Request], *, concurrency: int, request_rate: float, seed: int,
                    chat: bool, timeout_s: float) -> tuple[list[RequestResult], float]:
    """Run the workload with Poisson arrivals and at most ``concurrency`` requests in flight."""
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    gaps = poisson_gaps(len(workload), request_rate, seed + 1)
    limiter = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=auth_headers()) as client:

        async def guarded(prompt: str, max_tokens: int) -> RequestResult:
            async with limiter:
                return await one_request(client, url, model, prompt, max_tokens, chat)

        tasks = []
        start = time.perf_counter()
        for request, gap in zip(workload, gaps, strict=True):
            tasks.append(asyncio.create_task(guarded(request.prompt, request.max_tokens)))
            if gap:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


@dataclass
class TurnResult:
    """One turn of a session: its prompt, the request's result and the answer ids the next turn appends
    (``answer_source``: ``token_ids`` returned by the server, or ``retokenized`` text)."""

    session_id: str
    turn: int
    prompt: list[int]
    result: RequestResult
    answer: list[int] = field(default_factory=list)
    answer_source: str = ""


async def run_sessions(base_url: str, model: str, workload: MultiTurnWorkload, *, concurrency: int,
                       session_rate: float, seed: int, encode: Callable[[str], list[int]] | None,
                       timeout_s: float, transport: httpx.AsyncBaseTransport | None = None,
                       history: dict[str, list[list[int]]] | None = None, stop_turn: int | None = None,
                       think_time_s: float = 0.0) -> tuple[list[TurnResult], float]:
    """Run multi-turn sessions: sessions arrive in start order with Poisson gaps (``session_rate`` per second;
    ``math.inf``: all at once, a closed loop), at most ``concurrency`` in flight, a session's turns one after
    another with the user's think time before each later turn (:func:`bench.workloads.think_times` of mean
    ``think_time_s`` seconds; 0: back to back), each request with the session header.

    A turn's answer is the server's returned token ids, else ``encode(text)``; a failed turn (or no ids and
    no ``encode``) ends its session, recorded in its result. ``transport``: httpx's (tests give a mock server).
    ``history`` (session id -> answers so far, updated in place) resumes sessions at their next turn and
    ``stop_turn`` ends them before that turn index: a run split in phases (e.g. turns 1-3, a restart, 4-6).
    Returns (turns in completion order, wall seconds).
    """
    url = base_url.rstrip("/") + "/v1/completions"
    limiter = asyncio.Semaphore(concurrency)
    turns: list[TurnResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, transport=transport,
                                 headers=auth_headers()) as client:

        async def one_session(session: Session) -> None:
            async with limiter:
                answers: list[list[int]] = [] if history is None else history.setdefault(session.session_id, [])
                thinks = [0.0] + think_times(session.session_id, len(session.turns), think_time_s, seed + 2)
                for k in range(len(answers), len(session.turns) if stop_turn is None else stop_turn):
                    turn = session.turns[k]
                    if thinks[k]:
                        await asyncio.sleep(thinks[k])
                    prompt = session.prompt(answers)
                    result = await one_request(client, url, model, prompt, turn.max_tokens, False,
                                               headers={SESSION_HEADER: session.session_id}, return_token_ids=True)
                    done = TurnResult(session.session_id, k, prompt, result)
                    turns.append(done)
                    if result.ok and result.token_ids is not None:
                        done.answer, done.answer_source = result.token_ids, "token_ids"
                    elif result.ok and encode is not None:
                        done.answer, done.answer_source = list(encode(result.text)), "retokenized"
                    elif result.ok:
                        result.ok, result.error = False, "no token ids returned and no tokenizer to re-encode the text"
                    if not result.ok:
                        return
                    answers.append(done.answer)

        tasks = []
        start = time.perf_counter()
        for session, gap in zip(workload.sessions, poisson_gaps(len(workload.sessions), session_rate, seed + 1),
                                strict=True):
            tasks.append(asyncio.create_task(one_session(session)))
            if gap:
                await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return turns, duration


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    position = (len(values) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return values[low] + (values[high] - values[low]) * (position - low)


def summarize(results: list[RequestResult], duration_s: float, *, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Aggregate figures of one level (milliseconds for latencies, per second for rates)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    good = [r for r in ok if r.ttft_s <= slo_ttft_s and (math.isnan(r.tpot_s) or r.tpot_s <= slo_tpot_s)]
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(r.num_prompt_tokens for r in ok)

    def ms(values: list[float], q: float) -> float:
        return percentile(values, q) * 1000.0

    return {
        "num_requests": len(results), "num_completed": len(ok), "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput_rps": len(ok) / duration_s, "output_throughput_tok_s": out_tokens / duration_s,
        "total_throughput_tok_s": (in_tokens + out_tokens) / duration_s,
        "goodput_rps": len(good) / duration_s, "slo_attainment": len(good) / len(results) if results else math.nan,
        "ttft_ms_mean": statistics.fmean(ttft) * 1000.0 if ttft else math.nan,
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
        "e2e_ms_p50": ms(e2e, 50), "e2e_ms_p99": ms(e2e, 99),
        "num_prompt_tokens": in_tokens, "num_output_tokens": out_tokens,
        "num_cached_tokens": sum(r.num_cached_tokens for r in ok),
    }


def print_table(rows: list[dict]) -> None:
    """Print one line per concurrency level."""
    cols = [("conc", "concurrency", 5, "d"), ("ok", "num_completed", 4, "d"),
            ("req/s", "request_throughput_rps", 7, ".2f"), ("out tok/s", "output_throughput_tok_s", 10, ".1f"),
            ("x ref", "throughput_vs_reference", 6, ".2f"), ("TTFT p50", "ttft_ms_p50", 9, ".0f"),
            ("TTFT p99", "ttft_ms_p99", 9, ".0f"), ("TPOT p50", "tpot_ms_p50", 9, ".1f"),
            ("TPOT p99", "tpot_ms_p99", 9, ".1f"), ("ITL p99", "itl_ms_p99", 8, ".1f"),
            ("goodput", "goodput_rps", 8, ".2f")]
    print("  ".join(f"{name:>{width}}" for name, _, width, _ in cols))
    for row in rows:
        print("  ".join(f"{row[key]:>{width}{spec}}" for _, key, width, spec in cols))
    print("latencies in ms; 'x ref' = output tok/s relative to the first concurrency level; goodput in req/s")


async def resolve_model(base_url: str, model: str | None) -> str:
    if model:
        return model
    async with httpx.AsyncClient(timeout=30, headers=auth_headers()) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def session_encoder(args: argparse.Namespace, model: str) -> Callable[[str], list[int]] | None:
    """Re-encoder of answer text for multi-turn sessions: ``--tokenizer``, else the prepared model's, else None."""
    from inference_worker.registry import model_cache_dir
    from inference_worker.tokenization import load_tokenizer

    path = Path(args.tokenizer) if args.tokenizer else model_cache_dir() / model
    if not args.tokenizer and not (path / "tokenizer.json").is_file():
        return None
    tokenizer = load_tokenizer(path)
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


async def main_async(args: argparse.Namespace) -> list[dict]:
    model = await resolve_model(args.base_url, args.model)
    encode = session_encoder(args, model) if args.sessions else None
    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        if args.sessions:
            workload = MultiTurnWorkload.from_config(MultiTurnConfig(
                num_sessions=args.sessions, num_turns=args.turns, num_system_tokens=args.system_tokens,
                user_tokens=parse_range(args.user_tokens), max_tokens=args.turn_output_tokens, seed=args.seed,
                session_prefix=args.session_prefix))
            turns, duration = await run_sessions(args.base_url, model, workload, concurrency=concurrency,
                                                 session_rate=args.request_rate, seed=args.seed, encode=encode,
                                                 timeout_s=args.timeout_s)
            results = [t.result for t in turns]
            num_prompts = len(results)
            details = [{"session_id": t.session_id, "turn": t.turn, "answer_source": t.answer_source,
                        **asdict(t.result)} for t in turns]
        else:
            num_prompts = args.num_prompts or max(4, 2 * concurrency)
            workload = word_prompts(num_prompts, args.seed, parse_range(args.input_words),
                                    parse_range(args.output_tokens))
            results, duration = await run_level(args.base_url, model, workload, concurrency=concurrency,
                                                request_rate=args.request_rate, seed=args.seed, chat=args.chat,
                                                timeout_s=args.timeout_s)
            details = [asdict(r) for r in results]
        row = {"concurrency": concurrency, "num_prompts": num_prompts,
               **summarize(results, duration, slo_ttft_s=args.slo_ttft_ms / 1000, slo_tpot_s=args.slo_tpot_ms / 1000),
               "requests": details}
        reference = rows[0]["output_throughput_tok_s"] if rows else row["output_throughput_tok_s"]
        row["throughput_vs_reference"] = row["output_throughput_tok_s"] / reference if reference else math.nan
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (worker or router)")
    parser.add_argument("--model", help="model id; default: the first of GET /v1/models")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels, first is the reference")
    parser.add_argument("--num-prompts", type=int, default=0, help="requests per level (default max(4, 2*conc))")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate, req/s")
    parser.add_argument("--input-words", default="8:64", help="prompt length range in words, MIN:MAX")
    parser.add_argument("--output-tokens", default="8:32", help="max_tokens range, MIN:MAX (ignore_eos)")
    parser.add_argument("--sessions", type=int, default=0,
                        help="multi-turn: sessions per level (0: single-turn prompts); --request-rate is then "
                             "sessions/s and --concurrency sessions in flight")
    parser.add_argument("--turns", type=int, default=6, help="multi-turn: turns per session")
    parser.add_argument("--system-tokens", type=int, default=300, help="multi-turn: shared system prompt tokens")
    parser.add_argument("--user-tokens", default="100:300", help="multi-turn: appended tokens per turn, MIN:MAX")
    parser.add_argument("--turn-output-tokens", type=int, default=32, help="multi-turn: answer tokens per turn")
    parser.add_argument("--session-prefix", default="",
                        help="multi-turn: prefix of the session ids (sticky keys); a loop gives each run its own so "
                             "new sessions keep reaching every track of a weighted split")
    parser.add_argument("--tokenizer", help="multi-turn: tokenizer.json (dir) to re-encode answers when the server "
                                            "returns no token ids (default: the prepared model's)")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default="bench/results/serve_load.json")
    args = parser.parse_args()
    if args.sessions and args.chat:
        parser.error("--sessions sends token-id prompts to /v1/completions; it cannot be combined with --chat")
    if args.sessions:
        try:
            MultiTurnConfig(num_sessions=args.sessions, num_turns=args.turns, num_system_tokens=args.system_tokens,
                            user_tokens=parse_range(args.user_tokens), max_tokens=args.turn_output_tokens)
        except ValueError as exc:
            parser.error(str(exc))
    rows = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"base_url": args.base_url, "args": vars(args), "levels": rows}, indent=2))
    print_table(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
