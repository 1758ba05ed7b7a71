/* The fleet page's topology (Plotly, served from static/): datacenters as regions, clusters inside them, pools
   as nodes (role, version split by track, ready/desired, busy ratio) and links as edges whose width and colour
   follow live KV throughput against the link's bandwidth, labelled with throughput and KV-transfer error rate.
   Clicking a pool opens its page, clicking an edge's label opens the link page. fleet.js calls
   FerryTopology.render(overview, signals) on every snapshot and telemetry.fleet message.
   window.ferryTopology exposes what was drawn (datacenters, pools, link labels) to tests and the curious. */
"use strict";

const FerryTopology = (() => {
  const DC_W = 10, DC_GAP = 6, ROW_H = 3.2, CLUSTER_PAD = 1.2;
  const ROLE_SYMBOL = {prefill: "square", decode: "circle", colocated: "diamond"};
  const ROLE_COLOUR = {prefill: "#7a5af8", decode: "#1570ef", colocated: "#0e9384"};
  let bound = false;

  function versionSplit(p) {
    return p.tracks.map(t => `${t.name}: ${t.model_version} ×${t.replicas}${t.weight !== null && t.weight !== undefined ? ` (${t.weight}%)` : ""}`).join("<br>");
  }

  function layout(overview) {
    // Regions side by side, those whose clusters send KV over a link first (the flow reads left to right);
    // clusters stacked in a region; pools stacked in a cluster (one row each).
    const clusters = {}, regions = [], pools = [];
    const sources = new Set(overview.links.map(l => l.source_id));
    const sends = (dc) => dc.clusters.some(c => sources.has(c.id)) ? 0 : 1;
    const ordered = overview.datacenters.map((dc, i) => [sends(dc), i, dc]).sort((a, b) => a[0] - b[0] || a[1] - b[1]).map(x => x[2]);
    ordered.forEach((dc, i) => {
      const x0 = i * (DC_W + DC_GAP);
      let y = 0;
      const boxes = dc.clusters.map(c => {
        const rows = Math.max(1, c.pools.length);
        const box = {id: c.id, name: c.name, x0: x0 + 1, x1: x0 + DC_W - 1, y1: y - 0.6, y0: y - 0.6 - rows * ROW_H - CLUSTER_PAD};
        c.pools.forEach((p, j) => pools.push({p, x: (box.x0 + box.x1) / 2, y: box.y1 - CLUSTER_PAD - j * ROW_H}));
        y = box.y0 - 1.2;
        clusters[c.id] = box;
        return box;
      });
      regions.push({name: dc.name, x0, x1: x0 + DC_W, y1: 1.2, y0: y - 0.2, boxes});
    });
    return {clusters, regions, pools};
  }

  function edgeEnds(a, b) {
    const ca = {x: (a.x0 + a.x1) / 2, y: (a.y0 + a.y1) / 2}, cb = {x: (b.x0 + b.x1) / 2, y: (b.y0 + b.y1) / 2};
    if (Math.abs(ca.x - cb.x) > 0.01) {  // different regions: from facing sides
      const right = ca.x < cb.x;
      return [{x: right ? a.x1 : a.x0, y: ca.y}, {x: right ? b.x0 : b.x1, y: cb.y}];
    }
    const down = ca.y > cb.y;  // same region: from facing top/bottom
    return [{x: ca.x + 2, y: down ? a.y0 : a.y1}, {x: cb.x + 2, y: down ? b.y1 : b.y0}];
  }

  function render(overview, signals) {
    const root = document.getElementById("topology");
    if (!root || typeof Plotly === "undefined") return;
    const empty = document.getElementById("topology-empty");
    if (!overview.datacenters.length) {
      root.hidden = true;
      if (empty) empty.hidden = false;
      return;
    }
    root.hidden = false;
    if (empty) empty.hidden = true;
    const {clusters, regions, pools} = layout(overview);
    const shapes = [], annotations = [], traces = [];
    const drawn = {datacenters: [], clusters: [], pools: [], links: {}};
    for (const r of regions) {
      shapes.push({type: "rect", x0: r.x0, x1: r.x1, y0: r.y0, y1: r.y1, line: {color: "#1570ef", width: 1, dash: "dot"},
        fillcolor: "rgba(21,112,239,0.04)", layer: "below"});
      annotations.push({x: r.x0 + 0.3, y: r.y1 - 0.2, xanchor: "left", yanchor: "top", showarrow: false,
        text: `<b>datacenter ${r.name}</b>`, font: {size: 13, color: "#1570ef"}});
      drawn.datacenters.push(r.name);
      for (const b of r.boxes) {
        shapes.push({type: "rect", x0: b.x0, x1: b.x1, y0: b.y0, y1: b.y1, line: {color: "#d0d5dd", width: 1},
          fillcolor: "#ffffff", layer: "below"});
        annotations.push({x: b.x0 + 0.2, y: b.y1 - 0.15, xanchor: "left", yanchor: "top", showarrow: false,
          text: `cluster ${b.name}`, font: {size: 11, color: "#667085"}});
        drawn.clusters.push(b.name);
      }
    }
    // Links first, so nodes draw over them.
    const mids = {x: [], y: [], text: [], customdata: [], colour: []};
    for (const l of overview.links) {
      const a = clusters[l.source_id], b = clusters[l.destination_id];
      if (!a || !b) continue;
      const [p, q] = edgeEnds(a, b);
      const live = FerryLinks.live(l.source_pool_ids, signals);
      const util = FerryLinks.utilization(live.bytesPerS, l.bandwidth_gbps);
      const hasData = live.bytesPerS !== null;
      const colour = FerryLinks.colour(util, hasData);
      traces.push({x: [p.x, q.x], y: [p.y, q.y], mode: "lines", hoverinfo: "skip", showlegend: false,
        name: `link-${l.id}`, line: {width: 2 + 12 * Math.min(1, util), color: colour}});
      let label = `${l.source} → ${l.destination}: KV ${FerryLinks.fmtRate(live.bytesPerS)} of ${l.bandwidth_gbps} Gbit/s`;
      if (hasData) label += ` (${(util * 100).toFixed(util > 0 && util < 0.001 ? 3 : 1)}%)`;
      label += `<br>KV errors ${FerryLinks.fmtPercent(live.failureRate)} · RTT ${l.rtt_ms} ms`;
      if (live.bytesPerS === 0) label += `<br><i>${FerryLinks.NO_TRAFFIC}</i>`;
      if (!l.source_pool_ids.length) label += `<br><i>no prefill pool in ${l.source} sends over this link</i>`;
      mids.x.push((p.x + q.x) / 2); mids.y.push((p.y + q.y) / 2); mids.text.push(label);
      mids.customdata.push(`link:${l.id}`); mids.colour.push(colour);
      drawn.links[l.id] = label.replace(/<br>/g, " · ").replace(/<\/?[bi]>/g, "");
    }
    traces.push({x: mids.x, y: mids.y, text: mids.text, customdata: mids.customdata, name: "links", mode: "markers+text",
      textposition: "top center", hovertemplate: "%{text}<br>click for the link page<extra></extra>", showlegend: false,
      marker: {symbol: "diamond", size: 16, color: mids.colour, line: {color: "#fff", width: 1}}, textfont: {size: 11}});
    const nodes = {x: [], y: [], text: [], customdata: [], symbol: [], colour: [], hover: []};
    for (const {p, x, y} of pools) {
      const live = signals[p.id] || {};
      const ready = live.ready_replicas ?? p.ready_replicas;
      const busy = p.gpu ? live.gpu_utilization : live.engine_busy_ratio;
      const busyText = busy === null || busy === undefined ? "no data" : `${Math.round(busy * 100)}%`;
      const alerts = (p.alerts || []).length;
      nodes.x.push(x); nodes.y.push(y);
      nodes.text.push(`<b>${p.name}</b> (${p.role})${alerts ? ` ⚠ ${alerts}` : ""}<br>${versionSplit(p)}<br>ready ${ready ?? "?"}/${p.replicas} · ${p.gpu ? "GPU" : "busy"} ${busyText}`);
      nodes.customdata.push(`pool:${p.id}`);
      nodes.symbol.push(ROLE_SYMBOL[p.role] || "circle");
      nodes.colour.push(alerts ? "#d92d20" : (ROLE_COLOUR[p.role] || "#475467"));
      drawn.pools.push({id: p.id, name: p.name, role: p.role, ready, desired: p.replicas, busy});
    }
    traces.push({x: nodes.x, y: nodes.y, text: nodes.text, customdata: nodes.customdata, name: "pools",
      mode: "markers+text", textposition: "bottom center", showlegend: false,
      hovertemplate: "%{text}<br>click for the pool page<extra></extra>", textfont: {size: 11},
      marker: {size: 18, symbol: nodes.symbol, color: nodes.colour, line: {color: "#fff", width: 1}}});
    const xs = regions.flatMap(r => [r.x0, r.x1]), ys = regions.flatMap(r => [r.y0, r.y1]);
    const height = Math.max(300, 40 * (Math.max(...ys) - Math.min(...ys)) + 80);
    Plotly.react(root, traces, {
      height, margin: {l: 10, r: 10, t: 10, b: 10}, shapes, annotations, hovermode: "closest", dragmode: false,
      xaxis: {visible: false, range: [Math.min(...xs) - 1, Math.max(...xs) + 1], fixedrange: true},
      yaxis: {visible: false, range: [Math.min(...ys) - 1.5, Math.max(...ys) + 1], fixedrange: true},
      plot_bgcolor: "#fff", paper_bgcolor: "#fff"}, {displayModeBar: false, responsive: true});
    if (!bound) {
      bound = true;
      root.on("plotly_click", (event) => {
        const target = event.points && event.points[0] && event.points[0].customdata;
        if (typeof target !== "string") return;
        const [kind, id] = target.split(":");
        window.location.href = kind === "pool" ? `/pools/${id}/` : `/links/${id}/`;
      });
    }
    window.ferryTopology = drawn;
  }

  return {render};
})();
