"""Browser tests (Playwright, Debian's Chromium) of the fleet topology, the link page and the alerts page.

The topology's KV throughput is driven by telemetry records the test writes exactly as the poller does
(broadcast to the fleet and pool groups, appended to the Redis history), not by real load: a real prefill ->
decode flow needs two model workers and costs minutes on these machines (``make run LOAD=1`` shows it live).
Screenshots: ``test-artifacts/dashboard/topology-fleet-idle.png``, ``topology-fleet-load.png``,
``link-page.png``, ``alerts-acknowledged.png``, ``alerts-silenced.png``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.utils import timezone

from apps.dashboard.tests.live_stack import ARTIFACTS, CHROMIUM, signed_in, wait_for_page
from apps.fleet.services import cluster_link_create, pool_create
from apps.operations.models import Action
from apps.telemetry.broadcast import FLEET_GROUP, pool_group, telemetry_broadcast
from apps.telemetry.models import Alert, AlertRule, AlertSilence
from apps.telemetry.services import alert_rules_load_defaults

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium: apt-get install -y chromium"),
]

IDLE = {"request_rate_per_s": 0.0, "kv_transfer_bytes_per_s": None, "kv_transfer_failure_rate": None,
        "engine_busy_ratio": 0.0, "ready_replicas": 1.0}
"""A prefill pool whose workers answer but never shipped KV (no KV series yet)."""


def _publish(history, pools: dict[int, dict], kv_transfers: dict[int, dict] | None = None) -> None:
    at = time.time()
    for pool_id, signals in pools.items():
        record = {"pool_id": pool_id, "at": at, "window_s": 10.0, "source": "scrape", "signals": signals,
                  "tracks": {}, "kv_transfers": (kv_transfers or {}).get(pool_id, {"transfers": [],
                                                                                 "wire_bytes_per_s": {}})}
        message = telemetry_broadcast(pool_group(pool_id), "telemetry.signals", record, history=history)
        history.append(f"pool:{pool_id}", at, message)
    fleet = {"at": at, "window_s": 10.0, "pools": {str(pid): signals for pid, signals in pools.items()}}
    history.append("fleet", at, telemetry_broadcast(FLEET_GROUP, "telemetry.fleet", fleet, history=history))


def publish(history, pools, kv_transfers=None) -> None:
    """``_publish`` on another thread (Playwright's sync API runs an event loop on this one)."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        executor.submit(_publish, history, pools, kv_transfers).result(timeout=30)


def _click_point(page, trace: str, index: int = 0) -> None:
    """Click point ``index`` of the topology's trace named ``trace`` (Plotly's own click handling)."""
    x, y = page.evaluate("([name, i]) => { const d = document.getElementById('topology'); const t = d.data.findIndex("
                         "x => x.name === name); const pt = d.querySelectorAll('.scatterlayer .trace')[t]"
                         ".querySelectorAll('.point')[i].getBoundingClientRect(); "
                         "return [pt.x + pt.width / 2, pt.y + pt.height / 2]; }", [trace, index])
    page.mouse.click(x, y)


def _edge(page) -> dict:
    return page.evaluate("(() => { const d = document.getElementById('topology').data; "
                         "const e = d.find(t => t.name.startsWith('link-')); "
                         "return {width: e.line.width, colour: e.line.color, label: d.find(t => t.name === 'links').text[0]}; })()")


def test_topology_draws_both_datacenters_pools_and_the_link_whose_label_follows_kv_load_and_opens_the_link_page(
        server, browser, make_cluster, model_version, operator_session, telemetry_keys):
    dc_prefill, dc_decode = make_cluster("dc-prefill"), make_cluster("dc-decode")
    prefill = pool_create(name="prefill", role="prefill", replicas=1, cluster=dc_prefill, model_version=model_version)
    decode = pool_create(name="decode", role="decode", replicas=1, cluster=dc_decode, model_version=model_version)
    link = cluster_link_create(source=dc_prefill, destination=dc_decode, bandwidth_gbps=10.0, rtt_ms=2.0)
    publish(telemetry_keys, {prefill.pk: IDLE, decode.pk: {**IDLE, "engine_busy_ratio": 0.5}})

    context, page, guard = signed_in(browser, server, "olga")
    # Drawn from the page's data at once, then from the stream's snapshot (the pools' signals).
    page.wait_for_function("window.ferryTopology && window.ferryTopology.pools.some(p => p.busy === 0.5)")
    drawn = page.evaluate("window.ferryTopology")
    assert drawn["datacenters"] == ["dc-prefill", "dc-decode"]  # the sending datacenter on the left
    assert drawn["clusters"] == ["dc-prefill", "dc-decode"]
    assert [(p["name"], p["role"], p["ready"], p["desired"], p["busy"]) for p in drawn["pools"]] == [
        ("prefill", "prefill", 1, 1, 0.0), ("decode", "decode", 1, 1, 0.5)]
    # Idle but answering: the link reads 0, not "no data"; the thinnest edge.
    assert drawn["links"] == {str(link.pk): "dc-prefill → dc-decode: KV 0 Gbit/s of 10 Gbit/s (0.0%) · KV errors "
                              "no transfers · RTT 2 ms · no traffic yet: `make run LOAD=1` or send a long prompt to "
                              "the router"}
    assert _edge(page)["width"] == 2
    assert page.inner_text(f"#links tr[data-link-id='{link.pk}'] .kv-live").startswith("0 Gbit/s")
    page.screenshot(path=str(ARTIFACTS / "topology-fleet-idle.png"), full_page=True)

    # Under load: 7.5 Gbit/s of 10 (75%, amber), 2% of transfers failing.
    publish(telemetry_keys, {prefill.pk: {**IDLE, "request_rate_per_s": 4.0, "kv_transfer_bytes_per_s": 937.5e6,
                                          "kv_transfer_failure_rate": 0.02}, decode.pk: IDLE},
            {prefill.pk: {"transfers": [{"direction": "send", "outcome": "failure", "reason": "timeout", "per_s": 0.08},
                                        {"direction": "send", "outcome": "success", "reason": "none", "per_s": 3.92}],
                          "wire_bytes_per_s": {"send": 937.5e6}}})
    page.wait_for_function(f"window.ferryTopology.links[{link.pk}].includes('7.50 Gbit/s')")
    edge = _edge(page)
    assert edge["label"] == "dc-prefill → dc-decode: KV 7.50 Gbit/s of 10 Gbit/s (75.0%)<br>KV errors 2.0% · RTT 2 ms"
    assert (edge["width"], edge["colour"]) == (2 + 12 * 0.75, "#f79009")
    page.screenshot(path=str(ARTIFACTS / "topology-fleet-load.png"), full_page=True)

    # Click a pool: its page; back, and click the edge's label: the link page.
    _click_point(page, "pools", 1)
    page.wait_for_url(f"{server.base_url}/pools/{decode.pk}/")
    page.go_back()
    page.wait_for_function(f"window.ferryTopology && window.ferryTopology.links[{link.pk}]")
    _click_point(page, "links")
    page.wait_for_url(f"{server.base_url}/links/{link.pk}/")
    page.wait_for_selector("#transfers td:has-text('timeout')")
    assert page.inner_text("#link-bandwidth") == "10.0 Gbit/s" and page.inner_text("#link-rtt") == "2.0 ms"
    rows = [[c.strip() for c in r.split("\t")] for r in page.inner_text("#directions tbody").split("\n")]
    assert rows == [["dc-prefill → dc-decode", "prefill", "7.50 Gbit/s", "75.0%", "2.00%"],
                    ["dc-decode → dc-prefill", "no prefill pool sends this way", "—", "—", "—"]]
    transfers = [[c.strip() for c in r.split("\t")] for r in page.inner_text("#transfers tbody").split("\n")]
    assert transfers == [["dc-prefill/prefill", "send", "failure", "timeout", "0.08"],
                         ["dc-prefill/prefill", "send", "success", "none", "3.92"]]
    wait_for_page(page, "document.getElementById('chart-link-kv').data[0].y.slice(-1)[0] === 7.5")
    page.screenshot(path=str(ARTIFACTS / "link-page.png"), full_page=True)
    assert guard.remote == []
    context.close()


def test_an_operator_acknowledges_then_silences_an_alert_from_the_alerts_page(
        server, browser, pool, operator_session, telemetry_keys):
    alert_rules_load_defaults()  # an earlier transaction=True test may have flushed the migration's rows
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    alert = Alert.objects.create(rule=rule, pool=pool, severity="critical", started_at=timezone.now(), value=0.97)
    context, page, guard = signed_in(browser, server, "olga")
    page.click("nav a:has-text('Alerts')")
    row = f"#alerts-firing tr[data-alert-id='{alert.pk}']"
    page.wait_for_selector(row)
    cells = [c.strip() for c in page.inner_text(row).split("\t")]
    assert cells[:4] == ["kv-cache-usage-critical", pool.name, "critical", "0.97 (> 0.95)"]
    assert cells[6] == "unacknowledged"
    page.click(f"{row} button.ack")
    page.wait_for_selector(f"{row} .badge.ack")
    assert page.inner_text(f"{row} .badge.ack") == "acknowledged by olga"
    assert page.locator(f"{row} button.ack").count() == 0
    page.screenshot(path=str(ARTIFACTS / "alerts-acknowledged.png"), full_page=True)

    page.select_option(f"{row} select.silence-for", "900")
    page.click(f"{row} button.silence")
    page.wait_for_selector(f"{row} .badge.silenced")
    page.wait_for_selector(f"{row} button.unsilence")
    cells = [c.strip() for c in page.inner_text(row).split("\t")]
    assert cells[:4] == ["kv-cache-usage-critical", pool.name, "critical", "0.97 (> 0.95)"]
    assert page.inner_text(f"{row} .badge.ack") == "acknowledged by olga"
    assert page.inner_text(f"{row} .badge.silenced").startswith("silenced until ")
    page.screenshot(path=str(ARTIFACTS / "alerts-silenced.png"), full_page=True)
    alert.refresh_from_db()
    silence = AlertSilence.objects.get()
    assert (alert.acknowledged_by.username, silence.created_by.username,
            round((silence.ends_at - silence.starts_at).total_seconds())) == ("olga", "olga", 900)
    assert list(Action.objects.filter(target_type="alert", target_id=str(alert.pk)).order_by("pk")
                .values_list("kind", "status", "requested_by__username")) == [
        ("alert.acknowledge", "succeeded", "olga"), ("alert.silence", "succeeded", "olga")]
    page.reload()  # the state is the server's, not the page's memory
    page.wait_for_selector(f"{row} .badge.silenced")
    assert guard.remote == []
    context.close()
