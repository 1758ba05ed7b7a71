"""The one workload module of Ferry's benchmarks and of the load generator (DESIGN, "What is real in tests").

Every request a bench or ``make run LOAD=1`` sends is drawn here, deterministically from a seed:

* single-turn workloads: :func:`word_prompts` (text prompts of random words, ``bench/serve_load.py`` and the
  load generator), :func:`random_token_prompts` (token-id prompts, ``bench/engine_throughput.py``) and
  :func:`ferry_text_tokens` (a tokenized English text, ``bench/pd_ttft.py``);
* arrivals: :func:`poisson_gaps`, the gaps of a Poisson process (exponential inter-arrival times);
  :func:`think_times`, a session's user think time before each later turn (exponential, per session);
* multi-turn sessions (:func:`multi_turn_sessions`, ``bench/multi_turn.py``): a system prompt shared by
  every session, then per turn the user's appended tokens; the prompt of turn k is the system prompt, every
  earlier turn's user tokens each followed by that turn's answer token ids exactly as generated, then turn
  k's user tokens (:meth:`Session.prompt`). Sessions start in a random order; every request of a session
  carries :data:`SESSION_HEADER` with its session id;
* :class:`IdealPrefixCache`: a prefix cache with unlimited memory, the bound a real engine's hits are
  compared with (:meth:`MultiTurnWorkload.ideal_prefill_tokens`), and per replica under a sticky or a random
  placement of turns (:func:`placement_bounds`; :func:`session_moves` counts a run's moves, ``bench/routing.py``).

Prompts are token ids wherever a later request must share an exact prefix with an earlier one: text that
is re-encoded need not give back the same ids. The module is torch-free and needs no tokenizer
(:func:`ferry_text_tokens` takes the tokenizer's ``encode``).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from inference_worker import http_headers

SESSION_HEADER = http_headers.STICKY_KEY
"""Request header carrying a session's id: the router's sticky key (``inference_worker/router/app.py``
hashes it to a track), so every turn of a session lands on the same track."""

WORDS = ("the river carries light across stone bridges while engineers measure every quiet signal in "
         "distant data centers and small models learn to write careful answers about weather music "
         "history cooking travel mathematics gardens").split()
"""Vocabulary of :func:`word_prompts`."""

GEMMA_BOS_TOKEN_ID = 2
"""Gemma 3's ``<bos>``: the first id of :func:`random_token_prompts` and multi-turn system prompts."""


@dataclass(frozen=True)
class Request:
    """One single-turn request: a text or token-id prompt and its output length in tokens."""

    prompt: str | tuple[int, ...]
    max_tokens: int


def _check_range(name: str, low_high: tuple[int, int], minimum: int) -> None:
    low, high = low_high
    if not minimum <= low <= high:
        raise ValueError(f"{name} must satisfy {minimum} <= MIN <= MAX, got {low_high}")


def word_prompts(num_prompts: int, seed: int, input_words: tuple[int, int],
                 output_tokens: tuple[int, int]) -> list[Request]:
    """``num_prompts`` text prompts of random :data:`WORDS`, lengths uniform in ``input_words`` (words) and
    ``max_tokens`` uniform in ``output_tokens`` (inclusive ranges).

    Raises:
        ValueError: a range with MIN > MAX or MIN < 1.
    """
    _check_range("input_words", input_words, 1)
    _check_range("output_tokens", output_tokens, 1)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        n_words = rng.randint(*input_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n_words))
        requests.append(Request(prompt, rng.randint(*output_tokens)))
    return requests


