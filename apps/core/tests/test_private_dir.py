"""``private_dir`` closes ``var/`` to 0700 but keeps the embedded PostgreSQL's search-only opening (0710, the
server user's group): every Django process runs it at start, and closing that under a running root-started
PostgreSQL made the server PANIC at its first timed checkpoint (the chaos bench's database died 5 minutes in)."""

import os
import pwd
import stat

import pytest

from apps.core.private_files import private_dir


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_open_directory_of_our_group_is_closed_to_0700_and_a_new_one_is_made_0700(tmp_path):
    old = tmp_path / "var"
    old.mkdir()
    old.chmod(0o755)
    private_dir(old)
    private_dir(tmp_path / "new" / "var")
    assert (_mode(old), _mode(tmp_path / "new" / "var")) == (0o700, 0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user's group")
def test_the_postgresql_server_users_search_bit_survives_and_its_read_and_other_bits_do_not(tmp_path):
    nobody = pwd.getpwnam("nobody")
    opened, wider = tmp_path / "opened", tmp_path / "wider"
    for path, mode in ((opened, 0o710), (wider, 0o755)):
        path.mkdir()
        os.chown(path, -1, nobody.pw_gid)
        path.chmod(mode)
    private_dir(opened)
    private_dir(wider)
    assert (_mode(opened), _mode(wider)) == (0o710, 0o710)
    assert opened.stat().st_gid == nobody.pw_gid
