/* Link page: configured bandwidth and RTT, live KV Gbit/s per direction (ws/fleet/, links.js), transfers and
   failures by reason and recent transfer activity from the KV counters of the pools at both ends (ws/pools/<id>/:
   each record's kv_transfers breakdown and signals). */
"use strict";
(function () {
  const link = JSON.parse(document.getElementById("link-data").textContent);
  const directions = [
    {name: `${link.source.name} → ${link.destination.name}`, senders: link.forward_senders},
    {name: `${link.destination.name} → ${link.source.name}`, senders: link.reverse_senders},
  ];
  const ends = [...link.forward_senders, ...link.forward_receivers, ...link.reverse_senders, ...link.reverse_receivers];
  const pools = Object.fromEntries(ends.map(p => [p.id, p]));
  let signals = {};              // pool id -> latest pool-level signals (fleet stream)
  const records = {};            // pool id -> records, oldest first (pool streams)
  const WINDOW_S = 300;

  function renderDirections() {
    const body = document.querySelector("#directions tbody");
    body.replaceChildren(...directions.map(d => {
      const kv = FerryLinks.live(d.senders.map(p => p.id), signals);
      const util = FerryLinks.utilization(kv.bytesPerS, link.bandwidth_gbps);
      const rate = FerryLinks.fmtRate(kv.bytesPerS) + (kv.bytesPerS === 0 ? ` (${FerryLinks.NO_TRAFFIC})` : "");
      return Ferry.el("tr", {},
        Ferry.el("td", {}, d.name),
        Ferry.el("td", {}, d.senders.length ? d.senders.map(p => p.name).join(", ") : "no prefill pool sends this way"),
        Ferry.el("td", {class: "kv-live"}, d.senders.length ? rate : "—"),
        Ferry.el("td", {}, kv.bytesPerS === null ? "—" : `${(util * 100).toFixed(util > 0 && util < 0.001 ? 3 : 1)}%`),
        Ferry.el("td", {}, d.senders.length ? FerryLinks.fmtPercent(kv.failureRate, 2) : "—"));
    }));
  }

  function latestBreakdown(poolId) {
    const list = records[poolId] || [];
    const last = list[list.length - 1];
    return last && last.kv_transfers;
  }

  function renderTransfers() {
    const body = document.querySelector("#transfers tbody");
    const rows = [];
    for (const p of ends) {
      const breakdown = latestBreakdown(p.id);
      if (!breakdown) continue;
      for (const t of breakdown.transfers) {
        rows.push(Ferry.el("tr", {class: t.outcome === "failure" ? "failure" : ""},
          Ferry.el("td", {}, Ferry.el("a", {href: `/pools/${p.id}/`}, `${p.cluster}/${p.name}`)),
          Ferry.el("td", {}, t.direction), Ferry.el("td", {}, t.outcome), Ferry.el("td", {}, t.reason),
          Ferry.el("td", {}, Ferry.fmt(t.per_s))));
      }
    }
    if (!rows.length) {
      rows.push(Ferry.el("tr", {}, Ferry.el("td", {colspan: 5, class: "muted"},
        `No KV transfers in the telemetry window. Long prompts are prefilled remotely and their KV crosses this link: ${FerryLinks.NO_TRAFFIC}.`)));
    }
    body.replaceChildren(...rows);
  }

  function renderCharts() {
    const kvTraces = [], countTraces = [];
    for (const d of directions) {
      for (const p of d.senders) {
        const list = records[p.id] || [];
        const x = list.map(r => new Date(r.at * 1000));
        kvTraces.push({x, y: list.map(r => {
          const s = r.signals || {};
          const bytes = typeof s.kv_transfer_bytes_per_s === "number" ? s.kv_transfer_bytes_per_s
            : (typeof s.request_rate_per_s === "number" ? 0 : null);
          return bytes === null ? null : (bytes * 8) / 1e9;
        }), name: `${d.name} (${p.name})`, mode: "lines+markers", marker: {maxdisplayed: 60}});
        for (const outcome of ["success", "failure"]) {
          countTraces.push({x, y: list.map(r => (r.kv_transfers ? r.kv_transfers.transfers : [])
            .filter(t => t.outcome === outcome && t.direction === "send").reduce((a, t) => a + t.per_s, 0)),
          name: `${p.name} ${outcome}`, mode: "lines"});
        }
      }
    }
    const base = {margin: {l: 50, r: 10, t: 30, b: 40}, height: 280, xaxis: {type: "date"}, legend: {orientation: "h"}};
    const empty = (traces) => !traces.some(t => t.x.length);
    Plotly.react("chart-link-kv", kvTraces, {...base, title: {text: "KV over the link (Gbit/s, wire)", font: {size: 13}},
      annotations: empty(kvTraces) ? Ferry.NO_DATA : []}, {displayModeBar: false, responsive: true});
    Plotly.react("chart-link-transfers", countTraces, {...base, title: {text: "Transfers sent per second", font: {size: 13}},
      annotations: empty(countTraces) ? Ferry.NO_DATA : []}, {displayModeBar: false, responsive: true});
    for (const id of ["chart-link-kv", "chart-link-transfers"]) {
      if (empty(id === "chart-link-kv" ? kvTraces : countTraces)) Plotly.relayout(id, Ferry.emptyTimeAxis(WINDOW_S));
    }
  }

  function render() { renderDirections(); renderTransfers(); renderCharts(); }

  new FerryStream("/ws/fleet/", (msg) => {
    if (msg.type === "snapshot") signals = (msg.record && msg.record.pools) || {};
    else if (msg.type === "telemetry.fleet") signals = msg.pools;
    else return;
    renderDirections();
  });
  for (const id of Object.keys(pools)) {
    new FerryStream(`/ws/pools/${id}/`, (msg) => {
      if (msg.type === "snapshot") records[id] = msg.records.slice();
      else if (msg.type === "telemetry.signals") {
        const list = records[id] || (records[id] = []);
        list.push(msg);
        const floor = msg.at - WINDOW_S;
        while (list.length && list[0].at < floor) list.shift();
      } else return;
      renderTransfers();
      renderCharts();
    });
  }
  render();
})();
