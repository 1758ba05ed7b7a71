"""The agent's persistent state: process records and track templates in one JSON file.

The file (``<state_dir>/agent.json``) is rewritten atomically (temp file + ``os.replace``) after
every change, so a crashed or SIGKILLed agent leaves a consistent table behind and the next agent
can re-adopt the workers that are still running (see ``processes.ProcessManager``).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class AgentError(Exception):
    """An error with the HTTP status the API answers with."""

    status_code = 400


class InvalidRequest(AgentError):
    """The request is not acceptable as given (bad name, args, env): HTTP 400."""

    status_code = 400


class ProcessNotFound(AgentError):
    """No process or template with that name: HTTP 404."""

    status_code = 404


class ProcessExists(AgentError):
    """A process with that name already exists or is being stopped: HTTP 409."""

    status_code = 409


@dataclass
class ProcessRecord:
    """One worker process the agent owns. Times are Unix seconds; ``cmdline`` is the exact argv."""

    name: str
    args: list[str]  # after "python -m inference_worker", without --port/--replica
    env: dict[str, str]
    labels: dict[str, str]
    drain_timeout_s: float
    port: int
    pid: int
    cmdline: list[str]
    log_path: str
    started_at: float
    restart_count: int = 0
    exit_code: int | None = None  # set once the process is seen dead (None if unknown, e.g. adopted)
    alive: bool = True
    ready: bool = False
    adopted: bool = False  # re-adopted from a previous agent: not our child, exit code unknowable
    stopping: bool = False
    exited_at: float | None = None  # when the agent first saw it dead (reconcile's restart backoff counts from it)
    termination_message: str = ""  # what the worker wrote to its termination message file before dying

    def public(self) -> dict[str, Any]:
        """The JSON the API returns for this process."""
        data = asdict(self)
        data["endpoint"] = f"http://127.0.0.1:{self.port}"
        return data


@dataclass
class AgentState:
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)


class StateStore:
    """Loads and atomically saves ``AgentState`` under ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / "agent.json"

    def load(self) -> AgentState:
        """Read the state file; a missing file is an empty state.

        Raises:
            ValueError: the file exists but is not a valid agent state (never silently dropped).
        """
        if not self.path.exists():
            return AgentState()
        try:
            raw = json.loads(self.path.read_text())
            processes = {p["name"]: ProcessRecord(**p) for p in raw.get("processes", [])}
            return AgentState(processes=processes, templates=dict(raw.get("templates", {})))
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise ValueError(f"agent state file {self.path} is corrupt: {exc}; move it away to start empty") from exc

    def save(self, state: AgentState) -> None:
        doc = {
            "processes": [asdict(record) for record in state.processes.values()],
            "templates": state.templates,
        }
        fd, tmp = tempfile.mkstemp(dir=self.state_dir, prefix=".agent.", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
