/* Rollouts list: the create form (steps and gates from the rollout editor, rollout_editor.js) posts to
   /api/v1/rollouts/ and opens the new rollout's page (/rollouts/<id>/, so reload and bookmarks work). While it is
   filled in, every change asks the server what it thinks (POST /api/v1/rollouts/preview/: create's own checks,
   then what each step will do from the controller's replica math) and shows the messages inline and the preview. Until the target is picked by hand, it follows the pool
   selection: the newest version of the chosen pools' models that none of them runs
   (selectors.newest_version_not_run, the same rule). */
"use strict";
(function () {
  const form = document.getElementById("rollout-create");
  if (!form) return;
  const choices = JSON.parse(document.getElementById("rollout-form-data").textContent);
  const poolSelect = document.getElementById("rc-pools");
  const targetSelect = document.getElementById("rc-target");
  let targetPicked = false;

  function newestVersionNotRun(pools) {
    const running = new Set(pools.map(p => p.model_version_id));
    const models = new Set(pools.map(p => p.model));
    const free = choices.versions.filter(v => !running.has(v.id));
    const pick = free.find(v => models.has(v.model)) ?? free[0];
    return pick ? pick.id : null;
  }

  poolSelect.addEventListener("change", () => {
    if (targetPicked) return;
    const chosen = new Set(Array.from(poolSelect.selectedOptions).map(o => Number(o.value)));
    const target = newestVersionNotRun(choices.pools.filter(p => !chosen.size || chosen.has(p.id)));
    if (target !== null) targetSelect.value = String(target);
    schedule();
  });
  targetSelect.addEventListener("change", () => { targetPicked = true; });

  const editor = new RolloutEditor(choices, () => schedule());
  const nameInput = document.getElementById("rc-name");
  let nameTouched = false, submitted = false;
  nameInput.addEventListener("input", () => { nameTouched = true; schedule(); });
  for (const id of ["rc-pools", "rc-target", "rc-strategy", "rc-router", "rc-max-surge"]) {
    document.getElementById(id).addEventListener(id === "rc-max-surge" ? "input" : "change", () => schedule());
  }

  /* The create request's body, or null when the JSON view holds text that is not JSON. */
  function body() {
    const plan = editor.current();
    if (plan === null) return null;
    const surge = document.getElementById("rc-max-surge");
    const router = document.getElementById("rc-router").value;
    return {
      name: nameInput.value,
      pools: Array.from(poolSelect.selectedOptions).map(o => Number(o.value)),
      target_model_version: Number(targetSelect.value),
      strategy: document.getElementById("rc-strategy").value, steps: plan.steps, gates: plan.gates,
      router: router ? Number(router) : null, max_surge: RolloutEditor.number(surge),
    };
  }

  const poolNames = Object.fromEntries(choices.pools.map(p => [p.id, p.label]));

  function renderPreview(preview) {
    const el = Ferry.el;
    const head = el("tr", {}, el("th", {}, "Step"), el("th", {}, "What happens"), el("th", {}, "New version's traffic"),
      ...preview.pools.map(p => el("th", {}, `${poolNames[p.id] || p.name}: replicas per track (R=${p.total})`)));
    const rows = preview.rows.map(row => el("tr", {class: row.error ? "invalid" : ""},
      el("td", {}, row.number === null ? "" : String(row.number)),
      el("td", {}, row.text, row.error ? el("div", {class: "row-error"}, row.error) : ""),
      el("td", {class: "weight"}, `${row.weight}%`),
      ...preview.pools.map(p => el("td", {class: "replicas", "data-pool": p.id},
        Object.entries(row.replicas[String(p.id)] || {}).map(([track, n]) => `${track} ${n}`).join(" · ")))));
    document.getElementById("rc-preview").replaceChildren(el("table", {class: "grid", id: "rc-preview-table"},
      el("thead", {}, head), el("tbody", {}, ...rows)));
  }

  function showErrors(errors) {
    const fieldErrors = errors || {};
    editor.showErrors(fieldErrors);
    document.getElementById("rc-name-error").textContent = nameTouched ? (fieldErrors.name || []).join(" ") : "";
    // no pools picked yet: the preview says what to do rather than the pools field's error
    const noPools = !poolSelect.selectedOptions.length;
    if (noPools && !submitted) {
      document.getElementById("rc-preview").replaceChildren(Ferry.el("p", {class: "muted"},
        "Pick the pools (a prefill and a decode pool together) to see what each step will do."));
    }
    const shown = new Set(["steps", "gates", "name", ...(noPools && !submitted ? ["pools"] : [])]);
    const rest = Object.entries(fieldErrors).filter(([k]) => !shown.has(k))
      .map(([k, v]) => `${k === "non_field_errors" ? "" : `${k}: `}${Array.isArray(v) ? v.join(" ") : (v.detail || JSON.stringify(v))}`);
    document.getElementById("rc-result").textContent = rest.join("; ");
  }

  let timer = null, asked = 0;
  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(check, 250);
  }

  async function check() {
    const request = body();
    if (request === null) return;  // the JSON view shows the parser's message
    if (!request.pools.length && !submitted) {  // nothing to preview yet: say what to do, ask the server nothing
      showErrors({});
      return;
    }
    const mine = ++asked;
    const result = await Ferry.api("POST", "/api/v1/rollouts/preview/", request);
    if (mine !== asked) return;  // a newer edit asked again
    form.dataset.checked = String(mine);
    if (result.ok) {
      showErrors({});
      renderPreview(result.data);
    } else if (result.status === 400 && result.data) {
      showErrors(result.data);
    } else {
      showErrors({non_field_errors: [Ferry.errorText(result)]});
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const out = document.getElementById("rc-result");
    const request = body();
    if (request === null) { out.textContent = "Steps and gates must be JSON (see the Advanced view)."; return; }
    const result = await Ferry.api("POST", "/api/v1/rollouts/", request);
    if (result.ok) { location.assign(`/rollouts/${result.data.id}/`); return; }
    nameTouched = submitted = true;
    if (result.status === 400 && result.data) showErrors(result.data);
    out.textContent = `Not created: ${Ferry.errorText(result)}`;
  });

  check();
})();
