"""Where telemetry finds routers: the router registry, their metrics URLs, and the Prometheus job."""

import pytest

from apps.telemetry.endpoints import RouterEndpoint, prometheus_router_scrape_config, router_endpoints


@pytest.mark.parametrize(
    ("url", "metrics_url"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080/metrics"),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080/metrics"),
        ("https://router.ferry.internal/metrics", "https://router.ferry.internal/metrics"),
        ("http://10.0.0.7:9000/router/metrics", "http://10.0.0.7:9000/router/metrics"),
    ],
)
def test_router_metrics_url_defaults_to_the_metrics_path(url, metrics_url):
    assert RouterEndpoint(url).metrics_url == metrics_url


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "ftp://h/metrics", "http:///metrics", "http://h:1/metrics?x=1",
                                 "http://h:1/metrics#top"])
def test_malformed_router_urls_are_refused(url):
    with pytest.raises(ValueError, match="is not http\\(s\\)://host:port\\[/metrics\\]"):
        RouterEndpoint(url)


@pytest.mark.django_db
def test_router_endpoints_are_the_registered_routers(cluster, settings):
    """The poller scrapes only the registry (admin-written, validated); a setting naming URLs is not read."""
    from django.core.exceptions import ValidationError

    from apps.fleet.services import router_create

    settings.FERRY_ROUTER_METRICS_URLS = ["http://169.254.169.254:80"]  # the removed setting: ignored
    assert router_endpoints() == []
    router_create(name="r-b", cluster=cluster, url="https://b.example:8443")
    router_create(name="r-a", cluster=cluster, url="http://a.example:8080")
    assert [r.metrics_url for r in router_endpoints()] == ["http://a.example:8080/metrics", "https://b.example:8443/metrics"]
    for url in ("file:///etc/passwd", "gopher://a:70/", "a:8080", "http://a.example:8080/metrics", "http://u:p@a.example:1",
                "http://a.example:8080/?q=1", "junk"):
        with pytest.raises(ValidationError):
            router_create(name="bad", cluster=cluster, url=url)


def test_a_router_key_never_equals_a_replica_key():
    assert RouterEndpoint("http://a:1").key == ("", "router", "http://a:1/metrics")


def test_prometheus_router_job_keeps_the_routers_labels_and_each_path():
    job = prometheus_router_scrape_config([RouterEndpoint("http://a:8080"), RouterEndpoint("https://b/r/metrics")],
                                          interval_s=1.5)
    assert job == {
        "job_name": "ferry-router", "scrape_interval": "1500ms", "scrape_timeout": "1500ms", "honor_labels": True,
        "static_configs": [
            {"targets": ["a:8080"], "labels": {"__metrics_path__": "/metrics", "__scheme__": "http"}},
            {"targets": ["b"], "labels": {"__metrics_path__": "/r/metrics", "__scheme__": "https"}},
        ],
    }
