/* Rollout page: steps (numbered from 1, current highlighted), canary weight, replicas per track and gate
   measurements over time (the rollout's recorded Actions and measurements, so a page opened after the fact shows
   the whole rollout, then live; each step's start marked), gates against live canary signals, controls (only the verbs the server allows in this
   state are enabled; abort and rollback ask for confirmation; a rollback opens the rollout it created) and the
   event log (the rollout's Actions and their logs, a rollback linking to its rollout).
   Pool signals stream over ws/rollouts/<id>/; the plan's state is re-read from the REST API every 2 s and
   whenever a rollout.state message arrives. */
"use strict";
(function () {
  const rollout = JSON.parse(document.getElementById("rollout-data").textContent);
  const latest = {};  // pool id -> latest telemetry record
  const weightDiv = document.getElementById("chart-canary-weight");

  // Prefill and decode move in lockstep, so their lines lie on top of each other: each role has its own dash,
  // width and marker (the prefill line wide and dotted under the decode line), and the legend is always shown.
  const ROLE_STYLE = {prefill: {dash: "dot", width: 5, symbol: "diamond-open", size: 10},
    decode: {dash: "solid", width: 2, symbol: "circle", size: 6}, colocated: {dash: "dashdot", width: 2, symbol: "square", size: 6}};
  function roleStyle(role) { return ROLE_STYLE[role] || ROLE_STYLE.decode; }
  function styled(role, trace) {
    const st = roleStyle(role);
    return {...trace, line: {shape: "hv", dash: st.dash, width: st.width}, marker: {symbol: st.symbol, size: st.size}};
  }

  // Traffic on the target version per pool (selectors.rollout_weight_history: the rollout's recorded track changes,
  // so a page opened after the fact shows the whole rollout; then a reading every 2 s while the page is open, from
  // the same rule, targetShare). With neither yet: the last five minutes up to now, "no data yet".
  const history = rollout.weight_history || {};
  let weightCharted = rollout.pools.some(p => (history[p.id] || []).length);
  Plotly.newPlot(weightDiv, rollout.pools.map(p => styled(p.role, {x: (history[p.id] || []).map(h => new Date(h[0])),
    y: (history[p.id] || []).map(h => h[1]), name: `${p.name} (${p.role})`, type: "scatter",
    mode: "lines+markers"})),
    {height: 260, margin: {l: 60, r: 20, t: 20, b: 40}, showlegend: true, hovermode: "x unified",
     xaxis: weightCharted ? {title: {text: "time"}, type: "date", autorange: true}
       : {title: {text: "time"}, type: "date", autorange: false, range: Ferry.emptyTimeAxis(300)["xaxis.range"]},
     yaxis: {title: {text: `traffic on ${rollout.target_model_version} (%)`}, range: [0, 105]},
     annotations: weightCharted ? [] : Ferry.NO_DATA},
    {displaylogo: false, responsive: true});

  /* Percent of a pool's traffic on the target version from its tracks (/api/v1/pools/{id}/: model_version id,
     weight), the rule of selectors.target_share: 100 when every track runs it, else the weights of those that do. */
  function targetShare(tracks) {
    if (!tracks.length) return null;
    const onTarget = tracks.filter(t => t.model_version === rollout.target_model_version_id);
    if (onTarget.length === tracks.length) return 100;
    return onTarget.reduce((sum, t) => sum + t.weight, 0);
  }

  // When each step started (its rollout.step Action), drawn as a labelled line on the time charts.
  const stepShapes = (rollout.step_marks || []).map(([at, label]) => ({type: "line", xref: "x", yref: "paper",
    x0: new Date(at), x1: new Date(at), y0: 0, y1: 1, line: {color: "#98a2b3", width: 1, dash: "dot"},
    label: {text: label, textposition: "end", textangle: 0, xanchor: "left", yanchor: "top", padding: 4,
      font: {size: 10, color: "#667085"}}}));
  if (stepShapes.length) Plotly.relayout(weightDiv, {shapes: stepShapes});

  // Replicas per track per pool: the rollout's recorded track changes (selectors.rollout_replica_history), then
  // the pools' desired replicas read every 2 s. One trace per (pool, track); a track seen live gets its own.
  const replicasDiv = document.getElementById("chart-replicas");
  const replicaHistory = rollout.replica_history || {};
  const replicaTraces = [];  // [pool id, track] per trace index
  const replicaData = [];
  for (const p of rollout.pools) {
    for (const [track, points] of Object.entries(replicaHistory[p.id] || {})) {
      replicaTraces.push(`${p.id}/${track}`);
      replicaData.push(styled(p.role, {x: points.map(h => new Date(h[0])), y: points.map(h => h[1]),
        name: `${p.name} ${track}`, type: "scatter", mode: "lines+markers"}));
    }
  }
  const replicasCharted = replicaData.length > 0;
  Plotly.newPlot(replicasDiv, replicaData, {height: 260, margin: {l: 60, r: 20, t: 20, b: 40}, showlegend: true,
    xaxis: replicasCharted ? {title: {text: "time"}, type: "date"}
      : {title: {text: "time"}, type: "date", autorange: false, range: Ferry.emptyTimeAxis(300)["xaxis.range"]},
    yaxis: {title: {text: "desired replicas"}, rangemode: "tozero", dtick: 1},
    annotations: replicasCharted ? [] : Ferry.NO_DATA, shapes: stepShapes}, {displaylogo: false, responsive: true});

  function extendReplicas(now, pools) {
    for (const {pool, tracks} of pools) {
      for (const t of tracks) {
        const key = `${pool.id}/${t.name}`;
        let index = replicaTraces.indexOf(key);
        if (index < 0) {
          replicaTraces.push(key);
          Plotly.addTraces(replicasDiv, styled(pool.role, {x: [], y: [], name: `${pool.name} ${t.name}`,
            type: "scatter", mode: "lines+markers"}));
          index = replicaTraces.length - 1;
        }
        Plotly.extendTraces(replicasDiv, {x: [[now]], y: [[t.replicas]]}, [index], 3600);
      }
    }
    if (replicasDiv.layout.annotations && replicasDiv.layout.annotations.length) {
      Plotly.relayout(replicasDiv, {annotations: [], "xaxis.autorange": true});
    }
  }

  // Gate measurements: every recorded evaluation (selectors.rollout_measurement_history), then the newest ones
  // from /api/v1/rollout-measurements/ every 2 s. One trace per gate and pool (failed points red), and each gate's
  // threshold as a dashed line.
  const gatesDiv = document.getElementById("chart-gates");
  const allMeasurements = new Map((rollout.measurement_history || []).map(m => [m.id, m]));
  const poolName = Object.fromEntries(rollout.pools.map(p => [p.id, p.name]));

  function drawMeasurements() {
    if (!rollout.gates.length) return;  // no gates: the page says so (#gates-empty) instead of an empty chart
    const series = new Map();
    for (const m of [...allMeasurements.values()].sort((a, b) => (a.measured_at < b.measured_at ? -1 : 1))) {
      const key = `${m.gate_index}/${m.pool}`;
      if (!series.has(key)) series.set(key, {gate: m.gate_index, pool: m.pool, points: []});
      series.get(key).points.push(m);
    }
    const data = [];
    for (const {gate, pool, points} of series.values()) {
      const g = rollout.gates[gate];
      data.push({x: points.map(m => new Date(m.measured_at)), y: points.map(m => m.value), type: "scatter",
        mode: "lines+markers", name: `gate ${gate + 1} ${points[0].signal} (${poolName[pool] || "pool " + pool})`,
        marker: {color: points.map(m => (m.passed ? "#067647" : "#b42318"))}, meta: {gate, pool}});
      data.push({x: [points[0].measured_at, points[points.length - 1].measured_at].map(t => new Date(t)),
        y: [points[0].threshold, points[points.length - 1].threshold], type: "scatter", mode: "lines",
        line: {dash: "dash", width: 1}, name: `gate ${gate + 1} threshold ${g ? g.comparison : ""} ${points[0].threshold}`,
        meta: {gate, threshold: true}});
    }
    Plotly.react(gatesDiv, data, {height: 260, margin: {l: 60, r: 20, t: 20, b: 40},
      xaxis: data.length ? {title: {text: "time"}, type: "date"}
        : {title: {text: "time"}, type: "date", autorange: false, range: Ferry.emptyTimeAxis(300)["xaxis.range"]},
      yaxis: {title: {text: "measured value (gate's signal unit)"}},
      annotations: data.length ? [] : [{...Ferry.NO_DATA[0],
        text: "not measured yet: gates are measured during analysis steps"}],
      shapes: stepShapes}, {displaylogo: false, responsive: true});
  }
  drawMeasurements();

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
    const stateNode = document.getElementById("rollout-state");
    stateNode.textContent = rollout.state_label || rollout.state;  // a rollback reads as one: "rolled back"
    stateNode.className = `state state-${rollout.state}`;
    stateNode.dataset.state = rollout.state;
    stateNode.title = `state ${rollout.state}`;
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
    let added = false;
    for (const m of result.data.results) {  // newest first
      if (!(m.gate_index in measurements)) measurements[m.gate_index] = m;
      if (!allMeasurements.has(m.id)) { allMeasurements.set(m.id, m); added = true; }
    }
    renderGates();
    if (added) drawMeasurements();
  }

  async function refreshPlan() {
    const result = await Ferry.api("GET", `/api/v1/rollouts/${rollout.id}/`);
    if (result.ok) {
      Object.assign(rollout, {state: result.data.state, phase: result.data.phase,
        current_step_index: result.data.current_step_index, message: result.data.message, steps: result.data.steps,
        allowed_verbs: result.data.allowed_verbs, state_label: result.data.state_label});
      renderPlan();
    }
    const now = new Date();
    const read = await Promise.all(rollout.pools.map(async p => {
      const r = await Ferry.api("GET", `/api/v1/pools/${p.id}/`);
      return r.ok ? {pool: p, tracks: r.data.tracks} : null;
    }));
    const weights = read.map(r => (r ? targetShare(r.tracks) : null));
    extendReplicas(now, read.filter(r => r));
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
    // One order, newest first: every Action and every line of its log is a row at its own time (a step's log grows
    // while the step waits, so lines under their Action would run oldest first inside a newest-first list). Ties:
    // the newer Action first, an Action above its own lines, a later line above an earlier one.
    const entries = [];
    for (const a of result.data.results) {
      // a rollback names the rollout it created (params.rollout_id): link to it
      const created = a.kind === "rollout.rollback" && a.params && a.params.rollout_id;
      entries.push({at: Date.parse(a.created_at), action: a.id, index: Infinity, row: Ferry.el("tr",
        {class: `status-${a.status}`}, Ferry.el("td", {}, Ferry.fmtTime(a.created_at)),
        Ferry.el("td", {}, `#${a.id} ${a.kind}`), Ferry.el("td", {}, a.status),
        Ferry.el("td", {}, a.error || "", created ? Ferry.el("a", {href: `/rollouts/${created}/`, class: "rollout-link"},
          `open rollout #${created}`) : ""))});
      (a.log || []).forEach((entry, index) => entries.push({at: Date.parse(entry.at), action: a.id, index,
        row: Ferry.el("tr", {class: "log"}, Ferry.el("td", {}, Ferry.fmtTime(entry.at)),
          Ferry.el("td", {class: "muted"}, `#${a.id} ${a.kind}`), Ferry.el("td", {}, ""), Ferry.el("td", {}, entry.message))}));
    }
    entries.sort((x, y) => (y.at - x.at) || (y.action - x.action) || (y.index - x.index));
    entries.forEach(e => { e.row.dataset.at = String(e.at); });
    document.querySelector("#events tbody").replaceChildren(...entries.map(e => e.row));
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
