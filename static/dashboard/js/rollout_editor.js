/* Rollout editor: steps and gates built with controls, the same plan as JSON in an "Advanced" view.

   One plan object ({steps, gates}) is the truth; the controls and the two JSON textareas (#rc-steps, #rc-gates)
   are views of it: every control edit rewrites the JSON, and leaving the JSON view parses it back (invalid JSON
   keeps you there with the parser's message). Keys the controls do not show (an analysis step's own gates) are
   kept as they are. The editor checks nothing itself: the page asks the server (POST /api/v1/rollouts/preview/,
   the create serializer and service checks, then the controller's replica math) and shows its messages next to
   the step or gate they name ("Step 2: ...", "Gate 1: ..."). */
"use strict";

class RolloutEditor {
  /* choices: the page's rollout_form data (gate_signals, comparisons, gate_roles); onChange(): called after
     every edit of the plan. */
  constructor(choices, onChange) {
    this.choices = choices;
    this.onChange = onChange;
    this.stepsText = document.getElementById("rc-steps");
    this.gatesText = document.getElementById("rc-gates");
    this.plan = {steps: [], gates: []};
    this.mode = "form";
    const parsed = this.parseJson();
    if (parsed.ok) this.plan = parsed.plan;
    this.units = Object.fromEntries(choices.gate_signals.map(s => [s.name, s.unit]));

    document.getElementById("rc-add-weight").addEventListener("click", () => this.add({set_weight: this.lastWeight()}));
    document.getElementById("rc-add-pause").addEventListener("click", () => this.add({pause: {seconds: 30}}));
    document.getElementById("rc-add-analysis").addEventListener("click", () => this.add({analysis: {duration_s: 60}}));
    document.getElementById("rc-add-gate").addEventListener("click", () => {
      const signal = choices.gate_signals[0] ? choices.gate_signals[0].name : "error_rate";
      this.plan.gates.push({signal, comparison: "<", threshold: 0.05, window_s: 30, failure_limit: 0});
      this.changed(true);
    });
    document.getElementById("rc-mode-form").addEventListener("click", () => this.showForm());
    document.getElementById("rc-mode-json").addEventListener("click", () => this.showJson());
    for (const area of [this.stepsText, this.gatesText]) {
      area.addEventListener("input", () => {  // typed JSON counts as soon as it parses
        const result = this.parseJson();
        document.getElementById("rc-json-error").textContent = result.ok ? "" : result.error;
        if (result.ok) { this.plan = result.plan; this.onChange(); }
      });
    }
    this.render();
  }

  lastWeight() {
    const weights = this.plan.steps.filter(s => s && "set_weight" in s).map(s => s.set_weight);
    const last = weights.length ? Number(weights[weights.length - 1]) : 0;
    return Number.isFinite(last) ? Math.min(100, last + 25) : 25;
  }

  add(step) { this.plan.steps.push(step); this.changed(true); }

  parseJson() {
    try {
      return {ok: true, plan: {steps: JSON.parse(this.stepsText.value), gates: JSON.parse(this.gatesText.value)}};
    } catch (e) {
      return {ok: false, error: `Not valid JSON: ${e.message}`};
    }
  }

  writeJson() {
    this.stepsText.value = JSON.stringify(this.plan.steps);
    this.gatesText.value = JSON.stringify(this.plan.gates);
  }

  changed(rerender) {
    this.writeJson();
    if (rerender) this.render();
    this.onChange();
  }

  showJson() {
    this.writeJson();
    this.setMode("json");
  }

  showForm() {
    const result = this.parseJson();
    document.getElementById("rc-json-error").textContent = result.ok ? "" : `${result.error} (fix it to go back to the editor)`;
    if (!result.ok) return;
    if (!Array.isArray(result.plan.steps) || !Array.isArray(result.plan.gates)) {
      document.getElementById("rc-json-error").textContent = "Steps and gates must each be a JSON list to edit them here.";
      return;
    }
    this.plan = result.plan;
    this.render();
    this.setMode("form");
  }

  setMode(mode) {
    this.mode = mode;
    document.getElementById("rc-builder").hidden = mode !== "form";
    document.getElementById("rc-json").hidden = mode !== "json";
    for (const [id, m] of [["rc-mode-form", "form"], ["rc-mode-json", "json"]]) {
      const tab = document.getElementById(id);
      tab.classList.toggle("active", mode === m);
      tab.setAttribute("aria-selected", String(mode === m));
    }
  }

