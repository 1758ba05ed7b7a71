"""Link load (issue 24): each cluster link's KV Gbit/s and utilisation from the workers' KV-transfer counters, computed
every poll and stored for the routers (apps.telemetry.link_load)."""

import pytest
from prometheus_client import start_http_server

from apps.fleet.services import cluster_link_create
from apps.telemetry.endpoints import ReplicaEndpoint
from apps.telemetry.link_load import LinkSpec, PoolPlacement, link_flows, link_load
from apps.telemetry.poller import TelemetryPoller, scrape_retention_s
from apps.telemetry.selectors import link_load_current
from apps.telemetry.sources.scrape import DirectScrapeSource
from inference_worker.kv_transfer.recorder import TransferRecorder
from inference_worker.metrics import WorkerMetrics


@pytest.fixture
def exporters(make_pool, make_cluster):
    """A decode pool in dc-a and a prefill pool in dc-b (one model version), a 10 Gbit/s link dc-b -> dc-a, and
    one worker of each serving its real metrics registry over HTTP."""
    decode = make_pool("decode")  # the cluster fixture: dc-a
    prefill = make_pool("prefill", role="prefill", cluster=make_cluster("dc-b"))
    cluster_link_create(source=prefill.cluster, destination=decode.cluster, bandwidth_gbps=10.0, rtt_ms=5.0)
    out, servers = [], []
    for pool in (decode, prefill):
        identity = {"pool": pool.name, "track": "stable", "replica": f"{pool.name}-0", "role": pool.role}
        metrics = WorkerMetrics(identity)
        metrics.set_ready(True)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
        servers.append(server)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out.append((TransferRecorder(metrics.kv_transfer, identity),
                    ReplicaEndpoint(str(pool.pk), "stable", f"{pool.name}-0", url)))
    yield out
    for server in servers:
        server.shutdown()
        server.server_close()


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


@pytest.mark.django_db(transaction=True)
def test_a_scripted_kv_sequence_gives_the_links_exact_gbps_and_utilisation(exporters, history):
    """The decode worker receives 625,000,000 wire bytes a second (5 Gbit/s) for 10 s, then twice that: the link
    shows 5.0 Gbit/s (0.5 of 10) once the 10 s window holds the first phase, then 10.0 (1.0). The prefill worker's
    ``send`` series (the same bytes) is not counted a second time."""
    (decode, decode_endpoint), (prefill, prefill_endpoint) = exporters
    clock = Clock(1_780_000_000.0)

    def scrape_on_the_clock(choice, *, window_s, routers=None):  # samples stamped by the test's clock
        return DirectScrapeSource(retention_s=scrape_retention_s(window_s), clock=clock, routers=routers)

    poller = TelemetryPoller(history=history, window_s=10, clock=clock, slow_every=0,
                             endpoints=lambda: [decode_endpoint, prefill_endpoint], routers=lambda: [],
                             source_factory=scrape_on_the_clock)
    readings = []
    for second in range(21):
        rate = 625_000_000 if second <= 10 else 1_250_000_000
        decode.success("receive", raw_bytes=rate, wire_bytes=rate, seconds=0.1)
        prefill.success("send", raw_bytes=rate, wire_bytes=rate, seconds=0.1)
        poller.poll_once()
        (link,) = poller.link_load["links"]
        readings.append((second, link["kv_gbps"], link["utilisation"]))
        clock.t += 1.0
    poller.close()
    assert readings[0] == (0, 0.0, 0.0)  # one scrape: no rate yet
    for second, gbps, utilisation in (readings[10], readings[20]):
        expected = 5.0 if second == 10 else 10.0
        assert gbps == pytest.approx(expected, rel=1e-12)
        assert utilisation == pytest.approx(expected / 10.0, rel=1e-12)
    stored = link_load_current()
    assert stored == poller.link_load
    assert (stored["at"], stored["window_s"]) == (1_780_000_020.0, 10)
    assert [(x["source"], x["target"], x["bandwidth_gbps"]) for x in stored["links"]] == [("dc-b", "dc-a", 10.0)]


def test_flows_follow_the_prefill_datacenters_of_each_decode_pools_model_versions():
    """Decode pool 1 (v1, dc-a) receives 1e9 B/s; v1 has prefill pools in dc-b and dc-c: 5e8 each. Decode pool 2
    (v2, dc-a) receives 4e8 B/s from v2's prefill pools in dc-b and dc-a itself: 2e8 over dc-b -> dc-a, the
    rest crosses no link. A prefill pool's own rate is never a flow (it is not a receiving role)."""
    pools = [PoolPlacement(1, "decode", "dc-a", frozenset({"v1"})),
             PoolPlacement(2, "colocated", "dc-a", frozenset({"v2"})),
             PoolPlacement(3, "prefill", "dc-b", frozenset({"v1", "v2"})),
             PoolPlacement(4, "prefill", "dc-c", frozenset({"v1"})),
             PoolPlacement(5, "prefill", "dc-a", frozenset({"v2"}))]
    flows = link_flows(pools, {1: 1e9, 2: 4e8, 3: 7e9})
    assert flows == {("dc-b", "dc-a"): 7e8, ("dc-c", "dc-a"): 5e8}
    links = [LinkSpec("dc-a", "dc-b", 10.0), LinkSpec("dc-c", "dc-a", 4.0), LinkSpec("dc-b", "dc-c", 1.0)]
    loads = link_load(links, flows)
    assert [(x["source"], x["target"], x["bandwidth_gbps"]) for x in loads] == [
        ("dc-a", "dc-b", 10.0), ("dc-c", "dc-a", 4.0), ("dc-b", "dc-c", 1.0)]
    # dc-a <-> dc-b: the busier direction is dc-b -> dc-a (7e8 B/s = 5.6 Gbit/s), though the link names dc-a first
    assert [x["kv_gbps"] for x in loads] == pytest.approx([5.6, 4.0, 0.0], rel=1e-12)
    assert [x["utilisation"] for x in loads] == pytest.approx([0.56, 1.0, 0.0], rel=1e-12)
