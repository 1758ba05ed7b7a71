/* Planning page: profiles (list, import a file, request a profiling Action and follow it), a plan for a prefill and
   a decode pool joined by a link (POST /api/v1/plans/), its predicted TTFT curve (plotly), Apply (POST
   /api/v1/plans/{id}/apply/: pool.scale Actions and the bounds step), then predicted vs measured every 5 s (GET
   /api/v1/plans/{id}/measured/); earlier plans (GET /api/v1/plans/) to reopen or delete. */
"use strict";
(function () {
  const choices = JSON.parse(document.getElementById("planning-data").textContent);
  const poolName = Object.fromEntries(choices.pools.map(p => [p.id, `${p.cluster}/${p.name}`]));
  const $ = (id) => document.getElementById(id);
  let plan = null, measuredTimer = null;

  function fmtS(v) { return v === null || v === undefined ? "no data" : `${Ferry.fmt(v)} s`; }
  function fmtShare(v) { return v === null || v === undefined ? "no data" : `${(v * 100).toFixed(1)}%`; }
  function poly(c) { return c.map(x => Number(x.toPrecision(3))).join(", "); }

  async function loadProfiles() {
    const result = await Ferry.api("GET", "/api/v1/profiles/?page_size=50");
    if (!result.ok) return;
    const rows = (result.data.results || result.data).map(p => Ferry.el("tr", {"data-profile": p.id},
      Ferry.el("td", {}, String(p.id)), Ferry.el("td", {}, p.model_version_label), Ferry.el("td", {}, p.pool_kind),
      Ferry.el("td", {}, p.hardware_label), Ferry.el("td", {}, p.source),
      Ferry.el("td", {title: "a0 + a1 N + a2 N²"}, poly(p.prefill_coefficients)),
      Ferry.el("td", {title: "b0 + b1 B"}, poly(p.decode_coefficients)), Ferry.el("td", {}, Ferry.fmtTime(p.created_at))));
    if (!rows.length) rows.push(Ferry.el("tr", {}, Ferry.el("td", {colspan: 8, class: "muted"}, "No profiles yet: import one or profile a pool.")));
    document.querySelector("#profiles tbody").replaceChildren(...rows);
  }

  const canOperate = document.body.dataset.canOperate === "1";

  function thresholdText(t) {
    return t === null ? "never remote" : t < 0 ? "every prompt remote" : `prompts over ${t} tokens prefill remotely`;
  }

  // Earlier plans: reopen one (its recommendation, Apply, predicted vs measured) or delete it (operators).
  async function loadPlans() {
    const result = await Ferry.api("GET", "/api/v1/plans/?page_size=20");
    if (!result.ok) return;
    const rows = (result.data.results || result.data).map(p => Ferry.el("tr", {"data-plan": p.id},
      Ferry.el("td", {}, String(p.id)), Ferry.el("td", {}, Ferry.fmtTime(p.created_at)),
      Ferry.el("td", {}, poolName[p.prefill_pool] || String(p.prefill_pool)),
      Ferry.el("td", {}, poolName[p.decode_pool] || String(p.decode_pool)),
      Ferry.el("td", {}, `${p.prefill_replicas} + ${p.decode_replicas}`), Ferry.el("td", {}, thresholdText(p.threshold_tokens)),
      Ferry.el("td", {}, fmtS(p.ttft_p50_s)), Ferry.el("td", {}, p.applied_at ? Ferry.fmtTime(p.applied_at) : "no"),
      Ferry.el("td", {},
        Ferry.el("button", {type: "button", "data-open": p.id, onclick: () => showPlan(p)}, "Open"),
        ...(canOperate ? [" ", Ferry.el("button", {type: "button", "data-delete": p.id, onclick: () => deletePlan(p.id)},
          "Delete")] : []))));
    if (!rows.length) rows.push(Ferry.el("tr", {}, Ferry.el("td", {colspan: 9, class: "muted"}, "No plans yet.")));
    document.querySelector("#plans tbody").replaceChildren(...rows);
  }

  async function deletePlan(id) {
    if (!window.confirm(`Delete plan #${id}? Its Actions stay in the log; its profiles can then be deleted.`)) return;
    const result = await Ferry.api("DELETE", `/api/v1/plans/${id}/`);
    if (!result.ok) { $("plan-error").textContent = Ferry.errorText(result); return; }
    if (plan && plan.id === id) hidePlan();
    loadPlans();
  }

  function stopMeasured() {
    if (measuredTimer) { clearInterval(measuredTimer); measuredTimer = null; }
  }

  function hidePlan() {
    $("plan-result").hidden = true;
    plan = null;
    stopMeasured();
  }

  const importForm = $("profile-import");
  if (importForm) importForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const file = $("import-file").files[0];
    if (!file) { $("import-result").textContent = "Choose a JSON file first."; return; }
    $("import-result").textContent = `Importing ${file.name}…`;
    let profile;
    try { profile = JSON.parse(await file.text()); } catch (e) {
      $("import-result").textContent = `${file.name} is not valid JSON: ${e.message}`; return;
    }
    const result = await Ferry.api("POST", "/api/v1/profiles/", {pool: Number($("import-pool").value), profile});
    $("import-result").textContent = result.ok ? `Imported profile #${result.data.id}.` : Ferry.errorText(result);
    if (result.ok) loadProfiles();
  });

  const measureForm = $("profile-measure");
  if (measureForm) measureForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    $("measure-result").textContent = "Requesting…";
    const body = {pool: Number($("measure-pool").value), hardware_label: $("measure-hardware").value.trim()};
    const lengths = $("measure-lengths").value.split(/[\s,]+/).filter(Boolean);
    if (lengths.length) body.lengths = lengths.map(x => (/^\d+$/.test(x) ? Number(x) : x));  // the API names a bad one
    const result = await Ferry.api("POST", "/api/v1/profiles/measure/", body);
    if (!result.ok) { $("measure-result").textContent = Ferry.errorText(result); return; }
    followMeasure(result.data.id);
  });

  // Follow a profiling Action until it ends (a sweep takes tens of seconds): its status, then the new profile
  // in the table, or the reason it failed.
  async function followMeasure(id) {
    for (;;) {
      const result = await Ferry.api("GET", `/api/v1/actions/${id}/`);
      if (!result.ok) { $("measure-result").textContent = `Action #${id}: ${Ferry.errorText(result)}`; return; }
      const a = result.data;
      if (a.status === "succeeded") {
        const stored = (a.log || []).map(line => line.message).find(m => m.startsWith("stored profile")) || "";
        $("measure-result").textContent = `Action #${id} succeeded${stored ? `: ${stored}` : ""}.`;
        loadProfiles();
        return;
      }
      if (a.status === "failed" || a.status === "cancelled") {
        $("measure-result").textContent = `Action #${id} ${a.status}: ${a.error || "see the pool's actions"}` +
          (a.retryable ? " (retryable)" : "");
        return;
      }
      $("measure-result").textContent = `Action #${id} ${a.kind}: ${a.status}…`;
      await new Promise(resolve => setTimeout(resolve, 2000));
    }
  }

  function source() { return document.querySelector("input[name=plan-source]:checked").value; }
  document.querySelectorAll("input[name=plan-source]").forEach(r => r.addEventListener("change", () => {
    document.querySelectorAll("[data-given]").forEach(n => { n.disabled = source() !== "given"; });
  }));

  function num(id) { const v = $(id).value.trim(); return v === "" ? null : Number(v); }

  $("plan-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    $("plan-error").textContent = "";
    // A recommendation stays only while it answers the inputs on the form: hide it until the new one comes.
    hidePlan();
    const workload = {ttft_slo_s: num("plan-ttft"), tpot_slo_s: num("plan-tpot"), attainment: num("plan-attainment")};
    if (source() === "given") Object.assign(workload, {prompt_median: num("plan-prompt-median"),
      prompt_p90: num("plan-prompt-p90"), prompt_cap: num("plan-prompt-cap"), output_median: num("plan-output-median"),
      rate_per_s: num("plan-rate"), cached_prefix_mean: num("plan-cached-prefix") ?? 0});
    const body = {prefill_pool: Number($("plan-prefill").value), decode_pool: Number($("plan-decode").value),
      link: Number($("plan-link").value), workload_source: source(), workload, max_replicas: num("plan-max-replicas")};
    $("plan-submit").disabled = true;
    const result = await Ferry.api("POST", "/api/v1/plans/", body);
    $("plan-submit").disabled = false;
    if (!result.ok) { $("plan-error").textContent = Ferry.errorText(result); return; }
    showPlan(result.data);
    loadPlans();
  });

  function showPlan(data) {
    plan = data;
    $("plan-result").hidden = false;
    $("plan-id").textContent = `plan #${data.id}`;
    $("rec-prefill-replicas").textContent = `${data.prefill_replicas} (${poolName[data.prefill_pool]})`;
    // A co-located fleet's decode replicas also prefill the prompts that stay local (plans before co-location
    // counted separate local prefill replicas).
    $("rec-decode-replicas").textContent = data.fleet.colocated
      ? `${data.decode_replicas} (${poolName[data.decode_pool]}: each replica decodes and prefills the prompts that stay local)`
      : `${data.decode_replicas} (${poolName[data.decode_pool]}: ` +
        `${data.fleet.decode} decoding + ${data.fleet.local_prefill} for local prefill)`;
    $("rec-threshold").textContent = thresholdText(data.threshold_tokens);
    $("rec-link").textContent = `${Ferry.fmt(data.link_gbps)} Gbit/s (${fmtShare(data.link_share)} of the link)`;
    $("rec-remote-share").textContent = fmtShare(data.remote_share);
    $("rec-ttft").textContent = `${fmtS(data.ttft_p50_s)} / ${fmtS(data.ttft_p90_s)}`;
    $("rec-tpot").textContent = fmtS(data.tpot_s);
    $("rec-attainment").textContent = fmtShare(data.attainment);
    $("plan-notes").replaceChildren(...(data.notes || []).map(note => Ferry.el("li", {}, `Note: ${note}`)));
    const rates = data.curve.map(p => p.rate_per_s);
    Plotly.react("chart-ttft", [
      {x: rates, y: data.curve.map(p => p.ttft_p50_s), name: "TTFT p50", mode: "lines+markers"},
      {x: rates, y: data.curve.map(p => p.ttft_p90_s), name: "TTFT p90", mode: "lines+markers"},
      {x: [data.workload.rate_per_s], y: [data.ttft_p90_s], name: "planned rate", mode: "markers", marker: {size: 12}},
    ], {title: {text: "Predicted TTFT of the recommended fleet vs arrival rate", font: {size: 13}},
        margin: {t: 40, r: 10, b: 40, l: 50}, height: 320, legend: {orientation: "h"},
        xaxis: {title: {text: "requests/s"}}, yaxis: {title: {text: "seconds"}, rangemode: "tozero"}},
      {displaylogo: false});
    showSteps(data.applied || []);
    // An applied plan's Apply only returns its first steps (idempotent): say so instead of offering it again.
    const apply = $("plan-apply");
    if (apply) {
      apply.disabled = Boolean(data.applied_at);
      apply.textContent = data.applied_at ? `Applied ${new Date(data.applied_at).toLocaleString()} (the steps below)`
        : "Apply (scale pools, set bounds)";
    }
    stopMeasured();
    document.querySelector("#measured tbody").replaceChildren();
    startMeasured();  // before an apply: the last 5 minutes, the fleet as it runs now
  }

  function showSteps(steps) {
    $("apply-steps").replaceChildren(...steps.map(s => Ferry.el("li", {"data-step": s.step, "data-pool": s.pool},
      s.step === "scale" ? `scale ${poolName[s.pool]} to ${s.replicas}: action #${s.action} ${s.status}`
        : `set bounds on ${poolName[s.pool]}: ${s.status}` + (s.action ? ` (action #${s.action})` : "") +
          (s.reason ? ` — ${s.reason}` : "") + (s.warning ? `. Note: ${s.warning}` : ""))));
  }

  const applyButton = $("plan-apply");
  if (applyButton) applyButton.addEventListener("click", async () => {
    if (!plan) return;
    applyButton.disabled = true;
    const result = await Ferry.api("POST", `/api/v1/plans/${plan.id}/apply/`);
    applyButton.disabled = false;
    if (!result.ok) { $("plan-error").textContent = Ferry.errorText(result); return; }
    showPlan(result.data);
    loadPlans();
  });

  async function refreshMeasured() {
    const shown = plan;  // the plan may be hidden or replaced (deleted, another opened) while this is in flight
    if (!shown) return;
    const result = await Ferry.api("GET", `/api/v1/plans/${shown.id}/measured/`);
    if (!result.ok || plan !== shown) return;
    const {predicted, measured} = result.data;
    // The prediction is the clients' TTFT and TPOT: the decode pool answers them, so it is shown on its row; the
    // prefill pool's measured TTFT is its own prefill time for the decode workers' hand-offs.
    const predictedOn = (id, value) => Number(id) === shown.decode_pool ? fmtS(value) : "—";
    document.querySelector("#measured tbody").replaceChildren(...Object.entries(measured).map(([id, m]) =>
      Ferry.el("tr", {"data-pool": id, title: `${m.records} telemetry records`},
        Ferry.el("td", {}, poolName[id] || id), Ferry.el("td", {}, fmtS(m.ttft_p50_s)),
        Ferry.el("td", {}, predictedOn(id, predicted.ttft_p50_s)), Ferry.el("td", {}, fmtS(m.ttft_p95_s)),
        Ferry.el("td", {}, predictedOn(id, predicted.ttft_p90_s)), Ferry.el("td", {}, fmtS(m.tpot_p50_s)),
        Ferry.el("td", {}, predictedOn(id, predicted.tpot_s)), Ferry.el("td", {}, Ferry.fmt(m.request_rate_per_s)))));
  }

  function startMeasured() {
    stopMeasured();
    refreshMeasured();
    measuredTimer = setInterval(refreshMeasured, 5000);
  }

  loadProfiles();
  loadPlans();
})();
