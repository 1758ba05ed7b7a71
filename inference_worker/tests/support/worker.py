"""Helpers for tests that need a real worker process or the real Gemma tokenizer.

:class:`WorkerProcess` starts ``python -m inference_worker serve`` on a free loopback port and
waits until ``/ready`` says ready; the router, rollout and agent tests reuse it. Nothing here
is used when serving.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gemma_tokenizer_dir() -> Path:
    """Directory with Gemma 3 270M's ``tokenizer.json`` (prepared once; built from the GGUF if missing)."""
    from inference_worker.registry import gguf_path, model_cache_dir

    prepared = model_cache_dir() / "gemma-3-270m"
    if (prepared / "tokenizer.json").is_file():
        return prepared
    built = REPO_ROOT / "var" / "tokenizers" / "gemma-3-270m"
    if not (built / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        gguf = gguf_path("gemma-3-270m")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(built))
    return built


class WorkerProcess:
    """A ``python -m inference_worker serve`` child process on a free port.

    Args:
        args: extra CLI arguments (``--max-num-seqs 1``, ``--drain-timeout 30``, ...).
        model: the ``--model`` value.
        ready_timeout_s: how long :meth:`start` waits for ``/ready``.
        env: extra environment variables of the process (e.g. a test hook's switch).
        port: the HTTP port (None: a free one).

    Raises:
        RuntimeError: from :meth:`start` when the process exits or is not ready in time.
    """

    def __init__(self, *args: str, model: str = "gemma-3-270m", ready_timeout_s: float = 300.0,
                 env: dict[str, str] | None = None, port: int | None = None):
        self.port = free_port() if port is None else port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "inference_worker", "serve", "--model", model, "--host", "127.0.0.1",
                     "--port", str(self.port), *args]
        self.ready_timeout_s = ready_timeout_s
        self.env = dict(env or {})
        self.log_path = REPO_ROOT / "var" / "test-logs" / f"worker-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        """:meth:`launch`, then :meth:`wait_ready`."""
        return self.launch().wait_ready()

    def launch(self) -> WorkerProcess:
        """Start the process without waiting (see :func:`start_together`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TORCH_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self) -> WorkerProcess:
        """Poll ``/ready`` until 200; stops the process and raises RuntimeError on exit or timeout."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a /ready answer is cheap next to the model load it waits for
        self.stop()
        raise RuntimeError(f"worker not ready after {self.ready_timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        """The end of the worker's combined stdout/stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """Send SIGTERM (starts the drain)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        """Wait for exit and return the exit status."""
        return self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_together(*workers: WorkerProcess) -> tuple[WorkerProcess, ...]:
    """Launch every worker, then wait for each to be ready: the start-ups (imports, weight loads) overlap.

    Raises:
        RuntimeError: a worker exited or was not ready in time; every worker given is stopped first.
    """
    try:
        for worker in workers:
            worker.launch()
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers
