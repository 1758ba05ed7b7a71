"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption newest-first and resume, abort."""

import pytest

from inference_worker.engine.kv_cache_manager import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    HybridKVCacheManager,
    KVCacheGroupSpec,
)
from inference_worker.engine.request import Request, RequestStatus
from inference_worker.engine.sched_output import ModelRunnerOutput
from inference_worker.engine.scheduler import Scheduler

BS = 2


class FakeRunner:
    """Mirrors the runner's side of the contract; samples token 1000 + (position of the new token)."""

    def __init__(self):
        self.token_ids = {}
        self.computed = {}
        self.block_tables = {}

    def step(self, out):
        for req_id in out.finished_req_ids:
            self.token_ids.pop(req_id)
            self.block_tables.pop(req_id)
        for req_id in out.preempted_req_ids:
            self.block_tables.pop(req_id)
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.token_ids
            self.token_ids[new.request_id] = list(new.prompt_token_ids)
            self.block_tables[new.request_id] = [list(ids) for ids in new.block_ids]
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                assert cached.num_computed_tokens == 0
                self.block_tables[cached.request_id] = [list(ids) for ids in cached.new_block_ids]
            else:
                for table, ids in zip(self.block_tables[cached.request_id], cached.new_block_ids):
                    table.extend(ids)
            assert self.computed[cached.request_id] == cached.num_computed_tokens or cached.resumed_from_preemption
            self.computed[cached.request_id] = cached.num_computed_tokens
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            self.computed[req_id] += n
            tokens = self.token_ids[req_id]
            assert self.computed[req_id] <= len(tokens)
            for table in self.block_tables[req_id]:
                assert len(table) * BS >= self.computed[req_id]
            if self.computed[req_id] == len(tokens):
                tokens.append(1000 + len(tokens))
                sampled[req_id] = [tokens[-1]]
        return ModelRunnerOutput(sampled_token_ids=sampled)


def make_scheduler(num_full_blocks=40, num_sliding_blocks=None, window=4, **limits):
    groups = [KVCacheGroupSpec(FULL_ATTENTION, (0,), None, num_full_blocks + 1, BS)]
    if num_sliding_blocks is not None:
        groups.append(KVCacheGroupSpec(SLIDING_ATTENTION, (1, 2), window, num_sliding_blocks + 1, BS))
    limits = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64} | limits
    return Scheduler(HybridKVCacheManager(groups), **limits)


def add(scheduler, request_id, num_prompt, max_tokens, arrival, stop=()):
    request = Request(request_id, list(range(1, num_prompt + 1)), max_tokens, stop, arrival_time=arrival)
    scheduler.add_request(request)
    return request


def run(scheduler, runner, max_steps=200):
    """Steps until idle; returns per step (num_scheduled_tokens, preempted ids) and the outputs."""
    trace, outputs, finish = [], {}, {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        trace.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids)))
        for update in scheduler.update_from_output(out, runner.step(out)):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason:
                finish[update.request_id] = update.finish_reason
    return trace, outputs, finish


def test_chunked_prefill_mixes_with_decodes_within_budget():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "a", 3, 3, arrival=0.0)
    add(scheduler, "b", 6, 2, arrival=1.0)
    trace, outputs, finish = run(scheduler, FakeRunner())
    assert [step for step, _ in trace] == [
        {"a": 3, "b": 1},
        {"a": 1, "b": 3},  # b's prefill continues in chunks beside a's decode
        {"a": 1, "b": 2},
        {"b": 1},
    ]
    assert outputs == {"a": [1003, 1004, 1005], "b": [1006, 1007]}
    assert finish == {"a": "length", "b": "length"}
    assert scheduler.kv_cache_manager.get_num_free_blocks() == (40,)


def test_max_num_seqs_limits_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(5):
        add(scheduler, f"r{i}", 2, 2 + i, arrival=float(i))
    trace, outputs, _ = run(scheduler, FakeRunner())
    assert max(len(step) for step, _ in trace) == 2
    assert [sorted(step) for step, _ in trace[:4]] == [["r0", "r1"], ["r0", "r1"], ["r1", "r2"], ["r2", "r3"]]
    assert all(outputs[f"r{i}"] == list(range(1002, 1004 + i)) for i in range(5))


def test_preemption_is_newest_first():
    scheduler = make_scheduler(num_full_blocks=6, max_num_batched_tokens=16)
    for i, name in enumerate(["a", "b", "c"]):
        add(scheduler, name, 3, 6, arrival=float(i))
    trace, outputs, finish = run(scheduler, FakeRunner())
    preempted = [ids for _, ids in trace if ids]
    assert preempted == [["c"], ["b"]]
    # step 3: a's position 4 needs a block -> c (newest) goes; step 5: a's position 6 -> b goes
    assert trace[2] == ({"a": 1, "b": 1}, ["c"])
    assert trace[4] == ({"a": 1}, ["b"])
    # recompute gives each request exactly the tokens it would have had without preemption
    assert outputs == {name: [1003, 1004, 1005, 1006, 1007, 1008] for name in "abc"}
    assert finish == {"a": "length", "b": "length", "c": "length"}
    assert scheduler.kv_cache_manager.get_num_free_blocks() == (6,)


