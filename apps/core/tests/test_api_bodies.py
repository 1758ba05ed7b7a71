"""Malformed request bodies on the API answer 400 JSON, never a 500: a body nested deeper than Python's JSON
parser recurses (any endpoint that reads a body; client keys and rollout validation stand for them all)."""

from __future__ import annotations

import io

import pytest

from apps.accounts.models import ClientApiKey
from apps.core.parsers import SafeJSONParser

pytestmark = pytest.mark.django_db

NESTED = {"detail": "JSON parse error - the body nests too deeply (a request body nests a few levels at most)."}


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, '{"name": "k", "allowed_models": ' + "[" * 5000 + "]" * 5000 + "}"])
def test_a_too_deeply_nested_body_is_a_400_and_creates_nothing(admin_api, body):
    for url in ("/api/v1/client-keys/", "/api/v1/rollouts/validate/"):
        r = admin_api.generic("POST", url, body, content_type="application/json")
        assert (r.status_code, r.json()) == (400, NESTED)
    assert ClientApiKey.objects.count() == 0


def test_a_body_over_the_upload_limit_is_a_413_json_answer_not_an_html_page(admin_api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    r = admin_api.generic("POST", "/api/v1/client-keys/", '{"name": "' + "a" * 1000 + '"}',
                          content_type="application/json")
    assert (r.status_code, r.json()) == (413, {"detail": "The request body is larger than 1000 bytes."})
    assert ClientApiKey.objects.count() == 0


@pytest.mark.parametrize(("body", "escape"), [('{"name": "k", "\\ud800": 1}', "\\ud800"),
                                             ('{"name": "k\\udfff"}', "\\udfff"),
                                             ('{"name": "k", "allowed_models": ["\\ude80\\ud83d"]}', "\\ude80")])
def test_a_lone_surrogate_escape_is_a_400_naming_it_and_creates_nothing(admin_api, body, escape):
    """Regression: as a field name it was a 500 text/plain on every write endpoint (the 400 naming the unknown field
    could not be encoded); a value would fail at the database. A pair in the right order is a character."""
    r = admin_api.generic("POST", "/api/v1/client-keys/", body, content_type="application/json")
    assert (r.status_code, r.json()) == (400, {"detail": f"JSON parse error - the body has a lone UTF-16 surrogate "
                                                         f"({escape} escape without its pair): not valid Unicode."})
    assert ClientApiKey.objects.count() == 0
    parsed = SafeJSONParser().parse(io.BytesIO(b'{"name": "k\\ud83d\\ude80"}'), "application/json")
    assert parsed == {"name": "k\U0001f680"}
