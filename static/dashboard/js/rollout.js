/* Rollout page: steps (numbered from 1, current highlighted), canary weight over time (the rollout's recorded
   history, then live), gates against live canary signals, controls (only the verbs the server allows in this
   state are enabled; abort and rollback ask for confirmation; a rollback opens the rollout it created) and the
   event log (the rollout's Actions and their logs, a rollback linking to its rollout).
   Pool signals stream over ws/rollouts/<id>/; the plan's state is re-read from the REST API every 2 s and
   whenever a rollout.state message arrives. */
"use strict";
(function () {
  const rollout = JSON.parse(document.getElementById("rollout-data").textContent);
  const latest = {};  // pool id -> latest telemetry record
  const weightDiv = document.getElementById("chart-canary-weight");

  // The rollout's own history first (its recorded weight changes, selectors.rollout_weight_history), so a page
  // opened after the fact shows the whole rollout; then a reading every 2 s while the page is open. With neither
  // yet: the last five minutes up to now, "no data yet".
  const history = rollout.weight_history || {};
  let weightCharted = rollout.pools.some(p => (history[p.id] || []).length);
  Plotly.newPlot(weightDiv, rollout.pools.map(p => ({x: (history[p.id] || []).map(h => new Date(h[0])),
    y: (history[p.id] || []).map(h => h[1]), name: `${p.name} (${p.role})`, type: "scatter",
    mode: "lines+markers", line: {shape: "hv"}})),
    {height: 260, margin: {l: 60, r: 20, t: 20, b: 40},
     xaxis: weightCharted ? {title: {text: "time"}, type: "date", autorange: true}
       : {title: {text: "time"}, type: "date", autorange: false, range: Ferry.emptyTimeAxis(300)["xaxis.range"]},
     yaxis: {title: {text: "canary traffic weight (%)"}, range: [0, 105]}, annotations: weightCharted ? [] : Ferry.NO_DATA},
    {displaylogo: false, responsive: true});

  function stepText(step) {
    if ("set_weight" in step) return `set weight ${step.set_weight}%`;
    if ("pause" in step) return step.pause.seconds ? `pause ${step.pause.seconds} s` : "pause until resumed";
    if ("analysis" in step) return `analysis${step.analysis.duration_s ? ` for ${step.analysis.duration_s} s` : ""}`;
    return JSON.stringify(step);
  }

  // Where the rollout is, counting steps from 1 as the server's messages do. current_step_index (API, 0-based)
  // is the next step to run, so it is also the 1-based number of the step in effect; 0 = none applied yet.
  function position() {
    const total = rollout.steps.length, started = Math.min(rollout.current_step_index, total);
    if (!total) return "no steps";
    if (rollout.state === "promoted") return `all ${total} steps done`;
    if (started === 0) return `before step 1 of ${total}`;
    const where = `step ${started} of ${total}`;
    return ["aborted", "failed"].includes(rollout.state) ? `stopped at ${where}` : where;
  }

  function renderPlan() {
    document.getElementById("rollout-state").textContent = rollout.state;
    document.getElementById("rollout-state").className = `state state-${rollout.state}`;
    document.getElementById("rollout-position").textContent = position();
    document.getElementById("rollout-message").textContent = rollout.message || "";
    document.getElementById("rollout-phase").textContent = rollout.phase || "—";
    if (rollout.allowed_verbs) {
      document.querySelectorAll("#rollout-controls button[data-verb]").forEach(b => {
        b.disabled = !rollout.allowed_verbs.includes(b.dataset.verb);
        b.title = b.disabled ? `not allowed while the rollout is ${rollout.state}` : "";
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
      // a rollback names the rollout it created (params.rollout_id): link to it
      const created = a.kind === "rollout.rollback" && a.params && a.params.rollout_id;
      rows.push(Ferry.el("tr", {class: `status-${a.status}`}, Ferry.el("td", {}, Ferry.fmtTime(a.created_at)),
        Ferry.el("td", {}, `#${a.id} ${a.kind}`), Ferry.el("td", {}, a.status),
        Ferry.el("td", {}, a.error || "", created ? Ferry.el("a", {href: `/rollouts/${created}/`, class: "rollout-link"},
          `open rollout #${created}`) : "")));
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
      const question = {
        abort: `Abort rollout ${rollout.name}? Traffic returns to the stable version.`,
        rollback: `Roll back rollout ${rollout.name}? A new rollout moves the pools back to the version they ran before.`,
      }[verb];
      if (question && !window.confirm(question)) return;
      const result = await Ferry.api("POST", `/api/v1/rollouts/${rollout.id}/${verb}/`);
      document.getElementById("rollout-result").textContent = result.ok ? `${verb}: accepted` : `${verb} refused: ${Ferry.errorText(result)}`;
      if (result.ok && verb === "rollback") {  // the rollback is a new rollout: follow it
        window.location.assign(`/rollouts/${result.data.id}/`);
        return;
      }
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
