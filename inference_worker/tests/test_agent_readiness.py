"""The agent's readiness verdict: a worker that answers /ready with anything but 200 is unready at once, one that
does not answer in time only after READY_FAILURE_THRESHOLD probes in a row (a busy worker on a loaded host kept
flapping out of the routing table: 503 "no decode replica left" while nothing was stopped).

A real HTTP server plays the worker's /ready; the record's pid is this test process (alive, same cmdline).
"""

import http.server
import os
import threading
import time

from inference_worker.agent.processes import READY_FAILURE_THRESHOLD, ProcessManager, read_cmdline
from inference_worker.agent.state import ProcessRecord

PROBE_TIMEOUT_S = 0.2


class ReadyHandler(http.server.BaseHTTPRequestHandler):
    answers: list[str] = []  # per probe: "ok" (200), "slow" (no answer within the timeout), "draining" (503)

    def do_GET(self):  # noqa: N802 - http.server's name
        answer = self.answers.pop(0)
        if answer == "slow":
            time.sleep(PROBE_TIMEOUT_S * 3)
        try:
            self.send_response(200 if answer in ("ok", "slow") else 503)
            self.end_headers()
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_unanswered_probes_unready_a_worker_only_after_three_in_a_row_and_a_503_at_once(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ReadyHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    manager = ProcessManager(tmp_path / "agent", probe_timeout_s=PROBE_TIMEOUT_S)
    me = os.getpid()
    record = ProcessRecord(name="decode-stable-0", args=["serve"], env={}, labels={}, drain_timeout_s=10,
                           port=server.server_address[1], pid=me, cmdline=read_cmdline(me), log_path="/dev/null",
                           started_at=0.0)
    manager.state.processes[record.name] = record
    ReadyHandler.answers = ["ok", "slow", "slow", "ok", "slow", "slow", "slow", "ok", "draining"]
    seen = []
    try:
        for _ in range(len(ReadyHandler.answers)):
            manager.poll_once()
            seen.append(record.ready)
    finally:
        server.shutdown()
        manager.close()
    assert READY_FAILURE_THRESHOLD == 3
    assert seen == [True, True, True, True, True, True, False, True, False]
