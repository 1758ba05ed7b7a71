"""The router never runs open by accident: client keys from --api-keys or FERRY_ROUTER_API_KEY, or an explicit
--no-auth (issue 19: ``make run`` configured no API keys)."""

import argparse
import json

import pytest

from inference_worker.cli.router import add_arguments, client_keys


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--port", "8080", "--routing-table", "t.json", *argv])


def test_a_router_without_keys_or_no_auth_refuses_to_start():
    with pytest.raises(ValueError, match="the router needs client keys: --api-keys FILE or FERRY_ROUTER_API_KEY"):
        client_keys(_args(), {})
    assert client_keys(_args("--no-auth"), {}) is None


def test_keys_come_from_the_file_or_the_environment(tmp_path):
    keys = client_keys(_args(), {"FERRY_ROUTER_API_KEY": "k-env"})
    assert keys.authenticate("Bearer k-env").name == "FERRY_ROUTER_API_KEY"
    assert keys.authenticate("Bearer k-other") is None and keys.authenticate(None) is None
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "team", "key": "k-file"}]}))
    keys = client_keys(_args("--api-keys", str(path), "--no-auth"), {"FERRY_ROUTER_API_KEY": "k-env"})
    assert keys.authenticate("Bearer k-file").name == "team" and keys.authenticate("Bearer k-env") is None


def test_a_router_of_a_control_plane_starts_without_keys_of_its_own_and_takes_the_tables():
    """Issue 19: keys managed in the control plane arrive in the routing table, so a router pulling the table from
    a URL needs no file; it still accepts no client until a table brings keys (never open)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--port", "8080", "--routing-table", "http://cp:8000/api/v1/routing-table/"]
    keys = client_keys(parser.parse_args(argv), {})
    assert keys is not None and keys.keys == [] and keys.authenticate("Bearer anything") is None
    assert client_keys(parser.parse_args([*argv, "--no-auth"]), {}) is None
