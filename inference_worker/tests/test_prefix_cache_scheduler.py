"""The scheduler with prefix caching against a KV-content simulator (torch-free).

``ContentRunner`` stores in each cache slot the identity of the KV written there (the token prefix
of its position) and, at every computed query position, checks that every key position the query
reads — full layers all earlier positions, sliding layers the last W (HF convention
``i - W < j <= i``) — is found through the request's block table with exactly that identity. A
wrong hit, a block reused while still read, a nulled block still read or a partly written block
used by a hit all fail the check. Sampling is a function of the token prefix, so caching on and off
must give the same tokens.
"""

import pytest

from inference_worker.engine.block_hash import prefix_root
from inference_worker.engine.kv_cache_manager import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    HybridKVCacheManager,
    KVCacheGroupSpec,
)
from inference_worker.engine.kv_connector import ExternalKV, KVConnector
from inference_worker.engine.request import Request
from inference_worker.engine.sched_output import ModelRunnerOutput
from inference_worker.engine.scheduler import Scheduler

W = 5


def ident(tokens, position):
    return hash(tuple(tokens[: position + 1]))


class ContentRunner:
    def __init__(self, kv, connector=None):
        self.kv = kv
        self.windows = [g.sliding_window for g in kv.groups]
        self.bs = kv.block_size
        self.cache = [dict() for _ in self.windows]
        self.state = {}
        self.resumed_with_hit = 0
        self.connector = connector

    def slot(self, table, p):
        block = table[p // self.bs]
        assert block != 0, f"position {p} maps to the null block"
        return block * self.bs + p % self.bs

    def step(self, out):
        for rid in out.finished_req_ids:
            self.state.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.state[rid]["tables"] = None
        for new in out.scheduled_new_reqs:
            self.state[new.request_id] = {"tokens": list(new.prompt_token_ids) + list(new.output_token_ids),
                                          "tables": [list(t) for t in new.block_ids],
                                          "computed": new.num_computed_tokens}
        for cached in out.scheduled_cached_reqs:
            st = self.state[cached.request_id]
            if cached.resumed_from_preemption:
                st["tables"] = [list(t) for t in cached.new_block_ids]
                self.resumed_with_hit += cached.num_computed_tokens > 0
            else:
                for table, ids in zip(st["tables"], cached.new_block_ids, strict=True):
                    table.extend(ids)
            st["computed"] = cached.num_computed_tokens
        if self.connector is not None:
            self.connector.load(self)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            st = self.state[rid]
            tokens, tables, start = st["tokens"], st["tables"], st["computed"]
            for p in range(start, start + n):
                for g, table in enumerate(tables):
                    self.cache[g][self.slot(table, p)] = ident(tokens, p)
            for p in range(start, start + n):
                for g, (table, w) in enumerate(zip(tables, self.windows, strict=True)):
                    for j in range(0 if w is None else max(0, p - w + 1), p + 1):
                        assert self.cache[g][self.slot(table, j)] == ident(tokens, j), (rid, g, p, j)
            st["computed"] = start + n
            if start + n == len(tokens):
                tokens.append(300 + ident(tokens, len(tokens) - 1) % 97)
                sampled[rid] = [tokens[-1]]
        return ModelRunnerOutput(sampled_token_ids=sampled)


def make(bs, caching, num_full=60, num_sliding=60, connector=None, **limits):
    kv = HybridKVCacheManager(
        [KVCacheGroupSpec(FULL_ATTENTION, (0,), None, num_full + 1, bs),
         KVCacheGroupSpec(SLIDING_ATTENTION, (1,), W, num_sliding + 1, bs)],
        enable_prefix_caching=caching, prefix_root=prefix_root("ab" * 32, "float32", bs))
    limits = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128} | limits
    return Scheduler(kv, connector=connector, **limits)


def run(scheduler, runner, requests):
    """Add (request, step to add it at) pairs; step until idle; returns outputs and cached tokens per request."""
    outputs, cached = {}, {}
    pending = sorted(requests, key=lambda r: r[1])
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1] <= step:
            scheduler.add_request(pending.pop(0)[0])
        out = scheduler.schedule()
        cached.update(out.num_cached_tokens)
        for update in scheduler.update_from_output(out, runner.step(out)):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        step += 1
        assert step < 500
    return outputs, cached


def conversation(turns, system_len=11, turn_len=6, max_tokens=4):
    """Multi-turn: each turn's prompt is the previous prompt + the previous answer + new tokens (answer
    tokens are those the simulator samples, so they are derived by running turn by turn)."""
    return [(list(range(1, system_len + 1)), max_tokens)] + [(list(range(50 + 10 * t, 50 + 10 * t + turn_len)),
                                                              max_tokens) for t in range(1, turns)]


