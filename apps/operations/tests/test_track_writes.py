"""One road for desired state (issue 15): ``PoolTrack`` rows are written only in ``apps/operations/tracks.py``.

Every product module under ``apps/`` is parsed with :mod:`ast` (tests and migrations are skipped). A write is a
call of a write method on a *track expression*:

* a query on tracks: rooted at ``PoolTrack`` (``PoolTrack.objects.filter(...)``) or at a ``.tracks`` related
  manager (``pool.tracks.filter(...)``), through any chain of calls, subscripts and ``list()``/``sorted()``;
* a call of a function of the same module whose return annotation names ``PoolTrack``;
* a list comprehension or generator that yields the items of a track expression (``[t for t in tracks if ...]``);
* a name bound from a track expression in the same function (``track = pool.tracks.get(...)``,
  ``for t in tracks``), or a parameter annotated with ``PoolTrack``.

Write methods: ``save``, ``delete``, ``update``, ``create``, ``get_or_create``, ``update_or_create``,
``bulk_create``, ``bulk_update``, ``add``, ``remove``, ``clear``, ``set``. An attribute of a track is not a track
(``track.pool.save()`` saves a pool). Not seen: a cascade (deleting a pool deletes its tracks; its
``pool.delete`` Action tears them down) and writes through ``getattr`` or raw SQL.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
OWNER = "apps/operations/tracks.py"
WRITE_METHODS = {"save", "delete", "update", "create", "get_or_create", "update_or_create", "bulk_create",
                 "bulk_update", "add", "remove", "clear", "set"}
NOT_TRACKS = {"values", "values_list", "count", "exists", "aggregate", "annotate"}
"""Query methods whose result is no longer track rows."""
ALLOWLIST = {
    ("apps/fleet/services.py", "pool_create"):
        "a new pool's first stable track is written with the pool row in one transaction, before any backend "
        "knows the pool (fleet cannot call operations); reconcile's pool.apply Action brings it up",
}
"""(file, function) -> reason; writes there are allowed."""


class _Finder(ast.NodeVisitor):
    """Collects ``(line, function, code)`` of track writes in one module."""

    def __init__(self, source: str, returning_tracks: set[str]) -> None:
        self.source = source
        self.returning_tracks = returning_tracks
        self.writes: list[tuple[int, str, str]] = []
        self.function = "<module>"
        self.tainted: set[str] = set()

    def is_tracks(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "PoolTrack" or node.id in self.tainted
        if isinstance(node, ast.Attribute):
            return node.attr == "tracks" or (node.attr == "objects" and self.is_tracks(node.value))
        if isinstance(node, ast.Subscript):
            return self.is_tracks(node.value)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                return node.func.attr not in NOT_TRACKS | WRITE_METHODS and self.is_tracks(node.func.value)
            if isinstance(node.func, ast.Name) and node.func.id in {"list", "sorted", "reversed", "tuple"}:
                return bool(node.args) and self.is_tracks(node.args[0])
            return isinstance(node.func, ast.Name) and node.func.id in self.returning_tracks
        if isinstance(node, ast.ListComp | ast.GeneratorExp):
            first = node.generators[0]
            return (isinstance(node.elt, ast.Name) and isinstance(first.target, ast.Name)
                    and node.elt.id == first.target.id and self.is_tracks(first.iter))
        return False

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if self.is_tracks(value):
            self.tainted.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))

    def _scan(self, body: ast.AST) -> None:
        for _ in range(2):  # bindings may come after their first use in a loop: reach a fixpoint
            for node in ast.walk(body):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        self._bind(target, node.value)
                elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
                    self._bind(node.target, node.value)
                elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                    self._bind(node.target, node.iter)
                elif isinstance(node, ast.arg) and node.annotation is not None and "PoolTrack" in ast.unparse(
                        node.annotation):
                    self.tainted.add(node.arg)
        for node in ast.walk(body):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in WRITE_METHODS and self.is_tracks(node.func.value)):
                self.writes.append((node.lineno, self.function, ast.get_source_segment(self.source, node) or ""))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer, tainted = self.function, self.tainted
        if outer == "<module>":  # nested functions are scanned with their outer one
            self.function, self.tainted = node.name, set()
            self._scan(node)
        self.function, self.tainted = outer, tainted

    visit_AsyncFunctionDef = visit_FunctionDef


def track_writes(source: str) -> list[tuple[int, str, str]]:
    """``(line, function, code)`` of every PoolTrack write in ``source`` (module docstring), by line."""
    tree = ast.parse(source)
    returning = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                 and f.returns is not None and "PoolTrack" in ast.unparse(f.returns)}
    finder = _Finder(source, returning)
    finder.visit(tree)
    module_level = ast.Module(body=[s for s in tree.body if not isinstance(
        s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)], type_ignores=[])
    finder._scan(module_level)
    return sorted(set(finder.writes))


def test_pool_tracks_are_written_only_in_operations_tracks():
    found = {}
    for path in sorted((ROOT / "apps").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "/tests/" in rel or "/migrations/" in rel or rel == OWNER:
            continue
        for line, function, code in track_writes(path.read_text()):
            if (rel, function) not in ALLOWLIST:
                found[f"{rel}:{line}"] = f"{function}: {code}"
    assert found == {}, "PoolTrack rows are written outside apps/operations/tracks.py (go through its services)"


def test_the_owner_and_the_allowlisted_pool_create_do_write_tracks():
    """The finder sees the real writes (so the empty result above means something)."""
    owner = [(function, code.split("(")[0]) for _, function, code in track_writes((ROOT / OWNER).read_text())]
    assert owner == [("pool_track_create", "PoolTrack.objects.create"), ("pool_track_set", "track.save"),
                     ("pool_track_delete", "track.delete")]
    fleet = track_writes((ROOT / "apps/fleet/services.py").read_text())
    assert [(function, code.split("(")[0]) for _, function, code in fleet] == [
        ("pool_create", "PoolTrack.objects.create")]


@pytest.mark.parametrize(("source", "expected"), [
    ("def f(pool):\n    pool.tracks.filter(name='stable').update(weight=1)\n",
     [(2, "f", "pool.tracks.filter(name='stable').update(weight=1)")]),
    ("def f(pool):\n    for t in list(pool.tracks.all()):\n        t.replicas = 0\n        t.save()\n",
     [(4, "f", "t.save()")]),
    ("def f(view, name):\n    view.tracks[name].delete()\n", [(2, "f", "view.tracks[name].delete()")]),
    ("def f(track: PoolTrack):\n    track.save(update_fields=['weight'])\n",
     [(2, "f", "track.save(update_fields=['weight'])")]),
    ("def f():\n    qs = PoolTrack.objects.select_for_update()\n    qs.bulk_update([], ['weight'])\n",
     [(3, "f", "qs.bulk_update([], ['weight'])")]),
    # the pre-issue-15 pool.scale handler: rows from a helper, filtered by a comprehension, saved in a loop
    ("def _tracks(pool) -> list[PoolTrack]:\n    return list(pool.tracks.order_by('name'))\n\n\n"
     "def handler(pool, split):\n    tracks = _tracks(pool)\n"
     "    changed = [t for t in tracks if t.replicas != split[t.name]]\n    for track in changed:\n"
     "        track.save(update_fields=['replicas'])\n",
     [(9, "handler", "track.save(update_fields=['replicas'])")]),
    ("PoolTrack.objects.get_or_create(name='x')\n", [(1, "<module>", "PoolTrack.objects.get_or_create(name='x')")]),
    # not writes: reads, a pool reached through a track, an observed state's tracks, another model
    ("def f(pool):\n    n = pool.tracks.filter(active=True).count()\n    return [t.name for t in pool.tracks.all()]\n",
     []),
    ("def f(pool):\n    track = pool.tracks.get(name='stable')\n    track.pool.save()\n", []),
    ("def f(observed):\n    names = sorted(observed.tracks)\n    return observed.tracks.get('x')\n", []),
    ("def f(pool):\n    pool.save()\n    Replica.objects.filter(pool=pool).delete()\n", []),
])
def test_the_finder_on_synthetic_modules(source, expected):
    assert track_writes(source) == expected