  /* A number input's value as the plan stores it: a number when it is one, else the text as typed (the server
     says what is wrong with it). */
  static number(input) {
    return Number.isFinite(input.valueAsNumber) ? input.valueAsNumber : input.value;
  }

  stepRow(step, i) {
    const el = Ferry.el;
    const li = el("li", {"data-index": i, class: "step-row"});
    const kind = step && typeof step === "object" ? Object.keys(step)[0] : undefined;
    const controls = el("span", {class: "step-controls"});
    if (kind === "set_weight") {
      const slider = el("input", {type: "range", min: 0, max: 100, step: 1, class: "step-weight-slider",
        "aria-label": `step ${i + 1} weight`});
      const box = el("input", {type: "number", min: 0, max: 100, step: 1, class: "step-weight",
        "aria-label": `step ${i + 1} weight percent`});
      slider.value = box.value = step.set_weight;
      slider.addEventListener("input", () => { box.value = slider.value; step.set_weight = Number(slider.value); this.changed(false); });
      box.addEventListener("input", () => { slider.value = box.value; step.set_weight = RolloutEditor.number(box); this.changed(false); });
      controls.append("set weight ", slider, " ", box, " % of traffic to the new version");
    } else if (kind === "pause") {
      const until = el("select", {class: "step-pause-kind", "aria-label": `step ${i + 1} pause`},
        el("option", {value: "seconds"}, "for"), el("option", {value: "resume"}, "until resumed (or promoted)"));
      const seconds = el("input", {type: "number", min: 1, step: 1, class: "step-pause-seconds",
        "aria-label": `step ${i + 1} pause seconds`});
      const timed = "seconds" in (step.pause || {});
      until.value = timed ? "seconds" : "resume";
      seconds.value = timed ? step.pause.seconds : 30;
      seconds.hidden = !timed;
      const unit = el("span", {class: "unit"}, "s");
      unit.hidden = !timed;
      until.addEventListener("change", () => {
        step.pause = until.value === "seconds" ? {seconds: RolloutEditor.number(seconds)} : {};
        seconds.hidden = unit.hidden = until.value !== "seconds";
        this.changed(false);
      });
      seconds.addEventListener("input", () => { step.pause = {seconds: RolloutEditor.number(seconds)}; this.changed(false); });
      controls.append("pause ", until, " ", seconds, " ", unit);
    } else if (kind === "analysis") {
      const arg = step.analysis || {};
      const duration = el("input", {type: "number", min: 1, step: 1, class: "step-analysis-duration",
        placeholder: "until the gates pass", "aria-label": `step ${i + 1} analysis seconds`});
      duration.value = "duration_s" in arg ? arg.duration_s : "";
      duration.addEventListener("input", () => {
        if (duration.value === "") delete step.analysis.duration_s; else step.analysis.duration_s = RolloutEditor.number(duration);
        this.changed(false);
      });
      const own = Array.isArray(arg.gates) && arg.gates.length;
      controls.append("analysis for ", duration, " s, with ",
        own ? `its own ${arg.gates.length} gate(s) (edit them in Advanced)` : "the plan's gates below");
    } else {
      controls.append(el("code", {}, JSON.stringify(step)), " (edit in Advanced)");
    }
    const move = (to) => {
      const [item] = this.plan.steps.splice(i, 1);
      this.plan.steps.splice(to, 0, item);
      this.changed(true);
    };
    const up = el("button", {type: "button", class: "step-up", title: "move up", onclick: () => move(i - 1)}, "↑");
    const down = el("button", {type: "button", class: "step-down", title: "move down", onclick: () => move(i + 1)}, "↓");
    up.disabled = i === 0;
    down.disabled = i === this.plan.steps.length - 1;
    const remove = el("button", {type: "button", class: "step-remove", title: "remove this step",
      onclick: () => { this.plan.steps.splice(i, 1); this.changed(true); }}, "remove");
    li.append(controls, el("span", {class: "row-buttons"}, up, down, remove), el("div", {class: "row-error"}));
    return li;
  }

