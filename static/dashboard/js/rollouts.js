/* Rollouts list: the create form posts to /api/v1/rollouts/ and opens the new rollout's page. */
"use strict";
(function () {
  const form = document.getElementById("rollout-create");
  if (!form) return;
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
      pools: Array.from(document.getElementById("rc-pools").selectedOptions).map(o => Number(o.value)),
      target_model_version: Number(document.getElementById("rc-target").value),
      strategy: document.getElementById("rc-strategy").value, steps, gates,
    };
    const result = await Ferry.api("POST", "/api/v1/rollouts/", body);
    if (result.ok) location.assign(`/rollouts/${result.data.id}/`);
    else out.textContent = `Not created: ${Ferry.errorText(result)}`;
  });
})();
