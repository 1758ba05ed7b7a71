"""Unit tests of bench/workloads.py, the workload module of every benchmark and of the load generator."""

from __future__ import annotations

import math
import statistics

import pytest

from bench.workloads import (
    GEMMA_BOS_TOKEN_ID,
    IdealPrefixCache,
    MultiTurnConfig,
    MultiTurnWorkload,
    ferry_text_tokens,
    ideal_prefill_tokens_of_run,
    multi_turn_sessions,
    poisson_gaps,
    random_token_prompts,
    think_times,
    word_prompts,
)


def test_default_multi_turn_workload_has_exact_token_counts_per_turn_for_seed_0():
    sessions = multi_turn_sessions(MultiTurnConfig())
    assert [s.session_id for s in sessions] == ["session-7", "session-5", "session-2", "session-1", "session-0",
                                                "session-6", "session-3", "session-4"]
    assert [len(t.user_token_ids) for t in sessions[0].turns] == [133, 253, 223, 288, 267, 172]
    assert [len(t.user_token_ids) for t in sessions[1].turns] == [147, 276, 248, 296, 223, 149]
    first = sessions[0]
    assert len(first.system_token_ids) == 300 and first.system_token_ids[0] == GEMMA_BOS_TOKEN_ID
    answers: list[list[int]] = []
    lengths = []
    for k in range(6):
        lengths.append(len(first.prompt(answers)))
        answers.append(list(range(1000 + 32 * k, 1032 + 32 * k)))
    # 300 system tokens, then each earlier turn's user tokens plus its 32 answer tokens, then this turn's.
    assert lengths == [433, 718, 973, 1293, 1592, 1796]


def test_every_session_shares_the_system_prompt_and_draws_within_the_ranges():
    sessions = multi_turn_sessions(MultiTurnConfig(num_sessions=5, num_turns=3, user_tokens=(2, 4), seed=11))
    assert len({s.system_token_ids for s in sessions}) == 1
    assert sorted(s.index for s in sessions) == [0, 1, 2, 3, 4]
    for s in sessions:
        for turn in s.turns:
            assert 2 <= len(turn.user_token_ids) <= 4 and turn.max_tokens == 32
            assert all(300 <= t < 200_000 for t in turn.user_token_ids)


def test_same_seed_gives_the_same_sessions_and_another_seed_other_ones():
    config = MultiTurnConfig(num_sessions=4, num_turns=2, seed=5)
    assert multi_turn_sessions(config) == multi_turn_sessions(MultiTurnConfig(num_sessions=4, num_turns=2, seed=5))
    other = multi_turn_sessions(MultiTurnConfig(num_sessions=4, num_turns=2, seed=6))
    assert other[0].system_token_ids != multi_turn_sessions(config)[0].system_token_ids


def test_prompt_appends_the_previous_answer_ids_exactly():
    session = multi_turn_sessions(MultiTurnConfig(num_sessions=1, num_turns=3, num_system_tokens=4,
                                                  user_tokens=(3, 3), max_tokens=2))[0]
    system, (u0, u1, u2) = list(session.system_token_ids), [list(t.user_token_ids) for t in session.turns]
    a0, a1 = [7, 7], [5, 0, 9]  # an answer is appended as given, whatever its length or ids
    assert session.prompt([]) == system + u0
    assert session.prompt([a0]) == system + u0 + a0 + u1
    assert session.prompt([a0, a1]) == system + u0 + a0 + u1 + a1 + u2
    with pytest.raises(ValueError, match="has 3 turns"):
        session.prompt([a0, a1, a0])


