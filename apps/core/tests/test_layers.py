"""The import-layer rule (``apps.LAYERS``): no module under ``apps/`` or ``controlplane/`` imports an app
of a higher layer, function-local imports included (issue 15, acceptance 1 and 2).

Every ``*.py`` file is parsed with :mod:`ast` (nothing is imported), so a cycle hidden in a function
body counts like a module-level import. A call of ``include``, ``import_module`` or ``import_string``
with a literal module path (``include("apps.x.urls")``) counts too; other strings (``INSTALLED_APPS``,
Celery task names) are not seen. ``apps/__init__.py`` and ``apps/conftest.py`` belong to no app and
are not checked. Migrations are skipped (Django writes them; they only name other apps' migrations).
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from apps import LAYERS, PROJECT

ROOT = Path(__file__).resolve().parents[3]
IMPORTING_CALLS = {"include", "import_module", "import_string"}

ALLOWLIST: tuple[tuple[str, str, str], ...] = (
    ("apps/*/tests/*", "controlplane",
     "tests start the real project: the ASGI application (controlplane.asgi) and the Celery app "
     "(controlplane.celery) to run the stack in-process or as a worker process; product code never does"),
)
"""(importing file glob, imported module prefix, reason); at most 3 entries, each with its reason."""


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str
    module: str

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: {self.importer} imports {self.module} "
                f"({self.imported} is in a higher layer)")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(root: Path, path: Path) -> Iterator[tuple[str, int]]:
    """``(absolute module name, line)`` of every import in ``path``, at any depth (function bodies too).

    Relative imports are resolved against the file's package; ``from apps import fleet`` names
    ``apps.fleet``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target in ("apps", PROJECT):
                for alias in node.names:
                    yield f"{target}.{alias.name}", node.lineno
            else:
                yield target, node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in IMPORTING_CALLS and isinstance(node.args[0].value, str):
                yield node.args[0].value.partition(":")[0], node.lineno


def _owner(module: str, apps: set[str]) -> str | None:
    parts = module.split(".")
    if parts[0] == PROJECT:
        return PROJECT
    if parts[0] == "apps" and len(parts) > 1 and parts[1] in apps:
        return parts[1]
    return None


def layer_violations(root: Path, layers: Sequence[Sequence[str]],
                     allowlist: Sequence[tuple[str, str, str]] = ()) -> list[Violation]:
    """Imports under ``root/apps`` and ``root/controlplane`` from an app of a higher layer than the importer's.

    ``layers``: app names, bottom layer first; the project package sits above the last layer. An import
    is allowed when the imported app's layer is at or below the importer's, or when an allowlist entry's
    glob matches the importing file (relative to ``root``) and the imported module starts with its prefix.

    Raises:
        ValueError: an app directory under ``root/apps`` that no layer names.
    """
    rank = {app: i for i, layer in enumerate(layers) for app in layer}
    rank[PROJECT] = len(layers)
    apps = {p.name for p in (root / "apps").iterdir() if (p / "__init__.py").exists()}
    if missing := sorted(apps - set(rank)):
        raise ValueError(f"apps not in any layer of apps.LAYERS: {missing}; add each to the layer it belongs to")
    found = []
    for path in sorted(p for d in ("apps", PROJECT) for p in (root / d).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        importer = _owner(_module_name(root, path), apps)
        if importer is None or "migrations" in path.parts:
            continue
        for module, line in imported_modules(root, path):
            imported = _owner(module, apps)
            if imported is None or rank[imported] <= rank[importer]:
                continue
            if any(fnmatch.fnmatch(rel, glob) and (module == prefix or module.startswith(prefix + "."))
                   for glob, prefix, _ in allowlist):
                continue
            found.append(Violation(rel, line, importer, imported, module))
    return found


def test_no_app_imports_an_app_of_a_higher_layer():
    violations = layer_violations(ROOT, LAYERS, ALLOWLIST)
    assert not violations, "imports from a higher layer (apps/__init__.py, LAYERS):\n" + "\n".join(
        map(str, violations))


def test_the_allowlist_is_short_and_every_entry_gives_its_reason():
    assert len(ALLOWLIST) <= 3
    assert all(len(reason.split()) >= 5 for _, _, reason in ALLOWLIST)


def test_every_app_is_in_exactly_one_layer():
    named = [app for layer in LAYERS for app in layer]
    on_disk = {p.name for p in (ROOT / "apps").iterdir() if (p / "__init__.py").exists()}
    assert sorted(named) == sorted(on_disk)


# The checker itself, on a synthetic tree: it must fail on an inverted import wherever the import sits.

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"apps/__init__.py": "", "apps/low/__init__.py": "", "apps/high/__init__.py": "",
                      "controlplane/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


SYNTHETIC_LAYERS = (("low",), ("high",))


def test_checker_accepts_downward_and_same_app_imports(tmp_path):
    root = _tree(tmp_path, {
        "apps/high/views.py": "from apps.low.models import Thing\nfrom apps.high import models\nimport django\n",
        "apps/low/models.py": "from . import helpers\nfrom apps.low.helpers import x\n",
        "controlplane/urls.py": "from apps.high.views import view\n",
    })
    assert layer_violations(root, SYNTHETIC_LAYERS) == []


@pytest.mark.parametrize(("source", "line", "module"), [
    ("from apps.high.services import go\n", 1, "apps.high.services"),
    ("import os\n\n\ndef f():\n    import apps.high.services\n", 5, "apps.high.services"),
    ("class A:\n    def m(self):\n        from apps.high import services\n", 3, "apps.high"),
    ("from ..high.services import go\n", 1, "apps.high.services"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from apps.high.models import H\n", 3,
     "apps.high.models"),
    ("def f():\n    from controlplane.celery import app\n", 2, "controlplane.celery"),
    ("from django.urls import include, path\nurls = [path('', include('apps.high.urls'))]\n", 2, "apps.high.urls"),
    ("import importlib\n\nmod = importlib.import_module('apps.high.tasks')\n", 3, "apps.high.tasks"),
])
def test_checker_fails_on_an_upward_import_naming_file_and_line(tmp_path, source, line, module):
    root = _tree(tmp_path, {"apps/low/models.py": source})
    [violation] = layer_violations(root, SYNTHETIC_LAYERS)
    assert (violation.path, violation.line, violation.module) == ("apps/low/models.py", line, module)
    assert str(violation).startswith(f"apps/low/models.py:{line}: low imports {module} ")


def test_checker_allowlist_matches_file_glob_and_module_prefix(tmp_path):
    root = _tree(tmp_path, {"apps/low/tests/test_x.py": "from apps.high.services import go\n",
                            "apps/low/models.py": "from apps.high.services import go\n",
                            "apps/low/other.py": "from apps.highway import x\n"})
    allow = (("apps/low/tests/*", "apps.high", "tests may start the higher app"),)
    assert [v.path for v in layer_violations(root, SYNTHETIC_LAYERS, allow)] == ["apps/low/models.py"]


def test_checker_refuses_an_app_no_layer_names(tmp_path):
    root = _tree(tmp_path, {"apps/stray/__init__.py": ""})
    with pytest.raises(ValueError, match=r"apps not in any layer of apps.LAYERS: \['stray'\]"):
        layer_violations(root, SYNTHETIC_LAYERS)
