"""A registered router's URL is one the control plane can fetch: ``http(s)://host[:port]`` and nothing else."""

import httpx
import pytest
from django.core.exceptions import ValidationError

from apps.fleet.validators import validate_router_url

ACCEPTED = ["http://127.0.0.1:8080", "https://r1.example", "http://r1.example:8080/", "http://[::1]:8080",
            "http://router.ferry-system.svc:1", "http://r1.example:65535"]
REFUSED = [
    "http://[::1]:99999", "http://r1.example:65536", "http://r1.example:0",  # ports outside 1..65535
    "http://r1.example:8080/?", "http://r1.example:8080/#", "http://r1.example?", "http://r1.example#",  # empty query
    "http://r1.example/metrics", "http://u:p@r1.example", "file:///etc/passwd", "http://[::1", "http://r1.example:-1",
]


@pytest.mark.parametrize("url", ACCEPTED)
def test_an_accepted_router_url_is_fetchable_with_its_metrics_path(url):
    validate_router_url(url)
    metrics = httpx.URL(f"{url.rstrip('/')}/metrics")  # what the poller and the readiness gate request
    assert (metrics.path, metrics.query, metrics.fragment) == ("/metrics", b"", "")
    assert metrics.port is None or 1 <= metrics.port <= 65535


@pytest.mark.parametrize("url", REFUSED)
def test_a_url_with_a_bad_port_or_anything_after_the_host_is_refused(url):
    # ``:99999`` and an empty ``?`` or ``#`` passed before: httpx cannot open the first (InvalidURL, not an
    # HTTPError) and the second made ``<url>/metrics`` a query or fragment of ``/``.
    with pytest.raises(ValidationError):
        validate_router_url(url)
