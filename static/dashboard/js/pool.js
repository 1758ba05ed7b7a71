/* Pool page: live Plotly charts (time on x, units on y) from ws/pools/<id>/, alert badges, replicas, scale
   control and recent Actions (retry/cancel) through the REST API: every Action about the pool (?about_pool=), a
   rollout's track changes included, with who asked (a user, rollout:<id>, autoscaler...). */
"use strict";
(function () {
  const pool = JSON.parse(document.getElementById("pool-data").textContent);
  const MAX_POINTS = 900;  // 15 minutes at one poll per second (the telemetry history horizon)
  const MAX_MARKERS = 60;  // markers drawn per trace (see resetCharts)
  const utilization = pool.gpu
    ? {title: "GPU utilization", y: "ratio (0–1)", signals: ["gpu_utilization"]}
    : {title: "Engine busy ratio (CPU workers — no GPU; not GPU utilization)", y: "busy ratio (0–1)", signals: ["engine_busy_ratio"]};
  const CHARTS = [
    {id: "utilization", ...utilization},
    {id: "kv-transfer-errors", title: "KV-transfer error rate", y: "failed / total (0–1)", signals: ["kv_transfer_failure_rate"]},
    {id: "queue-depth", title: "Queue depth", y: "requests waiting", signals: ["num_requests_waiting"]},
    {id: "running", title: "Running", y: "requests running", signals: ["num_requests_running"]},
    {id: "kv-cache", title: "KV cache usage", y: "ratio (0–1)", signals: ["kv_cache_usage", "kv_cache_usage_max"]},
    {id: "ttft", title: "TTFT", y: "seconds", signals: ["ttft_p50_s", "ttft_p99_s"]},
    {id: "tpot", title: "TPOT", y: "seconds", signals: ["tpot_p50_s", "tpot_p99_s"]},
    {id: "tokens", title: "Tokens/s", y: "tokens per second", signals: ["prompt_tokens_per_s", "generation_tokens_per_s"]},
    // The router counts each request once, for its decode pool: a prefill pool's own chart stays empty.
    // "fallback (local)" is part of "local prefill": long prompts prefilled locally for want of a prefill replica.
    {id: "router", title: pool.role === "prefill"
      ? "Router decisions (local vs remote prefill; counted on the decode pools)"
      : "Router decisions (local vs remote prefill)", y: "requests per second",
     signals: ["router_local_prefill_per_s", "router_remote_prefill_per_s", "router_local_prefill_fallback_per_s"]},
    // The routers' circuit breaker: this pool's replicas ejected now (error rate over its window or failures in a row).
    {id: "ejections", title: "Replicas ejected by the router's circuit breaker", y: "replicas",
     signals: ["router_ejected_replicas"]},
    // Prefix cache (issue 18): tokens served from the cache, blocks cached per tier (the workers have the
    // device tier only), and how well the router's prefix index predicted the hits (1.0 = exact).
    {id: "prefix-cache-hit-rate", title: "Prefix cache hit rate (tokens)", y: "cached / looked-up prompt tokens (0–1)",
     signals: ["prefix_cache_hit_rate"]},
    {id: "prefix-cache-tiers", title: "Prefix cache tier usage", y: "KV blocks cached", signals: ["prefix_cache_device_blocks"]},
    {id: "router-index-accuracy", title: pool.role === "prefill"
      ? "Router prefix index accuracy (counted on the decode pools)" : "Router prefix index accuracy",
     y: "predicted / reported cached tokens", signals: ["router_index_accuracy"]},
  ];
  const LABELS = {kv_cache_usage: "avg over replicas", kv_cache_usage_max: "max replica", ttft_p50_s: "p50",
    ttft_p99_s: "p99", tpot_p50_s: "p50", tpot_p99_s: "p99", prompt_tokens_per_s: "prompt (prefill)",
    generation_tokens_per_s: "generation (decode)", router_local_prefill_per_s: "local prefill",
    router_remote_prefill_per_s: "remote prefill",
    router_local_prefill_fallback_per_s: "fallback (local)", prefix_cache_device_blocks: "device tier"};
  let alerts = {};
  const container = document.getElementById("charts");

  const EMPTY_WINDOW_S = 300;  // an empty chart shows the last five minutes (the snapshot's history)

  function layout(chart, hasData) {
    const empty = Ferry.emptyTimeAxis(EMPTY_WINDOW_S);
    // With a legend the title sits on its own line above it (side by side they overlap in a narrow chart).
    const legend = chart.signals.length > 1;
    return {title: {text: chart.title, font: {size: 14}, x: 0.02, xanchor: "left", yref: "container", y: 1,
      yanchor: "top", pad: {t: 8}}, height: legend ? 280 : 260,
      margin: {l: 60, r: 20, t: legend ? 60 : 40, b: 40},
      xaxis: hasData ? {title: {text: "time"}, type: "date"}
        : {title: {text: "time"}, type: "date", autorange: false, range: empty["xaxis.range"]},
      yaxis: {title: {text: chart.y}, rangemode: "tozero"}, showlegend: legend,
      legend: {orientation: "h", x: 1, xanchor: "right", y: 1.0, yanchor: "bottom"},
      annotations: hasData ? [] : Ferry.NO_DATA};
  }

  function hasValues(cols) { return cols.some(c => c.y.some(v => v !== null)); }

  function columns(records, chart) {
    const x = records.map(r => new Date(r.at * 1000));
    return chart.signals.map(name => ({x, y: records.map(r => (r.signals || {})[name] ?? null)}));
  }

  function resetCharts(records) {
    container.replaceChildren();
    for (const chart of CHARTS) {
      const div = Ferry.el("div", {id: `chart-${chart.id}`, class: "chart", "data-signals": chart.signals.join(",")});
      container.append(div);
      const data = columns(records, chart).map((col, i) => ({...col, type: "scatter", mode: "lines+markers",
        // Plotly draws each marker as its own SVG node and redraws them all on every extendTraces: 14 charts of
        // 900 points (the 15-minute snapshot) grew the page to ~77,000 nodes and pinned the tab's CPU. Lines
        // carry the series; at most MAX_MARKERS markers per trace keep isolated samples visible.
        marker: {size: 3, maxdisplayed: MAX_MARKERS}, connectgaps: false, name: LABELS[chart.signals[i]] || chart.signals[i]}));
      chart.hasData = hasValues(data);
      Plotly.newPlot(div, data, layout(chart, chart.hasData), {displaylogo: false, responsive: true});
    }
  }

  function extendCharts(record) {
    for (const chart of CHARTS) {
      const cols = columns([record], chart);
      Plotly.extendTraces(`chart-${chart.id}`, {x: cols.map(c => c.x), y: cols.map(c => c.y)},
        chart.signals.map((_, i) => i), MAX_POINTS);
      if (!chart.hasData && hasValues(cols)) {
        chart.hasData = true;
        Plotly.relayout(`chart-${chart.id}`, {annotations: [], "xaxis.autorange": true});
      } else if (!chart.hasData) {
        Plotly.relayout(`chart-${chart.id}`, Ferry.emptyTimeAxis(EMPTY_WINDOW_S));  // still empty: keep up with now
      }
    }
    const ready = record.signals.ready_replicas;
    if (ready !== null && ready !== undefined) pool.live_ready = ready;
    renderCount();
  }

  function renderCount() {
    const ready = pool.live_ready ?? pool.ready_replicas;
    document.getElementById("replica-count").textContent = `${ready} / ${pool.replicas}`;
  }

  new FerryStream(`/ws/pools/${pool.id}/`, (msg) => {
    if (msg.type === "snapshot") {
      Object.assign(pool, msg.pool);
      alerts = {};
      msg.alerts.forEach(a => Ferry.applyAlert(alerts, a));
      resetCharts(msg.records);
      const last = msg.records[msg.records.length - 1];
      pool.live_ready = last ? last.signals.ready_replicas : null;
      renderCount();
    } else if (msg.type === "telemetry.signals") {
      extendCharts(msg);
    } else if (msg.type === "telemetry.alert") {
      Ferry.applyAlert(alerts, msg.alert);
    }
    Ferry.renderAlerts(document.getElementById("alerts"), alerts);
  });

  async function showLogs(replica) {
    const pre = document.getElementById("replica-logs");
    const result = await Ferry.api("GET", `/api/v1/replicas/${replica.id}/logs/?tail=200`);
    pre.hidden = false;
    pre.textContent = result.ok ? (result.data.lines || []).join("\n") || "(no output)"
      : `Logs of ${replica.name} are not available: ${Ferry.errorText(result)}`;
  }

  async function refreshReplicas() {
    const result = await Ferry.api("GET", `/api/v1/replicas/?pool=${pool.id}&page_size=500`);
    if (!result.ok) return;
    document.querySelector("#replicas tbody").replaceChildren(...result.data.results.map(r => Ferry.el("tr", {},
      Ferry.el("td", {}, r.name), Ferry.el("td", {}, r.track), Ferry.el("td", {}, r.version),
      Ferry.el("td", {}, r.ready ? "yes" : "no"), Ferry.el("td", {}, r.alive ? "yes" : `no (exit ${r.exit_code ?? "?"})`),
      Ferry.el("td", {}, String(r.restart_count)), Ferry.el("td", {}, r.endpoint), Ferry.el("td", {}, Ferry.fmtTime(r.last_seen)),
      Ferry.el("td", {}, Ferry.el("button", {class: "link", onclick: () => showLogs(r)}, "logs")))));
  }

  async function actionVerb(action, verb) {
    const result = await Ferry.api("POST", `/api/v1/actions/${action.id}/${verb}/`);
    document.getElementById("scale-result").textContent = result.ok
      ? `Action #${action.id}: ${verb} → #${result.data.id} ${result.data.status}` : `${verb} failed: ${Ferry.errorText(result)}`;
    refreshActions();
  }

  async function refreshActions() {
    const result = await Ferry.api("GET", `/api/v1/actions/?about_pool=${pool.id}&page_size=20`);
    if (!result.ok) return;
    document.querySelector("#actions tbody").replaceChildren(...result.data.results.map(a => {
      const row = Ferry.el("tr", {"data-action-id": a.id, class: `status-${a.status}`},
        Ferry.el("td", {}, String(a.id)), Ferry.el("td", {}, a.kind), Ferry.el("td", {class: "status"}, a.status),
        Ferry.el("td", {}, JSON.stringify(a.params)), Ferry.el("td", {}, a.requester || a.requested_by || ""),
        Ferry.el("td", {}, Ferry.fmtTime(a.created_at)), Ferry.el("td", {class: "error"}, a.error || ""));
      if (Ferry.canOperate) {
        const cell = Ferry.el("td", {});
        if (a.status === "pending") cell.append(Ferry.el("button", {class: "cancel", onclick: () => actionVerb(a, "cancel")}, "Cancel"));
        if (a.status === "failed" || a.status === "cancelled") cell.append(Ferry.el("button", {class: "retry", onclick: () => actionVerb(a, "retry")}, "Retry"));
        row.append(cell);
      }
      return row;
    }));
  }

  async function refreshPool() {
    const result = await Ferry.api("GET", `/api/v1/pools/${pool.id}/`);
    if (result.ok) { pool.replicas = result.data.replicas; renderCount(); }
  }

  const flush = document.getElementById("flush-kv-cache");
  if (flush) {
    flush.addEventListener("click", async () => {
      if (!window.confirm(`Flush the KV cache of every replica of pool ${pool.name}? Sessions lose their cached prefixes.`)) return;
      const result = await Ferry.api("POST", `/api/v1/pools/${pool.id}/flush-kv-cache/`);
      document.getElementById("flush-result").textContent = result.ok
        ? `Action #${result.data.id} ${result.data.kind}: ${result.data.status}` : `Flush refused: ${Ferry.errorText(result)}`;
      refreshActions();
    });
  }

  const form = document.getElementById("scale-form");
  if (form) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const replicas = Number(document.getElementById("scale-replicas").value);
      const result = await Ferry.api("POST", `/api/v1/pools/${pool.id}/scale/`, {replicas});
      document.getElementById("scale-result").textContent = result.ok
        ? `Action #${result.data.id} ${result.data.kind}: ${result.data.status}` : `Scale refused: ${Ferry.errorText(result)}`;
      refreshActions();
    });
  }

  function refreshAll() { refreshPool(); refreshReplicas(); refreshActions(); }
  refreshAll();
  setInterval(refreshAll, 3000);
})();
