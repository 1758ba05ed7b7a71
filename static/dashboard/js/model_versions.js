/* Model versions page, admins: register a version with POST /api/v1/model-versions/ (the API's serializer and
   the catalog service: the architecture parsed from a built-in model, a GGUF under FERRY_MODEL_ROOTS or a
   config.json, a local weights file checksummed against the expected SHA-256). The server's messages are shown
   next to their fields; on success the page reloads with the new row marked. */
"use strict";
(function () {
  const form = document.getElementById("mv-register");
  if (!form) return;
  const FIELDS = ["name", "version", "builtin_model", "gguf_path", "config", "weights_uri", "sha256"];

  function source() { return form.querySelector("input[name=mv-source]:checked").value; }

  function showSource() {
    const chosen = source();
    form.querySelectorAll("[data-source]").forEach(n => { n.hidden = n.dataset.source !== chosen; });
  }
  form.querySelectorAll("input[name=mv-source]").forEach(r => r.addEventListener("change", showSource));
  showSource();

  document.getElementById("mv-config-file").addEventListener("change", async (event) => {
    const file = event.target.files[0];
    if (file) document.getElementById("mv-config").value = await file.text();
  });

  function showErrors(errors) {
    for (const field of FIELDS) {
      const slot = document.getElementById(`mv-${field}-error`);
      if (slot) slot.textContent = (errors[field] || []).join(" ");
    }
    const rest = Object.entries(errors).filter(([k]) => !FIELDS.includes(k))
      .map(([, v]) => (Array.isArray(v) ? v.join(" ") : String(v)));
    document.getElementById("mv-result").textContent = rest.join(" ");
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = {
      name: document.getElementById("mv-name").value.trim(),
      version: document.getElementById("mv-version").value.trim(),
      weights_uri: document.getElementById("mv-weights-uri").value.trim(),
      sha256: document.getElementById("mv-sha256").value.trim(),
    };
    const kind = source();
    if (kind === "builtin_model") body.builtin_model = document.getElementById("mv-builtin").value;
    if (kind === "gguf_path") body.gguf_path = document.getElementById("mv-gguf-path").value.trim();
    if (kind === "config") {
      try {
        body.config = JSON.parse(document.getElementById("mv-config").value);
      } catch (e) {
        showErrors({config: [`config.json is not valid JSON: ${e.message}`]});
        return;
      }
    }
    const button = document.getElementById("mv-submit");
    button.disabled = true;
    showErrors({});
    document.getElementById("mv-result").textContent = "Reading the architecture and checking the weights…";
    const result = await Ferry.api("POST", "/api/v1/model-versions/", body);
    button.disabled = false;
    if (result.ok) {
      location.assign(`/model-versions/?registered=${result.data.id}`);
      return;
    }
    if (result.status === 400 && result.data) showErrors(result.data);
    else showErrors({detail: [Ferry.errorText(result)]});
  });

  const registered = new URLSearchParams(location.search).get("registered");
  const row = registered && document.querySelector(`#model-versions tr[data-model-version="${CSS.escape(registered)}"]`);
  if (row) {
    row.classList.add("registered");
    const label = row.cells[0].textContent;
    document.getElementById("mv-result").textContent = `Registered ${label}.`;
  }
})();
