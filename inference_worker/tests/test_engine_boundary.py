"""The engine's boundary (issue 16, acceptance 4): nothing outside ``inference_worker/engine/`` reaches into
engine, scheduler or runner private state, and the torch-free core imports with torch blocked.

The walk is static (``ast``): every module of the repository outside ``inference_worker/engine/``
(product code, tests, benches, the Django apps) is parsed, and the test fails on an attribute access
``x.NAME`` where NAME is a private attribute or method defined by a class in the engine package and
``x`` is not ``self``/``cls``, and on reads of the scheduler's queues and request table
(``.scheduler.waiting|running|requests``) or the runner's request states (``.runner.requests``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "inference_worker" / "engine"
SCANNED = [REPO / "inference_worker", REPO / "bench", REPO / "apps", REPO / "controlplane"]
PUBLIC_STATE_OF = {"scheduler": {"waiting", "running", "requests"}, "runner": {"requests"}}

TORCH_FREE_CORE = [
    "inference_worker.engine.block_hash",
    "inference_worker.engine.block_pool",
    "inference_worker.engine.kv_cache_manager",
    "inference_worker.engine.kv_cache_sizing",
    "inference_worker.engine.kv_connector",
    "inference_worker.engine.kv_events",
    "inference_worker.engine.request",
    "inference_worker.engine.sched_output",
    "inference_worker.engine.scheduler",
    "inference_worker.engine.single_type_kv_cache_manager",
]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def engine_private_names() -> set[str]:
    """Private attributes (``self._x = ...``) and methods (``def _x``) of every class in the engine package."""
    names = set()
    for path in ENGINE.glob("*.py"):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(node.name):
                    names.add(node.name)
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self" and _is_private(node.attr)):
                    names.add(node.attr)
    return names


def violations(source: str, private: set[str]) -> list[tuple[int, str]]:
    """``(line, expression)`` of each access to engine internals in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        own = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (  # a subclass's own methods
            isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super")
        if node.attr in private and not own:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(owner, ast.Attribute) and node.attr in PUBLIC_STATE_OF.get(owner.attr, ()):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_engine_private_names_are_collected():
    private = engine_private_names()
    assert {"_finish", "_insert_sorted", "_preempt", "_update_states", "_seqs", "_output"} <= private


def test_the_checker_flags_what_kv_handoff_used_to_do():
    old = ("engine._seqs[rid]\nscheduler._insert_sorted(scheduler.running, r)\nengine.core.scheduler.waiting.remove(r)\n"
           "core.runner.requests[rid] = state\nself._seqs = {}\n")
    assert sorted(line for line, _ in violations(old, engine_private_names())) == [1, 2, 3, 4]
    # a subclass overriding a private method may call the parent's (super()._read), another object's may not
    assert [line for line, _ in violations("super()._read(k)\nstore._read(k)\n", {"_read"})] == [2]


def test_no_module_outside_the_engine_touches_engine_internals():
    private = engine_private_names()
    offenders = []
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            if ENGINE in path.parents or ".venv" in path.parts:
                continue
            offenders += [f"{path.relative_to(REPO)}:{line}: {expr}" for line, expr in violations(path.read_text(), private)]
    assert offenders == []


def test_the_torch_free_core_imports_with_torch_blocked():
    code = ("import sys\nsys.modules['torch'] = None\n"  # any 'import torch' now raises ImportError
            + "".join(f"import {module}\n" for module in TORCH_FREE_CORE)
            + "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None and m.startswith('torch')]\n"
            + "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
