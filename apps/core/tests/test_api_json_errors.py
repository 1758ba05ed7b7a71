"""Under /api/ a request that reaches no view answers JSON in DRF's shape, not Django's HTML page
(:mod:`apps.core.middleware`); the dashboard's paths keep HTML.

Before, ``GET /api/v1/nope/`` answered Django's HTML 404 (under ``DEBUG``, as ``make run`` sets it, the technical
404 page, which ``handler404`` never sees), and ``POST /api/v1/pools`` (no trailing slash) a 301 that clients
follow as a GET, dropping the body (under ``DEBUG``: a 500).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

ROOT_HINT = "GET /api/v1/ lists the API's collections."


@pytest.fixture(params=[False, True], ids=["production", "debug"])
def debug(request, settings):
    settings.DEBUG = request.param
    return request.param


@pytest.mark.parametrize("method", ["get", "post", "put", "patch", "delete"])
@pytest.mark.parametrize("path", ["/api/v1/nope/", "/api/v1/pools/1/nope/", "/api/nope/", "/api/v2/pools/"])
def test_an_unknown_api_path_is_a_json_404_in_drfs_shape(admin_api, debug, method, path):
    r = getattr(admin_api, method)(path, {"name": "x"}, format="json")
    assert (r.status_code, r["Content-Type"]) == (404, "application/json")
    assert r.json() == {"detail": f"Not found: no API endpoint at {path}. {ROOT_HINT}"}


def test_an_unknown_api_path_is_json_for_anonymous_and_browser_clients_too(client, debug):
    r = client.get("/api/v1/nope/", HTTP_ACCEPT="text/html")
    assert (r.status_code, r["Content-Type"], r.json()["detail"]) == (
        404, "application/json", f"Not found: no API endpoint at /api/v1/nope/. {ROOT_HINT}")


def test_an_unknown_dashboard_path_keeps_djangos_html_page(admin_api, debug):
    r = admin_api.get("/nope/")
    assert r.status_code == 404
    assert r["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_a_write_to_an_api_path_without_its_slash_is_a_404_naming_the_path_not_a_redirect(admin_api, debug, method):
    r = getattr(admin_api, method)("/api/v1/pools", {"name": "x"}, format="json")
    assert (r.status_code, r["Content-Type"]) == (404, "application/json")
    assert r.json() == {"detail": f"Not found: no API endpoint at /api/v1/pools. API paths end with a slash: send "
                                  f"the {method.upper()} to /api/v1/pools/ (a redirect would turn it into a GET and "
                                  "drop its body)."}


def test_a_read_without_the_slash_still_redirects_to_the_slash_path(admin_api):
    r = admin_api.get("/api/v1/pools")
    assert (r.status_code, r["Location"]) == (301, "/api/v1/pools/")


def test_a_known_api_path_with_a_method_it_does_not_take_is_drfs_json_405(admin_api, debug):
    r = admin_api.delete("/api/v1/rollouts/validate/")
    assert (r.status_code, r.json(), r["Allow"]) == (405, {"detail": 'Method "DELETE" not allowed.'}, "POST, OPTIONS")
    r = admin_api.put("/api/v1/", {}, format="json")
    assert (r.status_code, r.json()) == (405, {"detail": 'Method "PUT" not allowed.'})


def test_drfs_own_errors_pass_unchanged(admin_api, viewer_api, debug):
    r = admin_api.get("/api/v1/pools/999999/")
    assert (r.status_code, r.json()) == (404, {"detail": "No Pool matches the given query."})
    r = viewer_api.post("/api/v1/clusters/", {}, format="json")
    assert r.status_code == 403 and r["Content-Type"] == "application/json"
