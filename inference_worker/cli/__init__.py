"""The ``python -m inference_worker`` command line: a registry of subcommand modules.

Every module in this package (other than private ``_*`` ones) is a subcommand if it defines:

* the module name is the subcommand word (``models.py`` -> ``models``); an optional ``NAME`` must equal it;
* ``HELP`` (optional, default: the first line of the module docstring): one line for ``--help``;
* ``add_arguments(parser: argparse.ArgumentParser) -> None``;
* ``run(args: argparse.Namespace) -> int``: the exit status.

Adding a subcommand is adding one module here; nothing else is edited. Only the chosen subcommand's module
is imported (``--help`` without a subcommand imports them all), so one subcommand's heavy imports do not
slow down another.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType


def command_names() -> list[str]:
    """Names of the subcommand modules in this package, without importing them."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def discover(names: Sequence[str] | None = None) -> dict[str, ModuleType]:
    """Subcommand name -> module for ``names`` (default: all), skipping modules without ``add_arguments``/``run``.

    Raises:
        RuntimeError: a module's ``NAME`` differs from its module name.
    """
    commands: dict[str, ModuleType] = {}
    for name in names if names is not None else command_names():
        module = importlib.import_module(f"{__name__}.{name}")
        if getattr(module, "NAME", name) != name:
            raise RuntimeError(f"{module.__name__}.NAME is {module.NAME!r}; it must equal the module name {name!r}")
        if callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None)):
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
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = [argv[0]] if argv and argv[0] in command_names() else None
    args = build_parser(discover(chosen)).parse_args(argv)
    return int(args._run(args) or 0)