def random_token_prompts(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                         vocab_size: int, seed: int) -> list[Request]:
    """``num_requests`` token-id prompts: :data:`GEMMA_BOS_TOKEN_ID` then ids uniform in
    ``[300, min(vocab_size, 200000))`` (clear of control tokens); lengths uniform in ``prompt_range`` (tokens,
    BOS included) and ``max_tokens`` uniform in ``output_range``.

    Raises:
        ValueError: a range with MIN > MAX or MIN < 1, or ``vocab_size`` <= 300.
    """
    _check_range("prompt_range", prompt_range, 1)
    _check_range("output_range", output_range, 1)
    if vocab_size <= 300:
        raise ValueError(f"vocab_size must be > 300, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        prompt = (GEMMA_BOS_TOKEN_ID,) + tuple(rng.randrange(300, min(vocab_size, 200_000)) for _ in range(n - 1))
        requests.append(Request(prompt, rng.randint(*output_range)))
    return requests


def ferry_text_tokens(num_tokens: int, encode: Callable[[str], Sequence[int]]) -> list[int]:
    """The first ``num_tokens`` ids of a varied English text (numbered ferry crossings) as ``encode`` gives them
    (e.g. ``lambda t: tokenizer.encode(t, add_special_tokens=True).ids``, which puts BOS first).

    Raises:
        ValueError: ``encode`` gave fewer than ``num_tokens`` ids.
    """
    text = " ".join(f"Entry {i}: the ferry from harbour {i % 11} carried {7 * i + 3} passengers and "
                    f"{i % 5 + 2} cars across the bay." for i in range(num_tokens // 8 + 64))
    ids = list(encode(text))
    if len(ids) < num_tokens:
        raise ValueError(f"text too short for {num_tokens} tokens ({len(ids)})")
    return ids[:num_tokens]


def poisson_gaps(num: int, rate_per_s: float, seed: int) -> list[float]:
    """``num`` inter-arrival times (seconds) of a Poisson process of ``rate_per_s`` requests per second:
    independent exponential draws of mean ``1 / rate_per_s``; all 0.0 for ``math.inf`` (everything at once).

    Raises:
        ValueError: ``rate_per_s`` not > 0.
    """
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0 (math.inf: all at once), got {rate_per_s}")
    if rate_per_s == math.inf:
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(rate_per_s) for _ in range(num)]


def think_times(session_id: str, num_turns: int, mean_s: float, seed: int) -> list[float]:
    """Think time (seconds) before each of turns ``1 .. num_turns - 1`` of a session: independent exponential
    draws of mean ``mean_s`` from ``random.Random(f"{seed}:{session_id}")`` (a session's draws do not depend on
    how many other sessions there are); all 0.0 for ``mean_s == 0`` (turns back to back).

    Raises:
        ValueError: ``mean_s`` < 0 or ``num_turns`` < 1.
    """
    if not mean_s >= 0:
        raise ValueError(f"mean_s must be >= 0 (0: turns back to back), got {mean_s}")
    if num_turns < 1:
        raise ValueError(f"num_turns must be >= 1, got {num_turns}")
    if mean_s == 0:
        return [0.0] * (num_turns - 1)
    rng = random.Random(f"{seed}:{session_id}")
    return [rng.expovariate(1.0 / mean_s) for _ in range(num_turns - 1)]


@dataclass(frozen=True)
class Turn:
    """One turn of a session: the user's appended token ids and the answer's length in tokens."""

    user_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """A multi-turn conversation; ``index`` is its creation order (ids are ``<session_prefix>session-<index>``)."""

    session_id: str
    index: int
    system_token_ids: tuple[int, ...]
    turns: tuple[Turn, ...]

    def prompt(self, answers: Sequence[Sequence[int]]) -> list[int]:
        """Prompt token ids of turn ``len(answers)``: system, then per earlier turn its user ids and its answer
        ``answers[j]`` exactly, then this turn's user ids.

        Raises:
            ValueError: ``len(answers)`` is not a turn index of the session.
        """
        k = len(answers)
        if k >= len(self.turns):
            raise ValueError(f"{self.session_id} has {len(self.turns)} turns; got answers of {k}")
        ids = list(self.system_token_ids)
        for turn, answer in zip(self.turns[:k], answers, strict=True):
            ids += turn.user_token_ids
            ids += answer
        return ids + list(self.turns[k].user_token_ids)


@dataclass(frozen=True)
class MultiTurnConfig:
    """Shape of a multi-turn workload (defaults: issue 16's ``bench/multi_turn.py``)."""

    num_sessions: int = 8
    num_turns: int = 6
    num_system_tokens: int = 300
    """System prompt length in tokens, BOS included; shared by every session."""
    user_tokens: tuple[int, int] = (100, 300)
    """Appended user tokens per turn, uniform in this inclusive range."""
    max_tokens: int = 32
    """Answer length per turn (sent with ``ignore_eos``)."""
    seed: int = 0
    vocab_range: tuple[int, int] = (300, 200_000)
    """Token ids are drawn uniformly from ``[low, high)``."""
    session_prefix: str = ""
    """Prepended to every session id (``<prefix>session-<index>``): a generator that runs round after round
    gives each round new ids, so new sessions keep arriving at the router's sticky track split."""

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "num_system_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        _check_range("user_tokens", self.user_tokens, 1)
        if not 0 <= self.vocab_range[0] < self.vocab_range[1]:
            raise ValueError(f"vocab_range must be [low, high) with 0 <= low < high, got {self.vocab_range}")


def multi_turn_sessions(config: MultiTurnConfig) -> list[Session]:
    """The sessions of ``config`` in their random start order (a seeded shuffle of creation order).

    Draws from one ``random.Random(config.seed)``: the system prompt (BOS, then ids), each session's turns in
    creation order, then the shuffle; the same config always gives the same sessions and order.
    """
    rng = random.Random(config.seed)
    low, high = config.vocab_range

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(low, high) for _ in range(n))

    system = (GEMMA_BOS_TOKEN_ID,) + ids(config.num_system_tokens - 1)
    sessions = [Session(f"{config.session_prefix}session-{i}", i, system,
                        tuple(Turn(ids(rng.randint(*config.user_tokens)), config.max_tokens)
                              for _ in range(config.num_turns)))
                for i in range(config.num_sessions)]
    rng.shuffle(sessions)
    return sessions


class IdealPrefixCache:
    """A prefix cache with unlimited memory over whole blocks of ``block_size`` tokens.

    :meth:`store` registers every full block of a token sequence whose KV was computed, keyed by its whole
    prefix (exact: no hash). :meth:`num_cached_tokens` is the hit of a prompt: the longest block-aligned prefix
    registered, capped so that the last prompt token is always computed (the rule of vLLM's automatic prefix
    caching and issue 16): at most ``((len(prompt) - 1) // block_size) * block_size`` tokens.

    Raises:
        ValueError: ``block_size`` < 1.
    """

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._blocks: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, block's ids) -> block id

    def _walk(self, token_ids: Sequence[int], num_blocks: int, register: bool) -> int:
        parent = -1
        for b in range(num_blocks):
            key = (parent, tuple(token_ids[b * self.block_size:(b + 1) * self.block_size]))
            if key not in self._blocks:
                if not register:
                    return b
                self._blocks[key] = len(self._blocks)
            parent = self._blocks[key]
        return num_blocks

    def num_cached_tokens(self, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt`` served from the cache (a multiple of ``block_size``, < ``len(prompt)``)."""
        return self._walk(prompt, max(len(prompt) - 1, 0) // self.block_size, register=False) * self.block_size

    def store(self, token_ids: Sequence[int]) -> None:
        """Register every full block of ``token_ids`` (a request's prompt plus every generated token but the
        last: the last sampled token is never fed back, so its KV is never computed)."""
        self._walk(token_ids, len(token_ids) // self.block_size, register=True)


@dataclass(frozen=True)
class MultiTurnWorkload:
    """A multi-turn workload: its config and sessions in start order (:func:`multi_turn_sessions`)."""

    config: MultiTurnConfig
    sessions: tuple[Session, ...]

    @classmethod
    def from_config(cls, config: MultiTurnConfig) -> MultiTurnWorkload:
        return cls(config, tuple(multi_turn_sessions(config)))

    def placeholder_answer(self, session: Session, turn_index: int) -> list[int]:
        """Stand-in answer ids before a run (negative, so never equal to a real id or another answer's)."""
        first = -1 - (session.index * self.config.num_turns + turn_index) * self.config.max_tokens
        return list(range(first, first - session.turns[turn_index].max_tokens, -1))

    def planned_requests(self) -> list[tuple[Session, int, list[int], list[int]]]:
        """Every ``(session, turn index, prompt, answer)`` with :meth:`placeholder_answer` answers, sessions in
        start order, turns in order."""
        out = []
        for session in self.sessions:
            answers: list[list[int]] = []
            for k in range(len(session.turns)):
                prompt = session.prompt(answers)
                answers.append(self.placeholder_answer(session, k))
                out.append((session, k, prompt, answers[-1]))
        return out

    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the whole workload with answers of exactly ``max_tokens`` tokens."""
        return sum(len(prompt) for _, _, prompt, _ in self.planned_requests())

    def ideal_prefill_tokens(self, block_size: int, concurrency: int = 1) -> int:
        """Prompt tokens an :class:`IdealPrefixCache` still computes over the workload.

        Sessions run in start order with ``concurrency`` in flight: the first ``concurrency`` sessions' first
        turns arrive together, so none of them can hit another's system prompt; every later request sees all
        KV computed before it (a session's own history always is: its turns run one after another).
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        cache = IdealPrefixCache(block_size)
        requests = self.planned_requests()
        first_wave = {s.session_id for s in self.sessions[:concurrency]}
        wave = [(p, a) for s, k, p, a in requests if k == 0 and s.session_id in first_wave]
        computed = sum(len(p) - cache.num_cached_tokens(p) for p, _ in wave)
        for p, a in wave:
            cache.store(p + a[:-1])
        for s, k, p, a in requests:
            if k == 0 and s.session_id in first_wave:
                continue
            computed += len(p) - cache.num_cached_tokens(p)
            cache.store(p + a[:-1])
        return computed


def ideal_prefill_tokens_of_run(events: Iterable[tuple[float, float, float, Sequence[int], Sequence[int]]],
                                block_size: int) -> int:
    """Prompt tokens an :class:`IdealPrefixCache` computes for requests as a run really timed them.

    ``events``: per request ``(sent_s, first_token_s, finished_s, prompt, answer)`` on one clock. A request
    sees the prompt blocks of requests whose first token came before it was sent and the answer blocks of
    requests finished before it was sent.
    """
    timeline = []
    for sent, first, finished, prompt, answer in events:
        timeline += [(sent, 1, "lookup", list(prompt)), (first, 0, "store", list(prompt)),
                     (finished, 0, "store", list(prompt) + list(answer)[:-1])]
    cache = IdealPrefixCache(block_size)
    computed = 0
    for _, _, kind, ids in sorted(timeline, key=lambda e: (e[0], e[1])):
        if kind == "store":
            cache.store(ids)
        else:
            computed += len(ids) - cache.num_cached_tokens(ids)
    return computed


def session_moves(records: list[dict]) -> dict[str, int]:
    """Placement of later turns: ``later_turns`` (turns 1.. of every session), ``moved`` (served by another decode
    replica than the session's previous turn: its history there is cold or stale) and ``remote`` (remote prefill)."""
    by_session: dict[str, list[dict]] = {}
    for r in records:
        by_session.setdefault(r["session_id"], []).append(r)
    later = moved = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        for prev, cur in zip(turns, turns[1:], strict=False):
            later += 1
            moved += cur["replica"] != prev["replica"]
    remote = sum(r["decision"] == "remote_prefill" for r in records)
    return {"later_turns": later, "moved": moved, "remote": remote}


def ttft_by_computed_tokens(records: list[dict], bin_tokens: int = 50) -> dict:
    """Client TTFT against the prompt tokens each request computed (``num_computed_tokens``: prompt minus hit).

    Why: a turn of a multi-turn session always computes its new user tokens, the previous answer and the part of
    the history's last block that was not full, whatever the cache holds, and a prefill's time grows with the
    tokens it computes; so the TTFT of a policy follows its *median* computed tokens, not its total prefill tokens
    (which the tail of turns that moved dominates).

    Returns:
        ``computed_tokens_p50`` / ``computed_tokens_p90`` (tokens; linear interpolation, as numpy's default),
        ``fit``: the least-squares line ``ttft_ms = intercept_ms + ms_per_token * computed``
        (:func:`statistics.linear_regression`; None for fewer than two distinct token counts), and
        ``median_ttft_ms_by_bin``: ``"lo-hi"`` (computed tokens, ``bin_tokens`` wide) -> (median TTFT ms, requests).

    Raises:
        ValueError: no records, or ``bin_tokens`` < 1.
    """
    if not records or bin_tokens < 1:
        raise ValueError("need at least one record and bin_tokens >= 1")
    computed = [r["num_computed_tokens"] for r in records]
    ttft_ms = [r["ttft_s"] * 1e3 for r in records]
    fit = None
    if len(set(computed)) > 1:
        slope, intercept = statistics.linear_regression(computed, ttft_ms)
        fit = {"intercept_ms": intercept, "ms_per_token": slope}
    bins: dict[int, list[float]] = {}
    for tokens, ms in zip(computed, ttft_ms, strict=True):
        bins.setdefault(tokens // bin_tokens, []).append(ms)
    by_bin = {f"{k * bin_tokens}-{(k + 1) * bin_tokens - 1}": (statistics.median(v), len(v)) for k, v in sorted(bins.items())}
    deciles = statistics.quantiles(computed, n=10, method="inclusive") if len(computed) > 1 else [computed[0]] * 9
    p50, p90 = deciles[4], deciles[8]
    return {"computed_tokens_p50": p50, "computed_tokens_p90": p90, "fit": fit, "median_ttft_ms_by_bin": by_bin}


def placement_bounds(workload: MultiTurnWorkload, block_size: int, num_replicas: int = 2, seed: int = 0) -> dict:
    """Prefill tokens of the workload on ``num_replicas`` unlimited caches (:class:`IdealPrefixCache`
    each, requests in :meth:`MultiTurnWorkload.planned_requests` order) for two placements:
    ``sticky`` (every turn of a session on the replica of its first turn, sessions dealt round-robin) and ``random``
    (each turn on a replica drawn uniformly: what a load-only policy does to a session among equally loaded
    replicas). Host-independent: ``random / sticky`` is about the most prefill tokens cache affinity can save on
    this workload, since a moved turn still hits its history up to its last visit to that replica.

    ``{placement}_computed_p50``: the median request's computed tokens (prompt minus hit). A request's TTFT grows
    with them, so ``random_over_sticky_p50`` is about the most cache affinity can lower TTFT p50 (less with any
    fixed cost per request): most turns of a randomly placed session still find most of their history."""
    rng = random.Random(seed)
    out: dict = {}
    for placement in ("sticky", "random"):
        caches = [IdealPrefixCache(block_size) for _ in range(num_replicas)]
        home = {s.session_id: i % num_replicas for i, s in enumerate(workload.sessions)}
        computed = []
        for session, _, prompt, answer in workload.planned_requests():
            cache = caches[home[session.session_id] if placement == "sticky" else rng.randrange(num_replicas)]
            computed.append(len(prompt) - cache.num_cached_tokens(prompt))
            cache.store(prompt + answer[:-1])
        out[f"{placement}_prefill_tokens"] = sum(computed)
        out[f"{placement}_computed_p50"] = statistics.median(computed)
    out["random_over_sticky"] = out["random_prefill_tokens"] / max(out["sticky_prefill_tokens"], 1)
    out["random_over_sticky_p50"] = out["random_computed_p50"] / max(out["sticky_computed_p50"], 1)
    return out
