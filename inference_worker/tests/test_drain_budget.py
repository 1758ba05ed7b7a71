"""The drain fits the SIGTERM -> exit budget the agent (and Kubernetes) enforce with SIGKILL: in-flight requests
are waited for until the abort grace and the exit margin are all that is left, so aborted streams end with
``finish_reason: "abort"`` and ``[DONE]`` instead of being cut by the SIGKILL (chaos matrix: streams of a
replica stopped under load broke off mid-event). In process, no model."""

import asyncio
from types import SimpleNamespace

import uvicorn

from inference_worker.server.lifecycle import ABORT_GRACE_S, EXIT_MARGIN_S, DrainingServer, drain_wait_s


def test_drain_wait_leaves_the_abort_grace_and_exit_margin_inside_the_budget():
    assert [drain_wait_s(t) for t in (10, 300, 3, 1, 0)] == [7.0, 297.0, 0.0, 0.0, 0.0]
    assert (ABORT_GRACE_S, EXIT_MARGIN_S) == (2.0, 1.0)


def test_a_drain_that_times_out_aborts_at_budget_minus_three_seconds_then_waits_the_grace():
    calls = []

    async def wait_idle(timeout_s):
        calls.append(("wait_idle", timeout_s))
        return False  # requests still in flight

    state = SimpleNamespace(drain_timeout_s=10.0, num_in_flight=2, wait_idle=wait_idle,
                            abort_all=lambda: calls.append(("abort_all",)))
    server = DrainingServer(uvicorn.Config(app=None), state)
    asyncio.run(server._drain())
    assert calls == [("wait_idle", 7.0), ("abort_all",), ("wait_idle", ABORT_GRACE_S)]
    assert server.should_exit is True
