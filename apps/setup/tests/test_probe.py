"""``manage.py ferry_probe``: the exec probe of beat and the telemetry poller on Kubernetes."""

import socket
from io import StringIO

import pytest
from django.core.management import CommandError, call_command


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.django_db
def test_ferry_probe_passes_when_both_answer_and_fails_naming_what_is_down(settings):
    out = StringIO()
    call_command("ferry_probe", stdout=out)
    assert out.getvalue() == "database ok; redis ok\n"
    settings.REDIS_URL = f"redis://127.0.0.1:{_closed_port()}/0"
    with pytest.raises(CommandError, match=r"^redis down: ConnectionError$"):
        call_command("ferry_probe")
