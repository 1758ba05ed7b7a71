"""``python -m inference_worker agent``: the local agent that owns worker processes on this host.

Example::

    python -m inference_worker agent --host 127.0.0.1 --port 8100 --token "$FERRY_AGENT_TOKEN" \\
        --state-dir var/agent

The token may also come from the ``FERRY_AGENT_TOKEN`` environment variable (keeps it out of
``ps``). Behaviour on exit:

* SIGTERM or Ctrl-C: every worker is drained (SIGTERM to its process group, up to its drain
  timeout, then SIGKILL) before the agent exits. With ``--detach-on-exit`` the workers are left
  running instead (for upgrading the agent itself). The agent then exits by re-raising the signal
  (uvicorn's behaviour), so its status is "killed by SIGTERM" after a clean shutdown.
* SIGKILL or a crash: workers keep running (each is in its own session). A new agent started
  with the same ``--state-dir`` reads ``agent.json`` and re-adopts every worker whose pid still
  runs the recorded command line; the others are listed as not alive.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the ``agent`` options on ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="listen address (keep it on loopback or a private net)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", default=None,
                        help="bearer token clients must send (default: $FERRY_AGENT_TOKEN); >= 16 characters")
    parser.add_argument("--state-dir", default="var/agent", type=Path,
                        help="process table (agent.json) and worker logs (logs/<name>.log)")
    parser.add_argument("--ready-poll", type=float, default=1.0, metavar="S",
                        help="seconds between /ready polls of each worker")
    parser.add_argument("--detach-on-exit", action="store_true",
                        help="leave workers running when the agent exits (a new agent re-adopts them)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    """Serve the agent API until SIGTERM/SIGINT; returns the exit status.

    Raises:
        ValueError: no token, a token shorter than 16 characters, or a port outside 1..65535.
    """
    import uvicorn

    from inference_worker.agent.app import create_app
    from inference_worker.agent.processes import ProcessManager

    token = args.token or os.environ.get("FERRY_AGENT_TOKEN", "")
    if len(token) < 16:
        raise ValueError("--token (or FERRY_AGENT_TOKEN) must be set to at least 16 characters")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    manager = ProcessManager(args.state_dir, ready_poll_s=args.ready_poll)
    app = create_app(manager, token, stop_workers_on_exit=not args.detach_on_exit)
    # loop/http pinned: uvloop and httptools are installed for the web and the router; the agent keeps the stack it was tested on
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, loop="asyncio", http="h11")
    uvicorn.Server(config).run()
    return 0

