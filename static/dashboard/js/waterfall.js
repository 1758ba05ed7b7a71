/* Pool page: the slowest recent requests as a waterfall (Plotly horizontal bars). One row per request
   ("<request id> · <total> ms"), each phase a bar from its start (ms after the router received the request)
   for its duration, coloured by lane: router, prefill, transfer (KV), decode. Data: the snapshot the telemetry
   poller stored from the routers' and workers' /debug/slow-requests (rendered into the page). */
"use strict";
(function () {
  const snapshot = JSON.parse(document.getElementById("slow-requests-data").textContent);
  const div = document.getElementById("slow-requests");
  const LANES = ["router", "prefill", "transfer", "decode"];
  const COLORS = {router: "#7f7f7f", prefill: "#1f77b4", transfer: "#ff7f0e", decode: "#2ca02c"};
  const MAX_ROWS = 10;
  const rows = ((snapshot && snapshot.requests) || []).slice(0, MAX_ROWS);
  if (!rows.length) {
    div.textContent = "No slow requests collected yet (the poller reads the routers' and workers' " +
      "/debug/slow-requests every few seconds).";
    return;
  }
  const label = r => `${r.request_id} · ${r.duration_ms.toFixed(0)} ms`;
  const order = rows.map(label).reverse();  // slowest on top
  const data = LANES.map(lane => {
    const bars = rows.flatMap(r => r.phases.filter(p => p.lane === lane).map(p => ({r, p})));
    return {type: "bar", orientation: "h", name: lane, marker: {color: COLORS[lane]},
            y: bars.map(b => label(b.r)), base: bars.map(b => b.p.start_ms), x: bars.map(b => b.p.duration_ms),
            text: bars.map(b => b.p.name), textposition: "inside", insidetextanchor: "middle",
            customdata: bars.map(b => b.r.replica),
            hovertemplate: "%{text}: %{x:.1f} ms from %{base:.1f} ms (replica %{customdata})<extra>%{fullData.name}</extra>"};
  });
  const layout = {barmode: "overlay", height: 80 + 34 * rows.length, margin: {l: 260, r: 20, t: 10, b: 40},
                  xaxis: {title: {text: "ms since the router received the request"}, rangemode: "tozero"},
                  yaxis: {categoryorder: "array", categoryarray: order, automargin: true},
                  legend: {orientation: "h", y: -0.25}};
  div.dataset.rows = String(rows.length);
  Plotly.newPlot(div, data, layout, {displaylogo: false, responsive: true});
})();
