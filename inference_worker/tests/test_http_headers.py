"""``inference_worker.http_headers`` is the only module that spells an ``X-Ferry-*`` header name.

Every Python file of the repository is parsed with ``ast``; a string constant containing the prefix
(any case) fails the test unless it is documentation (a docstring or another bare string statement).
"""

import ast
from pathlib import Path

from inference_worker import http_headers

REPO_ROOT = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {".venv", "var", "node_modules", "__pycache__", ".git"}


def header_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, value)`` of every non-documentation string constant in ``path`` that contains ``x-ferry-``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    documentation = {id(node.value) for node in ast.walk(tree)
                     if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                     and isinstance(node.value.value, str)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documentation
            and http_headers.PREFIX in node.value.lower()]


def python_files() -> list[Path]:
    return sorted(p for p in REPO_ROOT.rglob("*.py")
                  if not SKIPPED_DIRS.intersection(p.relative_to(REPO_ROOT).parts))


def test_header_names_share_the_prefix_and_are_lowercase_and_distinct():
    assert all(name.startswith(http_headers.PREFIX) and name == name.lower() for name in http_headers.ALL)
    assert len(set(http_headers.ALL)) == len(http_headers.ALL) == 11


def test_no_other_module_spells_a_ferry_header_name():
    module = Path(http_headers.__file__).resolve()
    files = [p for p in python_files() if p.resolve() != module]
    assert len(files) > 100  # the scan really covers the repository (apps, inference_worker, bench ...)
    found = {str(p.relative_to(REPO_ROOT)): hits for p in files if (hits := header_literals(p))}
    assert found == {}


def test_scan_flags_code_literals_and_ignores_documentation(tmp_path):
    # the probe's header names are assembled here so that this file itself spells none
    upper, lower = http_headers.PREFIX.title(), http_headers.PREFIX  # "X-Ferry-", "x-ferry-"
    probe = tmp_path / "probe.py"
    probe.write_text(f'"""Sends {upper}Track."""\n\n\ndef f(h):\n    """Reads {upper}Decision."""\n'
                     f'    "a note on {upper}Replica"\n    return h.get("{upper}Track"), f"{{h}}{lower}decision"\n')
    assert header_literals(probe) == [(7, f"{upper}Track"), (7, f"{lower}decision")]
