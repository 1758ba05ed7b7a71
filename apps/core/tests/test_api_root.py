"""``GET /api/v1/``, where the ready banner points: the schema, the docs and the collections; refused anonymously."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


def test_the_api_root_links_the_schema_docs_and_collections(viewer_api):
    r = viewer_api.get("/api/v1/")
    assert r.status_code == 200
    body = r.json()
    assert body["schema"] == "http://testserver/api/v1/schema/" and body["docs"] == "http://testserver/api/v1/docs/"
    assert body["collections"]["pool"] == "http://testserver/api/v1/pools/"
    assert body["collections"]["plan"] == "http://testserver/api/v1/plans/"
    assert all(url.startswith("http://testserver/api/v1/") for url in body["collections"].values())
    # every collection it names exists: it answers the viewer, or refuses the viewer's role by name (client keys)
    for url in body["collections"].values():
        answer = viewer_api.get(url)
        assert answer.status_code == 200 or (answer.status_code == 403 and "role" in answer.json()["detail"]), url


def test_the_api_root_needs_credentials():
    r = APIClient().get("/api/v1/")
    assert r.status_code in (401, 403) and "credentials" in r.json()["detail"]