def run_turns(bs, caching, **limits):
    scheduler = make(bs, caching, **limits)
    runner = ContentRunner(scheduler.kv_cache_manager)
    history, all_outputs, hits = [], [], []
    for t, (new_tokens, max_tokens) in enumerate(conversation(4)):
        prompt = history + new_tokens
        outputs, cached = run(scheduler, runner, [(Request(f"t{t}", prompt, max_tokens), 0)])
        history = prompt + outputs[f"t{t}"]
        all_outputs.append(outputs[f"t{t}"])
        hits.append(cached[f"t{t}"])
    return all_outputs, hits, scheduler


@pytest.mark.parametrize("bs", [1, 2, 7])
def test_multi_turn_hits_reuse_prompt_and_generated_blocks_with_the_same_tokens(bs):
    off, hits_off, _ = run_turns(bs, caching=False)
    on, hits, scheduler = run_turns(bs, caching=True)
    assert on == off and hits_off == [0, 0, 0, 0]
    # turn t's prompt starts with turn t-1's prompt + answer, of which all but the last answer token was computed
    lengths = [11, 11 + 4 + 6, 21 + 4 + 6, 31 + 4 + 6]
    expected = [0] + [((lengths[t - 1] + 4 - 1) // bs) * bs for t in range(1, 4)]
    assert hits == expected
    kv = scheduler.kv_cache_manager
    assert kv.num_hit_tokens == sum(expected) and kv.num_query_tokens == sum(lengths)


@pytest.mark.parametrize("bs", [1, 2, 7])
def test_hits_with_chunked_prefill(bs):
    off, _, _ = run_turns(bs, caching=False, max_num_batched_tokens=3)
    on, hits, _ = run_turns(bs, caching=True, max_num_batched_tokens=3)
    assert on == off and hits[1:] == [((n + 3) // bs) * bs for n in (11, 21, 31)]


@pytest.mark.parametrize("bs", [1, 2])
def test_preempted_requests_hit_their_own_blocks_and_give_the_same_tokens(bs):
    def workload():
        return [(Request(f"r{i}", [7, 8, 9, 10, 11] + [20 + i] * (6 + 3 * i), 12, arrival_time=float(i)), 0)
                for i in range(4)]

    results = []
    for caching in (False, True):
        scheduler = make(bs, caching, num_full=40 // bs, num_sliding=40 // bs, max_num_batched_tokens=8)
        runner = ContentRunner(scheduler.kv_cache_manager)
        outputs, _ = run(scheduler, runner, workload())
        results.append((outputs, runner.resumed_with_hit))
        kv = scheduler.kv_cache_manager
        assert kv.get_num_free_blocks() == kv.get_num_usable_blocks()
    (off, resumed_off), (on, resumed_on) = results
    assert on == off
    assert resumed_off == 0 and resumed_on > 0


class ImportConnector(KVConnector):
    """A PD-like import: positions ``0..N-1`` for full layers, the last W-1 for sliding layers."""

    def __init__(self, imports):
        self.imports = imports  # request id -> prompt length N
        self.to_load = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = self.imports.get(request.request_id)
        if n is None:
            return None
        return ExternalKV(n, (0, max(0, n - (W - 1))))

    def update_state_after_alloc(self, request, block_ids, external):
        self.to_load.append((request.request_id, external))
        del self.imports[request.request_id]

    def load(self, runner):
        for rid, external in self.to_load:
            st = runner.state[rid]
            for g, first in enumerate(external.first_positions):
                for p in range(first, external.num_tokens):
                    runner.cache[g][runner.slot(st["tables"][g], p)] = ident(st["tokens"], p)
        self.to_load.clear()


@pytest.mark.parametrize(("bs", "n", "expected_hit"), [(1, 13, 13), (2, 12, 12), (2, 13, 0), (3, 12, 0), (4, 12, 12)])
def test_a_hit_inside_an_imported_window_never_uses_its_partly_written_block(bs, n, expected_hit):
    """Sliding layers received positions n-W+1..n-1; the block holding n-W+1 is partly written unless it
    starts there, and a hit reading it must not happen (expected hits worked out from the hit rule)."""
    prompt = list(range(40, 40 + n))
    follow = prompt + [1, 2, 3, 4, 5]
    outputs = {}
    for label, connector in (("colocated", None), ("imported", ImportConnector({"imp": n}))):
        scheduler = make(bs, True, connector=connector)
        runner = ContentRunner(scheduler.kv_cache_manager, connector)
        first = [] if connector is None else [300 + ident(prompt, n - 1) % 97]
        out, cached = run(scheduler, runner, [(Request("imp", prompt, 4, output_token_ids=first), 0),
                                              (Request("next", follow, 3), 20)])
        outputs[label] = (first + out["imp"], out["next"])
        if connector is not None:
            assert cached == {"imp": 0, "next": expected_hit}
    assert outputs["imported"] == outputs["colocated"]
