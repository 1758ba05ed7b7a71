"""Ferry's state directory (``var/``) is private to the user that runs Ferry.

It holds secrets (``secret_key``, ``launcher_tokens.json``), the embedded PostgreSQL data, logs that quote
requests, and the agent's process table. Rule: every file under it is created 0600 and every directory 0700.

- The launcher sets the process umask to :data:`PRIVATE_UMASK` before it creates anything; every child
  (web, Celery, agent, workers, router, Redis, PostgreSQL) inherits it, so whatever they write under
  ``var/`` is private without each writer having to remember.
- :func:`private_dir` creates (or closes) a directory 0700; :func:`tighten_tree` removes group and other
  bits from what an earlier run left (a ``var/`` from before this rule had 0644 files).
- Exception, made visibly in :mod:`apps.setup.embedded_postgresql`: a PostgreSQL started by root runs as
  an unprivileged user, who must traverse ``var/`` to reach its data directory; ``var/`` is then 0710 with
  that user's group (search only, no listing), and the copied server binaries (``postgres-build``) stay
  0755. The data directory itself is 0700 and owned by the server user (PostgreSQL requires it).

This module imports nothing from Django so ``controlplane.settings`` can use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PRIVATE_UMASK = 0o077
# Subtrees tighten_tree leaves alone: binaries another user must execute.
SHARED_SUBTREES = frozenset({"postgres-build"})


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700, or close an existing one we own to 0700.

    One opening is kept: a directory we own whose group is not ours and whose group bits are search only
    (0710, :mod:`apps.setup.embedded_postgresql`'s opening of ``var/`` to the server user a root-started
    PostgreSQL runs as) stays 0710. Every Django process calls this on ``var/`` at start
    (``controlplane.settings``): closing it to 0700 under a running PostgreSQL made the server's first timed
    checkpoint (5 minutes in) fail to open ``global/pg_control`` and PANIC, taking the database down.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid():
        return path
    keep = 0o700 | (0o010 if st.st_gid != os.getegid() else 0)
    if st.st_mode & 0o077 & ~keep:
        path.chmod(st.st_mode & keep)
    return path


def tighten_tree(root: Path, *, skip: Iterable[str] = SHARED_SUBTREES) -> list[Path]:
    """Remove group/other permission bits from every file and directory under ``root`` that we own.

    The root itself is left to the caller (:func:`private_dir`, or 0710 for a root-started PostgreSQL).
    Entries owned by someone else (the embedded PostgreSQL's data directory when root started it) and the
    subtrees named in ``skip`` are left alone; symlinks are not followed. Returns the paths changed.
    """
    changed: list[Path] = []
    euid = os.geteuid()
    skip = set(skip)
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in skip]
        for name in [*dirnames, *filenames]:
            path = Path(directory) / name
            st = path.lstat()
            if path.is_symlink() or st.st_uid != euid or not st.st_mode & 0o077:
                continue
            path.chmod(st.st_mode & 0o7700)
            changed.append(path)
    return changed


def open_private(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """``os.open`` with mode 0600 (whatever the umask); returns the file descriptor."""
    return os.open(path, flags, 0o600)
