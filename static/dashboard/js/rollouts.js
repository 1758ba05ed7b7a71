/* Rollouts list: the create form posts to /api/v1/rollouts/ and opens the new rollout's page
   (/rollouts/<id>/, so reload and bookmarks work). Until the target is picked by hand, it follows the pool
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
  });
  targetSelect.addEventListener("change", () => { targetPicked = true; });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const out = document.getElementById("rc-result");
    let steps, gates;
    try {
      steps = JSON.parse(document.getElementById("rc-steps").value);
      gates = JSON.parse(document.getElementById("rc-gates").value);
    } catch (e) { out.textContent = `Steps and gates must be JSON: ${e.message}`; return; }
    const body = {
      name: document.getElementById("rc-name").value,
      pools: Array.from(poolSelect.selectedOptions).map(o => Number(o.value)),
      target_model_version: Number(targetSelect.value),
      strategy: document.getElementById("rc-strategy").value, steps, gates,
    };
    const result = await Ferry.api("POST", "/api/v1/rollouts/", body);
    if (result.ok) location.assign(`/rollouts/${result.data.id}/`);
    else out.textContent = `Not created: ${Ferry.errorText(result)}`;
  });
})();