  gateRow(gate, i) {
    const el = Ferry.el;
    const signal = el("select", {class: "gate-signal", "aria-label": `gate ${i + 1} signal`},
      ...this.choices.gate_signals.map(s => el("option", {value: s.name}, `${s.name} (${s.telemetry_signal})`)));
    if (!this.choices.gate_signals.some(s => s.name === gate.signal)) signal.append(el("option", {value: gate.signal}, String(gate.signal)));
    signal.value = gate.signal;
    const comparison = el("select", {class: "gate-comparison", "aria-label": `gate ${i + 1} comparison`},
      ...this.choices.comparisons.map(c => el("option", {value: c}, `value ${c} threshold`)));
    comparison.value = gate.comparison;
    const threshold = el("input", {type: "number", step: "any", class: "gate-threshold", "aria-label": `gate ${i + 1} threshold`});
    threshold.value = gate.threshold;
    const unit = el("span", {class: "unit gate-unit"}, this.units[gate.signal] || "");
    const windowS = el("input", {type: "number", min: 1, step: 1, class: "gate-window", "aria-label": `gate ${i + 1} window seconds`});
    windowS.value = gate.window_s;
    const limit = el("input", {type: "number", min: 0, step: 1, class: "gate-failure-limit", "aria-label": `gate ${i + 1} failure limit`});
    limit.value = "failure_limit" in gate ? gate.failure_limit : 0;
    const relative = el("input", {type: "checkbox", class: "gate-relative", title: "compare new / stable instead of the raw value"});
    relative.checked = gate.relative_to_stable === true;
    const role = el("select", {class: "gate-role", "aria-label": `gate ${i + 1} pools`}, el("option", {value: ""}, "serving pools"),
      ...this.choices.gate_roles.map(r => el("option", {value: r}, r)));
    role.value = gate.role || "";
    const set = (key, value) => { gate[key] = value; this.changed(false); };
    signal.addEventListener("change", () => { unit.textContent = this.units[signal.value] || ""; set("signal", signal.value); });
    comparison.addEventListener("change", () => set("comparison", comparison.value));
    threshold.addEventListener("input", () => set("threshold", RolloutEditor.number(threshold)));
    windowS.addEventListener("input", () => set("window_s", RolloutEditor.number(windowS)));
    limit.addEventListener("input", () => set("failure_limit", RolloutEditor.number(limit)));
    relative.addEventListener("change", () => {
      if (relative.checked) gate.relative_to_stable = true; else delete gate.relative_to_stable;
      this.changed(false);
    });
    role.addEventListener("change", () => {
      if (role.value) gate.role = role.value; else delete gate.role;
      this.changed(false);
    });
    const remove = el("button", {type: "button", class: "gate-remove", onclick: () => { this.plan.gates.splice(i, 1); this.changed(true); }}, "remove");
    return el("tr", {"data-index": i, class: "gate-row"}, el("td", {}, String(i + 1)), el("td", {}, signal), el("td", {}, comparison),
      el("td", {}, threshold, " ", unit), el("td", {}, windowS), el("td", {}, limit),
      el("td", {}, el("label", {}, relative, " ratio")), el("td", {}, role), el("td", {}, remove));
  }

  render() {
    const steps = Array.isArray(this.plan.steps) ? this.plan.steps : [];
    const gates = Array.isArray(this.plan.gates) ? this.plan.gates : [];
    document.getElementById("rc-step-list").replaceChildren(...steps.map((s, i) => this.stepRow(s, i)));
    const rows = gates.map((g, i) => this.gateRow(g, i));
    if (!rows.length) rows.push(Ferry.el("tr", {class: "empty"}, Ferry.el("td", {colspan: 9},
      "No gates: analysis steps pass at once. Add one, e.g. error_rate < 0.05 over 30 s.")));
    document.querySelector("#rc-gate-list tbody").replaceChildren(...rows);
  }

  /* The plan as the create request carries it; in the JSON view, what the textareas hold (null: not JSON). */
  current() {
    if (this.mode === "json") {
      const result = this.parseJson();
      return result.ok ? result.plan : null;
    }
    return this.plan;
  }

  /* Show the server's messages for steps and gates (DRF field errors, lists of strings), and mark the rows
     they name ("Step 3: ...", "Gate 1: ..."; an analysis step's gate counts against its step). */
  showErrors(errors) {
    document.querySelectorAll("#rc-editor .invalid").forEach(n => n.classList.remove("invalid"));
    document.querySelectorAll("#rc-editor .row-error").forEach(n => { n.textContent = ""; });
    for (const [field, listId, word] of [["steps", "rc-step-list", "Step"], ["gates", "rc-gate-list", "Gate"]]) {
      const messages = (errors && errors[field]) || [];
      document.getElementById(`rc-${field}-error`).textContent = messages.join(" ");
      for (const message of messages) {
        const match = new RegExp(`^${word} (\\d+)`).exec(message);
        const row = match && document.querySelector(`#${listId} [data-index="${Number(match[1]) - 1}"]`);
        if (!row) continue;
        row.classList.add("invalid");
        const slot = row.querySelector(".row-error");
        if (slot) slot.textContent = message;
      }
    }
  }
}
