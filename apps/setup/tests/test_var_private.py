"""``var/`` is private: files 0600, directories 0700, for what the launcher and its children write and for
what an earlier run left (issue 19: ``var/ferry.sqlite3`` and its WAL were 0644 and held API tokens)."""

import grp
import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from apps.core.private_files import tighten_tree
from apps.setup.embedded_postgresql import start_embedded_postgres
from apps.setup.procfile import launcher_tokens
from apps.setup.run import var_dir_make_private


def _mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))


@pytest.fixture
def restore_umask():
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


def test_launcher_closes_an_old_var_and_everything_created_after_is_private(tmp_path, restore_umask):
    os.umask(0o022)  # an old var/ made under the common umask (an earlier test may have left 0077)
    var = tmp_path / "var"
    (var / "agent").mkdir(parents=True, mode=0o755)
    (var / "agent").chmod(0o755)
    (var / "ferry.sqlite3").write_text("tokens")
    (var / "ferry.sqlite3").chmod(0o644)
    (var / "agent" / "processes.json").write_text("{}")
    (var / "agent" / "processes.json").chmod(0o664)
    (var / "postgres-build").mkdir(mode=0o755)  # binaries the server user executes: left open
    var.chmod(0o755)
    assert var_dir_make_private(var) == 3
    assert [_mode(var), _mode(var / "log"), _mode(var / "agent"), _mode(var / "ferry.sqlite3"),
            _mode(var / "agent" / "processes.json"), _mode(var / "postgres-build")] == [
        "0o700", "0o700", "0o700", "0o600", "0o600", "0o755"]
    # the umask the children inherit: whatever a worker, Redis or the launcher writes next is private
    launcher_tokens(var, {})
    (var / "Procfile").write_text("web: true\n")
    (var / "log" / "web.log").write_text("GET /\n")
    (var / "load").mkdir()
    assert [_mode(var / "launcher_tokens.json"), _mode(var / "Procfile"), _mode(var / "log" / "web.log"),
            _mode(var / "load")] == ["0o600", "0o600", "0o600", "0o700"]
    assert tighten_tree(var) == []


def test_embedded_postgresql_in_a_private_var_starts_and_its_log_is_0600(restore_umask):
    """A 0700 var/: as root the server user gets search (not read) through its group, mode 0710."""
    top = Path(tempfile.mkdtemp(prefix="ferry-var-test-")).resolve()
    top.chmod(0o711)
    var = top / "var"
    var.mkdir(mode=0o700)
    os.umask(0o022)  # the log must be 0600 whatever the umask
    try:
        server = start_embedded_postgres(var / "postgres", throwaway=True)
        try:
            assert _mode(var / "postgres") == "0o700"
            assert _mode(var / "postgres.log") == "0o600"
            if os.geteuid() == 0:
                nobody = pwd.getpwnam("nobody")
                assert (_mode(var), grp.getgrgid(var.stat().st_gid).gr_gid) == ("0o710", nobody.pw_gid)
            else:
                assert _mode(var) == "0o700"
        finally:
            assert server.stop() == 0
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_django_process_starting_keeps_the_var_dir_the_embedded_postgresql_was_opened_to(tmp_path):
    """Every web/worker/beat process imports the settings: they must not close var/ again after the embedded
    PostgreSQL (run as an unprivileged user under root) was given search on it, or that server PANICs at its next
    checkpoint ("could not open .../global/pg_control: Permission denied") and the whole stack stops. A var/ that
    does not exist yet is still created 0700."""
    import subprocess
    import sys

    opened = tmp_path / "opened"
    opened.mkdir()
    opened.chmod(0o710)
    missing = tmp_path / "missing"
    code = "import controlplane.settings"
    for var in (opened, missing):
        env = {**os.environ, "FERRY_VAR_DIR": str(var), "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[3],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert [_mode(opened), _mode(missing)] == ["0o710", "0o700"]