def test_preempted_request_resumes_by_recomputing_prompt_and_output():
    scheduler = make_scheduler(num_full_blocks=6)
    add(scheduler, "a", 4, 5, arrival=0.0)
    b = add(scheduler, "b", 4, 5, arrival=1.0)
    runner = FakeRunner()
    resumed = []
    for _ in range(50):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"b"}
            assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert b.output_token_ids == [1004, 1005, 1006]
        resumed += [(c.request_id, c.num_computed_tokens, out.num_scheduled_tokens[c.request_id], len(c.new_block_ids[0]))
                    for c in out.scheduled_cached_reqs if c.resumed_from_preemption]
        scheduler.update_from_output(out, runner.step(out))
    # b resumes once a finished: 4 prompt + 3 output tokens recomputed in one step, into 4 fresh blocks
    assert resumed == [("b", 0, 7, 4)]
    assert b.output_token_ids == [1004, 1005, 1006, 1007, 1008] and b.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_num_free_blocks() == (6,)


def test_abort_frees_blocks_at_once_and_tells_the_runner():
    scheduler = make_scheduler(num_full_blocks=10)
    add(scheduler, "a", 5, 10, arrival=0.0)
    add(scheduler, "b", 3, 10, arrival=1.0)
    runner = FakeRunner()
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.step(out))
    assert scheduler.kv_cache_manager.get_num_free_blocks() == (5,)
    scheduler.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == (8,)
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}
    scheduler.update_from_output(out, runner.step(out))
    add(scheduler, "c", 2, 10, arrival=2.0)
    scheduler.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)  # running and waiting
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.get_num_free_blocks() == (10,)
    with pytest.raises(ValueError, match="FINISHED_"):
        scheduler.finish_requests(["b"], RequestStatus.RUNNING)


def test_stop_token_finishes_with_stop():
    scheduler = make_scheduler()
    add(scheduler, "a", 3, 10, arrival=0.0, stop=(1005,))
    _, outputs, finish = run(scheduler, FakeRunner())
    assert outputs == {"a": [1003, 1004, 1005]} and finish == {"a": "stop"}


def test_max_model_len_caps_the_output():
    scheduler = make_scheduler(max_model_len=6)
    add(scheduler, "a", 4, 10, arrival=0.0)
    _, outputs, finish = run(scheduler, FakeRunner())
    assert outputs == {"a": [1004, 1005]} and finish == {"a": "length"}


def test_hybrid_groups_keep_sliding_blocks_bounded_and_free_everything():
    scheduler = make_scheduler(num_full_blocks=60, num_sliding_blocks=12, window=4, max_num_batched_tokens=6)
    requests = [add(scheduler, f"r{i}", n, 12, arrival=float(i)) for i, n in enumerate([9, 2, 13])]
    runner = FakeRunner()
    kv = scheduler.kv_cache_manager
    peak = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for req_id, n in out.num_scheduled_tokens.items():
            # a chunk of n tokens needs window-1 earlier positions plus itself: cdiv(3 + n, 2) + 1 blocks at most
            assert kv.num_held_blocks(req_id)[1] <= -(-(3 + n) // BS) + 1
        peak = max(peak, 12 - kv.get_num_free_blocks()[1])
        scheduler.update_from_output(out, runner.step(out))
    assert peak == 9  # three decoding requests x (cdiv(W, BS) + 1) blocks and [r.num_preemptions for r in requests] == [0, 0, 0]
    assert [r.output_token_ids for r in requests] == [list(range(1000 + n, 1012 + n)) for n in (9, 2, 13)]
    assert kv.get_num_free_blocks() == (60, 12)
    out = scheduler.schedule()  # the last finished ids reach the runner with the next step
    assert out.is_empty and out.finished_req_ids == {"r2"}
    runner.step(out)
    assert runner.token_ids == {}


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "message"),
    [(64, 1, "max_model_len is 64"), (30, 30, "needs up to 30 full_attention blocks but the KV cache has 20")],
)
def test_add_request_refuses_hopeless_requests(num_prompt, max_tokens, message):
    scheduler = make_scheduler(num_full_blocks=20)
    with pytest.raises(ValueError, match=message):
        add(scheduler, "a", num_prompt, max_tokens, arrival=0.0)


def test_max_request_tokens_agrees_with_capacity_error_for_full_and_sliding_groups():
    scheduler = make_scheduler(num_full_blocks=20)  # 20 full blocks of BS=2: 40 tokens under max_model_len 64
    assert scheduler.max_request_tokens() == 40
    assert scheduler.capacity_error(20, 20) is None
    assert scheduler.capacity_error(20, 21) == ("needs up to 21 full_attention blocks but the KV cache has 20; "
                                                "raise --kv-cache-memory or lower max_tokens")
    # sliding window peak cdiv(4 - 1 + 64, 2) + 1 = 35 blocks > 10: the sliding group bounds a request to 20 tokens
    scheduler = make_scheduler(num_full_blocks=40, num_sliding_blocks=10)
    assert scheduler.max_request_tokens() == 20
    assert scheduler.capacity_error(10, 10) is None
    assert scheduler.capacity_error(10, 11).startswith("needs up to 11 sliding_attention blocks but the KV cache has 10")
    # a sliding group that holds its peak does not bound the length: max_model_len does
    assert make_scheduler(num_full_blocks=40, num_sliding_blocks=35).max_request_tokens() == 64


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    add(scheduler, "a", 2, 2, arrival=0.0)
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "a", 2, 2, arrival=1.0)
