"""An API request that finds no pooled database connection in time is answered 503 with Retry-After, not 500."""

import psycopg_pool
import pytest
from django.db import OperationalError

from apps.fleet import selectors


def _pool_timeout():
    try:
        raise psycopg_pool.PoolTimeout("couldn't get a connection after 10.00 sec")
    except psycopg_pool.PoolTimeout as exc:
        raise OperationalError(str(exc)) from exc  # what Django's pooled backend raises


def test_no_free_pooled_connection_is_a_503_with_retry_after(viewer_api, monkeypatch):
    monkeypatch.setattr(selectors, "cluster_list", _pool_timeout)
    response = viewer_api.get("/api/v1/clusters/")
    assert (response.status_code, response["Retry-After"]) == (503, "1")
    assert response.json()["detail"] == ("The server is busy: no database connection became free in time. "
                                         "Retry shortly.")


def test_other_database_errors_are_not_reported_as_busy(viewer_api, monkeypatch):
    def broken():
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(selectors, "cluster_list", broken)
    with pytest.raises(OperationalError, match="server closed the connection"):
        viewer_api.get("/api/v1/clusters/")
