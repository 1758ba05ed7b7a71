/* Fleet page: the topology (topology.js), datacenters -> clusters -> pools (role, version, replicas
   ready/desired, health, alerts) and links (configured bandwidth, live KV throughput: links.js), live from
   ws/fleet/; desired replicas re-read every 5 s. */
"use strict";
(function () {
  let overview = JSON.parse(document.getElementById("fleet-overview").textContent);
  let signals = {};   // pool id -> latest pool-level signals
  let alerts = {};    // alert id -> firing alert

  function poolRow(p) {
    const live = signals[p.id] || {};
    const ready = live.ready_replicas ?? p.ready_replicas;
    const poolAlerts = Object.fromEntries(Object.entries(alerts).filter(([, a]) => a.pool_id === p.id));
    const badges = Ferry.el("span", {class: "badges"});
    Ferry.renderAlerts(badges, poolAlerts);
    return Ferry.el("tr", {"data-pool-id": p.id},
      Ferry.el("td", {}, Ferry.el("a", {href: `/pools/${p.id}/`}, p.name)),
      Ferry.el("td", {}, p.role),
      Ferry.el("td", {}, p.model_version),
      Ferry.el("td", {class: "replicas"}, `${ready ?? "?"} / ${p.replicas}`),
      Ferry.el("td", {}, p.gpu ? `GPU util ${Ferry.fmt(live.gpu_utilization)}` : `busy ${Ferry.fmt(live.engine_busy_ratio)} (CPU)`),
      Ferry.el("td", {}, Ferry.fmt(live.request_rate_per_s)),
      Ferry.el("td", {}, badges));
  }

  function render() {
    FerryTopology.render(overview, signals);
    const root = document.getElementById("datacenters");
    if (!overview.datacenters.length) {
      root.replaceChildren(Ferry.el("p", {class: "empty"}, "No clusters yet: `make run` loads the demo fleet "
        + "(or run `manage.py ferry_demo`); add clusters and pools in the admin (/admin/)."));
    } else root.replaceChildren(...overview.datacenters.map(dc => Ferry.el("div", {class: "datacenter"},
      Ferry.el("h3", {}, dc.name),
      ...dc.clusters.map(c => Ferry.el("div", {class: "cluster"},
        Ferry.el("h4", {}, `${c.name} `, Ferry.el("span", {class: "muted"}, `${c.kind} · ${c.status}`)),
        Ferry.el("table", {class: "grid"},
          Ferry.el("thead", {}, Ferry.el("tr", {}, ...["Pool", "Role", "Version", "Ready / desired", "Utilization", "Requests/s", "Health"].map(h => Ferry.el("th", {}, h)))),
          Ferry.el("tbody", {}, ...(c.pools.length ? c.pools.map(poolRow)
            : [Ferry.el("tr", {}, Ferry.el("td", {colspan: 7, class: "muted"}, "No pools in this cluster."))]))))))));
    const links = document.querySelector("#links tbody");
    links.replaceChildren(...overview.links.map(l => {
      const kv = FerryLinks.live(l.source_pool_ids, signals);
      const live = FerryLinks.fmtRate(kv.bytesPerS) + (kv.bytesPerS === 0 ? ` (${FerryLinks.NO_TRAFFIC})` : "")
        + (l.source_pool_ids.length ? "" : ` (no prefill pool in ${l.source})`);
      return Ferry.el("tr", {"data-link-id": l.id}, Ferry.el("td", {}, l.source), Ferry.el("td", {}, l.destination),
        Ferry.el("td", {}, `${l.bandwidth_gbps} Gbit/s`), Ferry.el("td", {}, `${l.rtt_ms} ms`), Ferry.el("td", {class: "kv-live"}, live),
        Ferry.el("td", {}, Ferry.el("a", {href: `/links/${l.id}/`}, "link page")));
    }));
    if (!overview.links.length) {
      links.replaceChildren(Ferry.el("tr", {}, Ferry.el("td", {colspan: 6, class: "muted"},
        "No links between clusters: add one in the admin (Cluster links) to ship KV between datacenters.")));
    }
  }

  new FerryStream("/ws/fleet/", (msg) => {
    if (msg.type === "snapshot") {
      overview = msg.overview;
      signals = (msg.record && msg.record.pools) || {};
      alerts = {};
      msg.alerts.forEach(a => Ferry.applyAlert(alerts, a));
    } else if (msg.type === "telemetry.fleet") {
      signals = msg.pools;
    } else if (msg.type === "telemetry.alert") {
      Ferry.applyAlert(alerts, msg.alert);
    }
    render();
  });

  async function refreshDesired() {
    const result = await Ferry.api("GET", "/api/v1/pools/?page_size=500");
    if (!result.ok) return;
    const desired = Object.fromEntries(result.data.results.map(p => [p.id, p.replicas]));
    overview.datacenters.forEach(dc => dc.clusters.forEach(c => c.pools.forEach(p => {
      if (desired[p.id] !== undefined) p.replicas = desired[p.id];
    })));
    render();
  }
  render();
  setInterval(refreshDesired, 5000);
})();