def test_poisson_inter_arrival_mean_is_one_over_the_rate_within_3_percent():
    gaps = poisson_gaps(20_000, 4.0, seed=1)
    # Exponential(rate 4): mean 0.25 s, std 0.25 s; the mean of 20,000 draws has std 0.0018 s (3% is 4 sigma).
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)
    assert poisson_gaps(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    assert poisson_gaps(5, 2.0, seed=9) == poisson_gaps(5, 2.0, seed=9)
    with pytest.raises(ValueError, match="rate_per_s must be > 0"):
        poisson_gaps(3, 0.0, seed=1)


def test_think_times_are_exponential_per_session_and_zero_for_back_to_back_turns():
    draws = [t for i in range(4000) for t in think_times(f"session-{i}", 6, 20.0, seed=0)]
    # Exponential(mean 20 s): std 20 s; the mean of 20,000 draws has std 0.14 s (3% = 0.6 s is 4 sigma).
    assert len(draws) == 20_000
    assert statistics.fmean(draws) == pytest.approx(20.0, rel=0.03)
    assert statistics.stdev(draws) == pytest.approx(20.0, rel=0.05)
    # A session's think times depend on its id and the seed only, not on the other sessions.
    assert think_times("session-3", 6, 20.0, seed=0) == draws[15:20]
    assert think_times("session-3", 6, 20.0, seed=1) != draws[15:20]
    assert think_times("session-3", 4, 0.0, seed=0) == [0.0, 0.0, 0.0]
    assert think_times("session-3", 1, 5.0, seed=0) == []
    with pytest.raises(ValueError, match="mean_s must be >= 0"):
        think_times("session-3", 3, -1.0, seed=0)


def test_single_turn_workloads_keep_the_prompts_the_benches_drew_before():
    # First prompt of serve_load's former make_workload(16, 3, (8, 400), (8, 32)) and of engine_throughput's
    # former make_workload(8, (64, 1024), (16, 256), 262144, 0): the same seed still gives the same requests.
    words = word_prompts(16, 3, (8, 400), (8, 32))
    assert words[0].prompt.startswith("engineers careful travel across the travel centers distant")
    assert (len(words[0].prompt.split()), words[0].max_tokens) == (129, 32)
    tokens = random_token_prompts(8, (64, 1024), (16, 256), 262144, 0)
    assert tokens[0].prompt[:5] == (2, 101289, 198993, 110550, 10912)
    assert (len(tokens[0].prompt), tokens[0].max_tokens) == (928, 94)
    with pytest.raises(ValueError, match="input_words"):
        word_prompts(1, 0, (9, 8), (1, 1))


def test_ferry_text_tokens_takes_the_first_ids_of_the_encoded_text():
    def encode(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    assert ferry_text_tokens(6, encode) == [5, 2, 3, 5, 4, 7]  # "Entry 0: the ferry from harbour"
    with pytest.raises(ValueError, match="too short"):
        ferry_text_tokens(10, lambda text: [1, 2])


def test_ideal_prefix_cache_hits_whole_blocks_and_always_computes_the_last_prompt_token():
    cache = IdealPrefixCache(block_size=2)
    cache.store([1, 2, 3, 4, 5])  # blocks [1, 2] and [3, 4]; the partial [5] is not registered
    assert cache.num_cached_tokens([1, 2, 3, 4, 5, 6, 7]) == 4
    assert cache.num_cached_tokens([1, 2, 3, 4]) == 2  # the whole prompt cached: its last token is recomputed
    assert cache.num_cached_tokens([1, 2, 3, 9, 5]) == 2
    assert cache.num_cached_tokens([9, 2, 3, 4, 5]) == 0
    assert cache.num_cached_tokens([3, 4, 1, 2]) == 0  # a block is keyed by its whole prefix, not its own ids
    with pytest.raises(ValueError, match="block_size"):
        IdealPrefixCache(0)


def test_ideal_prefill_tokens_of_a_small_workload():
    config = MultiTurnConfig(num_sessions=2, num_turns=2, num_system_tokens=4, user_tokens=(3, 3), max_tokens=2)
    workload = MultiTurnWorkload.from_config(config)
    # Prompts: turn 0 = 4 system + 3 user = 7 tokens, turn 1 = 7 + 2 answer + 3 user = 12 tokens.
    assert workload.num_prompt_tokens() == 38
    # Block size 2: the first turn 0 computes 7; the second hits the 4 system tokens and computes 3; each
    # turn 1 hits 8 tokens (its turn 0 prompt and the first answer token) and computes 4.
    assert workload.ideal_prefill_tokens(block_size=2) == 7 + 3 + 4 + 4
    # Both first turns in flight together: neither can use the other's system prompt.
    assert workload.ideal_prefill_tokens(block_size=2, concurrency=2) == 7 + 7 + 4 + 4
    assert workload.ideal_prefill_tokens(block_size=1) == 7 + 3 + 4 + 4  # 1 answer token and 3 user tokens


def test_ideal_of_a_run_sees_only_kv_computed_before_a_request_was_sent():
    prompt, answer = [1, 2, 3, 4, 5], [6, 7]
    # Second request sent after the first one's first token (its prompt blocks exist) but before it finished.
    assert ideal_prefill_tokens_of_run([(0.0, 1.0, 2.0, prompt, answer), (1.5, 3.0, 4.0, prompt + [6, 9], [1])],
                                       block_size=2) == 5 + 3
    # Sent after it finished: the first answer token's block [5, 6] is there too.
    assert ideal_prefill_tokens_of_run([(0.0, 1.0, 2.0, prompt, answer), (2.5, 3.0, 4.0, prompt + [6, 9], [1])],
                                       block_size=2) == 5 + 1
    # Sent before its first token: nothing to hit.
    assert ideal_prefill_tokens_of_run([(0.0, 1.0, 2.0, prompt, answer), (0.5, 3.0, 4.0, prompt + [6, 9], [1])],
                                       block_size=2) == 5 + 7
