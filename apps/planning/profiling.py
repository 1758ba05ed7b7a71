"""A bounded profiling sweep of one worker over its OpenAI API (what ``ferry_profile`` and ``pool.profile`` run).

- **Prefill time vs prompt length**: for each length ``N`` a completion of ``N`` random token ids with
  ``max_tokens=1`` (its first and only token comes from the prefill); the wall time of the fastest of
  ``repeats`` requests is the point. The ids are drawn fresh for every request of every sweep (an OS-seeded
  generator), so the worker's prefix cache never hits; a response reporting a hit fails the sweep (it would
  measure a shorter prefill).
- **Decode step time vs batch size**: ``B`` concurrent streamed completions of ``max_new_tokens`` tokens each
  (``ignore_eos``); the gaps between consecutive streamed tokens of a stream, after its first token, are decode
  steps of a batch of ``B`` (continuous batching). A round's value is the median gap over all its streams; the
  point is the smallest of ``repeats`` rounds (as for prefill: interference from other work on the machine only
  adds time). One unmeasured stream first warms the decode path up (a fresh worker's first decode steps were
  seen 10x slower than later ones).
- **Prefill on a decoding replica** (co-located: a Ferry decode replica prefills short prompts itself, in the batch
  of its decodes): the prefill requests again, each sent while one background stream decodes on the same worker
  and after a random pause of up to ``COLOCATED_PHASE_S`` (so it lands at a random point of a decode step). The
  point is the mean of ``COLOCATED_REPEATS`` requests: here the interference is what is measured, and the
  planner needs its mean (:mod:`inference_worker.planning.planner`, "co-located local prefill"). The background
  stream's prompt is ``DECODE_PROMPT_TOKENS`` long, so its own prefills, when it restarts, stay short.

Bounds: lengths are clipped to the worker's usable context (``/v1/models``' ``max_model_len``) less the
output token, at most 8 lengths and 6 batch sizes, one timeout per request. Raises :class:`SweepError`
(with the reason) on any worker error; nothing here touches the database.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import numpy as np

from inference_worker import http_headers

MAX_LENGTHS = 8
MAX_BATCH_SIZES = 6
DEFAULT_LENGTHS = (32, 128, 256, 512)
DEFAULT_BATCH_SIZES = (1, 2, 4)
DEFAULT_MAX_NEW_TOKENS = 12
DECODE_PROMPT_TOKENS = 16
FIRST_TOKEN_ID = 100
"""Random prompt ids are drawn from ``[FIRST_TOKEN_ID, vocab_size)`` (low ids are special tokens in most vocabularies)."""
COLOCATED_REPEATS = 4
"""Requests per length of the co-located measurement (their mean is the point)."""
COLOCATED_PHASE_S = 0.25
"""Longest random pause before a co-located prefill request, seconds (about two CPU decode steps of the demo)."""
COLOCATED_STREAM_TOKENS = 64
"""Tokens per background decode stream of the co-located measurement (it restarts until the measurement ends)."""


class SweepError(Exception):
    """The worker could not be profiled; the message says why (HTTP status and body, or the transport error)."""


@dataclass(frozen=True)
class SweepResult:
    """Measured points: ``prefill_points`` ``[(prompt tokens, seconds)]``, ``decode_points`` ``[(batch, seconds)]``."""

    prefill_points: list[tuple[int, float]]
    decode_points: list[tuple[int, float]]
    model: str
    """The served model name (``/v1/models``)."""
    colocated_prefill_points: list[tuple[int, float]] = field(default_factory=list)
    """``[(prompt tokens, mean seconds of a max_tokens=1 completion while one stream decodes)]``; empty: not
    measured."""


def validate_sweep(lengths: list[int], batch_sizes: list[int], max_new_tokens: int) -> None:
    """Refuse an unbounded or unfit sweep.

    Raises:
        ValueError: fewer than 3 or more than ``MAX_LENGTHS`` distinct lengths, fewer than 2 or more than
            ``MAX_BATCH_SIZES`` distinct batch sizes, a non-positive value, or ``max_new_tokens`` outside 4..64.
    """
    if not 3 <= len(set(lengths)) <= MAX_LENGTHS or min(lengths) < 1:
        raise ValueError(f"lengths: give 3 to {MAX_LENGTHS} distinct positive prompt lengths, got {lengths}")
    if not 2 <= len(set(batch_sizes)) <= MAX_BATCH_SIZES or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes: give 2 to {MAX_BATCH_SIZES} distinct positive batch sizes, got {batch_sizes}")
    if not 4 <= max_new_tokens <= 64:
        raise ValueError(f"max_new_tokens must be in 4..64, got {max_new_tokens}")


def _error(response: httpx.Response) -> SweepError:
    return SweepError(f"worker answered HTTP {response.status_code}: {response.text[:300]}")


class WorkerSweep:
    """Profile the worker at ``endpoint`` (``http://host:port``) with the pool's worker ``token``.

    ``seed``: of the random prompt ids; None (the default) draws it from the OS, so no two sweeps send the same
    prompts. With a fixed seed a second sweep of the same worker measured its prefix cache (512 tokens in 120 ms
    against 1332 ms, 2026-12-04). ``transport``: httpx's (tests give a mock worker).
    """

    def __init__(self, endpoint: str, token: str, *, vocab_size: int, timeout_s: float = 120.0,
                 seed: int | None = None, transport: httpx.BaseTransport | None = None):
        self.endpoint = endpoint.rstrip("/")
        # Marked as profiling: the worker leaves the sweep out of the request lengths the planner reads as traffic.
        self.headers = {"Authorization": f"Bearer {token}", http_headers.PROFILING: "1"}
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.rng = np.random.default_rng(seed)
        self.transport = transport

    def _client(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout_s, headers=self.headers, transport=self.transport)

    def _post_uncached(self, client: httpx.Client, body: dict) -> float:
        """POST a ``max_tokens=1`` completion; its wall seconds.

        Raises:
            SweepError: a worker error, or a prefix-cache hit (``usage.prompt_tokens_details.cached_tokens``): the
                time would measure the cache, not the prefill.
        """
        started = time.perf_counter()
        response = client.post(f"{self.endpoint}/v1/completions", json=body)
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise _error(response)
        details = (response.json().get("usage") or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens"):
            raise SweepError(f"the worker's prefix cache held {details['cached_tokens']} of the "
                             f"{len(body['prompt'])} random prompt tokens: the point would measure the cache")
        return elapsed

    def _ids(self, n: int) -> list[int]:
        return self.rng.integers(FIRST_TOKEN_ID, self.vocab_size, n).tolist()

    def model_card(self, client: httpx.Client) -> tuple[str, int | None]:
        """``(served model name, usable context tokens or None)`` from ``GET /v1/models``."""
        response = client.get(f"{self.endpoint}/v1/models")
        if response.status_code != 200:
            raise _error(response)
        card = response.json()["data"][0]
        return card["id"], card.get("max_model_len")

    def prefill_points(self, client: httpx.Client, model: str, lengths: list[int], repeats: int = 2
                       ) -> list[tuple[int, float]]:
        """``[(N, fastest wall seconds of a max_tokens=1 completion of N fresh random ids)]``."""
        points = []
        for n in lengths:
            best = float("inf")
            for _ in range(repeats):
                body = {"model": model, "prompt": self._ids(n), "max_tokens": 1, "temperature": 0}
                best = min(best, self._post_uncached(client, body))
            points.append((n, best))
        return points

    def colocated_prefill_points(self, client: httpx.Client, model: str, lengths: list[int],
                                 repeats: int = COLOCATED_REPEATS) -> list[tuple[int, float]]:
        """``[(N, mean wall seconds of max_tokens=1 completions of N fresh ids sent while one stream decodes)]``.

        Raises:
            SweepError: a worker error (of a measured request or of the background stream).
        """
        stop, failures = threading.Event(), []

        def decode_in_background() -> None:
            try:
                while not stop.is_set():
                    self._stream_gaps(model, COLOCATED_STREAM_TOKENS)
            except (SweepError, httpx.HTTPError) as exc:
                failures.append(exc)

        background = threading.Thread(target=decode_in_background, name="profile-decode", daemon=True)
        background.start()
        try:
            time.sleep(COLOCATED_PHASE_S)  # the stream's short prompt is prefilled: it decodes from here on
            points = []
            for n in lengths:
                times = []
                for _ in range(repeats):
                    time.sleep(float(self.rng.uniform(0, COLOCATED_PHASE_S)))
                    body = {"model": model, "prompt": self._ids(n), "max_tokens": 1, "temperature": 0}
                    times.append(self._post_uncached(client, body))
                    if failures:
                        raise SweepError(f"the background decode stream failed: {failures[0]}")
                points.append((n, statistics.fmean(times)))
            return points
        finally:
            stop.set()
            background.join(timeout=self.timeout_s)

    def _stream_gaps(self, model: str, max_new_tokens: int) -> list[float]:
        body = {"model": model, "prompt": self._ids(DECODE_PROMPT_TOKENS), "max_tokens": max_new_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        arrivals = []
        with self._client() as client, \
                client.stream("POST", f"{self.endpoint}/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise _error(response)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices"):
                    arrivals.append(time.perf_counter())
        return [b - a for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]

    def decode_points(self, model: str, batch_sizes: list[int], max_new_tokens: int, repeats: int = 2
                      ) -> list[tuple[int, float]]:
        """``[(B, smallest over repeats of the median inter-token gap of B concurrent streams, seconds)]``.

        The rounds go through the batch sizes in turn (1, 2, 3, 1, 2, 3, ...), so a burst of other work on the
        machine slows one round of several sizes rather than every round of one size (which could tilt the fitted
        line: a loaded CI machine measured B=1 at 282 ms and B=4 at 120 ms, 2026-12-04).
        """
        self._stream_gaps(model, max_new_tokens)  # warm-up, not measured
        best = {batch: float("inf") for batch in batch_sizes}
        for _ in range(repeats):
            for batch in batch_sizes:
                with ThreadPoolExecutor(max_workers=batch) as pool:
                    gaps = [g for found in pool.map(lambda _: self._stream_gaps(model, max_new_tokens),
                                                    range(batch)) for g in found]
                if not gaps:
                    raise SweepError(f"batch {batch}: the streams carried fewer than 3 tokens each")
                best[batch] = min(best[batch], statistics.median(gaps))
        return [(batch, best[batch]) for batch in batch_sizes]

    def run(self, *, lengths: list[int], batch_sizes: list[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
            colocated: bool = False) -> SweepResult:
        """The whole sweep (lengths clipped to the usable context); ``colocated``: also the prefill on a decoding
        replica (what a decode pool, which prefills short prompts itself, needs).

        Raises:
            ValueError: see :func:`validate_sweep`.
            SweepError: a worker error or an unreachable worker.
        """
        validate_sweep(lengths, batch_sizes, max_new_tokens)
        try:
            with self._client() as client:
                model, context = self.model_card(client)
                if context is not None:
                    lengths = sorted({min(n, context - 1) for n in lengths})
                    if len(lengths) < 3:
                        raise SweepError(f"the worker's context ({context} tokens) leaves fewer than 3 lengths")
                prefill = self.prefill_points(client, model, sorted(lengths))
                colocated = self.colocated_prefill_points(client, model, sorted(lengths)) if colocated else []
            decode = self.decode_points(model, sorted(set(batch_sizes)), max_new_tokens)
        except httpx.HTTPError as exc:
            raise SweepError(f"{type(exc).__name__} talking to {self.endpoint}: {exc}") from exc
        return SweepResult(prefill, decode, model, colocated)
