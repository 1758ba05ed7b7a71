"""The ``python -m inference_worker`` command line: a registry of subcommand modules.

Every module in this package (other than private ``_*`` ones) is a subcommand if it defines:

* ``NAME`` (optional, default: the module name): the subcommand word (e.g. ``"models"``, ``"serve"``);
* ``HELP`` (optional, default: the first line of the module docstring): one line for ``--help``;
* ``add_arguments(parser: argparse.ArgumentParser) -> None``;
* ``run(args: argparse.Namespace) -> int``: the exit status.

Adding a subcommand is adding one module here; nothing else is edited. Modules are imported only to build
the parser, so they should import heavy dependencies (torch, fastapi) inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Sequence
from types import ModuleType


def discover() -> dict[str, ModuleType]:
    """Subcommand name -> module, for every conforming module of this package (sorted by name).

    Raises:
        RuntimeError: two modules claim the same ``NAME``.
    """
    commands: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        name = getattr(module, "NAME", info.name)
        if not (name and callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None))):
            continue
        if name in commands:
            raise RuntimeError(f"subcommand {name!r} is defined by both {commands[name].__name__} and {module.__name__}")
        commands[name] = module
    return commands


def build_parser(commands: dict[str, ModuleType] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per discovered subcommand."""
    commands = discover() if commands is None else commands
    parser = argparse.ArgumentParser(prog="python -m inference_worker",
                                     description="Ferry inference worker: models, serving, routing.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in commands.items():
        summary = getattr(module, "HELP", None) or (module.__doc__ or "").strip().splitlines()[0:1]
        summary = summary if isinstance(summary, str) else (summary[0] if summary else None)
        p = sub.add_parser(name, help=summary, description=module.__doc__ or summary,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns its exit status."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)
