/* Rollout page: steps (current highlighted), canary weight over time, gates against live canary signals,
   controls (abort asks for confirmation) and the event log (the rollout's Actions and their logs).
   Pool signals stream over ws/rollouts/<id>/; the plan's state is re-read from the REST API every 2 s and
   whenever a rollout.state message arrives. */
"use strict";
(function () {
  const rollout = JSON.parse(document.getElementById("rollout-data").textContent);
  const latest = {};  // pool id -> latest telemetry record
  const weightDiv = document.getElementById("chart-canary-weight");

  // Empty until the first reading (every 2 s while the page is open): the last five minutes up to now,
  // "no data yet"; then the axis follows the readings.
  let weightCharted = false;
  Plotly.newPlot(weightDiv, rollout.pools.map(p => ({x: [], y: [], name: `${p.name} (${p.role})`, type: "scatter",
    mode: "lines+markers", line: {shape: "hv"}})),
    {height: 260, margin: {l: 60, r: 20, t: 20, b: 40},
     xaxis: {title: {text: "time"}, type: "date", autorange: false, range: Ferry.emptyTimeAxis(300)["xaxis.range"]},
     yaxis: {title: {text: "canary traffic weight (%)"}, range: [0, 105]}, annotations: Ferry.NO_DATA},
    {displaylogo: false, responsive: true});

  function stepText(step) {
    if ("set_weight" in step) return `set weight ${step.set_weight}%`;
    if ("pause" in step) return step.pause.seconds ? `pause ${step.pause.seconds} s` : "pause until resumed";
    if ("analysis" in step) return `analysis${step.analysis.duration_s ? ` for ${step.analysis.duration_s} s` : ""}`;
    return JSON.stringify(step);
  }

  function renderPlan() {
    document.getElementById("rollout-state").textContent = rollout.state;
    document.getElementById("rollout-state").className = `state state-${rollout.state}`;
    // current_step_index (API, 0-based) is the next step to run, so it is also the 1-based number of the step
    // in effect, as the server's messages count ("step N of M"); 0 = no step applied yet.
    document.getElementById("rollout-step").textContent = String(rollout.current_step_index);
    document.getElementById("rollout-steps-total").textContent = String(rollout.steps.length);
    document.getElementById("rollout-message").textContent = rollout.message || "";
    document.getElementById("rollout-phase").textContent = rollout.phase || "—";
    if (rollout.allowed_verbs) {
      document.querySelectorAll("#rollout-controls button[data-verb]").forEach(b => {
        b.disabled = !rollout.allowed_verbs.includes(b.dataset.verb);
      });
    }
    // the step in effect is "current" (index current_step_index - 1), the one to run next is "next"
    const current = rollout.current_step_index - 1;
    const active = ["progressing", "paused", "pending"].includes(rollout.state);
    const stepClass = i => (active && i === current ? "current" : (active && i === current + 1 ? "next"
      : (i < current ? "done" : "")));
    document.getElementById("steps").replaceChildren(...rollout.steps.map((s, i) => Ferry.el("li", {
      class: stepClass(i), "data-index": i}, stepText(s))));
  }

  function compare(value, op, threshold) {
    return {"<": value < threshold, "<=": value <= threshold, ">": value > threshold, ">=": value >= threshold}[op];
  }

  let measurements = {};  // gate index -> latest GateMeasurement (from /api/v1/rollout-measurements/)

  function liveValue(gate) {
    const values = Object.values(latest).map(r => ((r.tracks || {}).canary || {})[gate.telemetry_signal])
      .filter(v => v !== null && v !== undefined);
    if (!values.length) return null;
    return gate.comparison.startsWith("<") ? Math.max(...values) : Math.min(...values);  // the worst pool
  }

  function renderGates() {
    const rows = rollout.gates.map((g, i) => {
      const m = measurements[i];
      const verdict = m ? (m.passed ? "pass" : "fail") : "not measured yet";
      return Ferry.el("tr", {class: `gate-${verdict.split(" ")[0]}`, "data-gate-index": i}, Ferry.el("td", {}, String(i + 1)),
        Ferry.el("td", {}, g.signal), Ferry.el("td", {}, `${g.comparison} ${g.threshold}`), Ferry.el("td", {}, `${g.window_s} s`),
        Ferry.el("td", {}, m ? `${Ferry.fmt(m.value)}${m.detail ? ` (${m.detail})` : ""}` : ""), Ferry.el("td", {class: "verdict"}, verdict),
        Ferry.el("td", {}, m ? String(m.consecutive_failures) : ""), Ferry.el("td", {}, m ? Ferry.fmtTime(m.measured_at) : ""),
        Ferry.el("td", {}, g.telemetry_signal ? Ferry.fmt(liveValue(g)) : "not a telemetry signal"));
    });
    if (!rows.length) rows.push(Ferry.el("tr", {}, Ferry.el("td", {colspan: 9}, "This plan has no gates.")));
    document.querySelector("#gates tbody").replaceChildren(...rows);
  }

  async function refreshMeasurements() {
    const result = await Ferry.api("GET", `/api/v1/rollout-measurements/?rollout=${rollout.id}&page_size=200`);
    if (!result.ok) return;
    measurements = {};
    for (const m of result.data.results) {  // newest first
      if (!(m.gate_index in measurements)) measurements[m.gate_index] = m;
    }
    renderGates();
  }

  async function refreshPlan() {
    const result = await Ferry.api("GET", `/api/v1/rollouts/${rollout.id}/`);
    if (result.ok) {
      Object.assign(rollout, {state: result.data.state, phase: result.data.phase,
        current_step_index: result.data.current_step_index, message: result.data.message, steps: result.data.steps,
        allowed_verbs: result.data.allowed_verbs});
      renderPlan();
    }
    const now = new Date();
    const weights = await Promise.all(rollout.pools.map(async p => {
      const r = await Ferry.api("GET", `/api/v1/pools/${p.id}/`);
      if (!r.ok) return null;
      const canary = r.data.tracks.find(t => t.name === "canary" || t.name === "green");
      return canary ? canary.weight : 0;
    }));
    Plotly.extendTraces(weightDiv, {x: weights.map(() => [now]), y: weights.map(w => [w])}, weights.map((_, i) => i), 3600);
    if (!weightCharted && weights.some(w => w !== null)) {
      weightCharted = true;
      Plotly.relayout(weightDiv, {annotations: [], "xaxis.autorange": true});
    }
    refreshEvents();
    refreshMeasurements();
  }

  async function refreshEvents() {
    const result = await Ferry.api("GET", `/api/v1/actions/?target_type=rollout&target_id=${rollout.id}&page_size=50`);
    if (!result.ok) return;
    const rows = [];
    for (const a of result.data.results) {
      rows.push(Ferry.el("tr", {class: `status-${a.status}`}, Ferry.el("td", {}, Ferry.fmtTime(a.created_at)),
        Ferry.el("td", {}, `#${a.id} ${a.kind}`), Ferry.el("td", {}, a.status), Ferry.el("td", {}, a.error || "")));
      for (const entry of (a.log || [])) {
        rows.push(Ferry.el("tr", {class: "log"}, Ferry.el("td", {}, Ferry.fmtTime(entry.at)), Ferry.el("td", {}, ""),
          Ferry.el("td", {}, ""), Ferry.el("td", {}, entry.message)));
      }
    }
    document.querySelector("#events tbody").replaceChildren(...rows);
  }

  const controls = document.getElementById("rollout-controls");
  if (controls) {
    controls.addEventListener("click", async (event) => {
      const verb = event.target.dataset && event.target.dataset.verb;
      if (!verb) return;
      if (verb === "abort" && !window.confirm(`Abort rollout ${rollout.name}? Traffic returns to the stable version.`)) return;
      const result = await Ferry.api("POST", `/api/v1/rollouts/${rollout.id}/${verb}/`);
      document.getElementById("rollout-result").textContent = result.ok ? `${verb}: accepted` : `${verb} refused: ${Ferry.errorText(result)}`;
      refreshPlan();
    });
  }

  new FerryStream(`/ws/rollouts/${rollout.id}/`, (msg) => {
    if (msg.stream.startsWith("rollout.")) {
      if (msg.type === "snapshot") Object.assign(rollout, msg.rollout); else refreshPlan();
      renderPlan();
    } else if (msg.type === "snapshot") {
      const last = msg.records[msg.records.length - 1];
      if (last) latest[msg.pool.id] = last;
    } else if (msg.type === "telemetry.signals") {
      latest[msg.pool_id] = msg;
    }
    renderGates();
  });

  renderPlan();
  renderGates();
  refreshPlan();
  setInterval(refreshPlan, 2000);
})();
