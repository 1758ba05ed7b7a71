/* Alerts page: firing and resolved alerts with rule, value, threshold and duration, live from ws/fleet/
   (telemetry.alert messages, also sent when an alert is acknowledged or silenced). Operators acknowledge,
   silence for a period and end a silence through /api/v1/alerts/<id>/{acknowledge,silence,unsilence}/. */
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("alerts-data").textContent);
  const alerts = {};   // id -> payload (+ pool_name)
  const poolNames = {};
  data.alerts.forEach(a => { alerts[a.id] = a; poolNames[a.pool_id] = a.pool_name; });

  function fmtDuration(seconds) {
    seconds = Math.max(0, Math.round(seconds));
    const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
    return h ? `${h} h ${m} min` : m ? `${m} min ${s} s` : `${s} s`;
  }
  function fmtChoice(seconds) { return seconds >= 3600 ? `${seconds / 3600} h` : `${seconds / 60} min`; }
  function silenced(a) { return a.silenced_until && new Date(a.silenced_until) > new Date(); }

  function status(a) {
    const parts = [];
    if (a.acknowledged_at) parts.push(Ferry.el("span", {class: "badge ack", title: a.acknowledged_at}, `acknowledged by ${a.acknowledged_by || "?"}`));
    if (silenced(a)) parts.push(Ferry.el("span", {class: "badge silenced", title: a.silenced_until}, `silenced until ${Ferry.fmtTime(a.silenced_until)}`));
    if (!parts.length) parts.push(Ferry.el("span", {class: "muted"}, a.state === "firing" ? "unacknowledged" : "—"));
    return Ferry.el("td", {class: "alert-status"}, ...parts);
  }

  async function verb(a, name, body) {
    const result = await Ferry.api("POST", `/api/v1/alerts/${a.id}/${name}/`, body);
    const out = document.getElementById("alert-result");
    if (result.ok) {
      // The API's alert (AlertSerializer) names the rule by id: overlay only the state it changed.
      const {state, ended_at, acknowledged_at, acknowledged_by, silenced_until} = result.data;
      alerts[a.id] = {...alerts[a.id], state, ended_at, acknowledged_at, acknowledged_by, silenced_until};
      out.textContent = `${a.rule} on ${a.pool_name}: ${name === "acknowledge" ? "acknowledged" : name === "silence" ? "silenced" : "silence ended"}.`;
      render();
    } else out.textContent = `${name} failed: ${Ferry.errorText(result)}`;
  }

  function controls(a) {
    const td = Ferry.el("td", {class: "alert-controls"});
    if (!a.acknowledged_at) td.append(Ferry.el("button", {type: "button", class: "ack", onclick: () => verb(a, "acknowledge")}, "Acknowledge"));
    if (silenced(a)) {
      td.append(Ferry.el("button", {type: "button", class: "unsilence", onclick: () => verb(a, "unsilence")}, "End silence"));
    } else {
      const select = Ferry.el("select", {class: "silence-for", "aria-label": "silence for"},
        ...data.silence_choices_s.map(s => Ferry.el("option", {value: s}, fmtChoice(s))));
      select.value = "3600";
      td.append(select, Ferry.el("button", {type: "button", class: "silence",
        onclick: () => verb(a, "silence", {duration_s: Number(select.value)})}, "Silence"));
    }
    return td;
  }

  function valueCell(a) { return `${Ferry.fmt(a.value)} (${a.comparison} ${a.threshold})`; }

  function render() {
    const now = Date.now();
    const list = Object.values(alerts);
    const firing = list.filter(a => a.state === "firing").sort((x, y) => y.started_at.localeCompare(x.started_at));
    const resolved = list.filter(a => a.state !== "firing").sort((x, y) => (y.ended_at || "").localeCompare(x.ended_at || "")).slice(0, 100);
    const f = document.querySelector("#alerts-firing tbody");
    f.replaceChildren(...firing.map(a => Ferry.el("tr", {"data-alert-id": a.id, class: silenced(a) ? "silenced" : ""},
      Ferry.el("td", {}, a.rule), Ferry.el("td", {}, Ferry.el("a", {href: `/pools/${a.pool_id}/`}, a.pool_name || `pool ${a.pool_id}`)),
      Ferry.el("td", {}, Ferry.el("span", {class: `badge alert-${a.severity}`}, a.severity)), Ferry.el("td", {}, valueCell(a)),
      Ferry.el("td", {class: "duration", "data-since": a.started_at}, fmtDuration((now - new Date(a.started_at)) / 1000)),
      Ferry.el("td", {}, Ferry.fmtTime(a.started_at)), status(a), ...(Ferry.canOperate ? [controls(a)] : []))));
    if (!firing.length) {
      f.replaceChildren(Ferry.el("tr", {}, Ferry.el("td", {colspan: Ferry.canOperate ? 8 : 7, class: "muted"},
        "No alerts firing. Rules and thresholds are in the admin (Alert rules); under load (`make run LOAD=1`) the CPU profile's rules can fire.")));
    }
    const r = document.querySelector("#alerts-resolved tbody");
    r.replaceChildren(...resolved.map(a => Ferry.el("tr", {"data-alert-id": a.id},
      Ferry.el("td", {}, a.rule), Ferry.el("td", {}, Ferry.el("a", {href: `/pools/${a.pool_id}/`}, a.pool_name || `pool ${a.pool_id}`)),
      Ferry.el("td", {}, a.severity), Ferry.el("td", {}, valueCell(a)),
      Ferry.el("td", {}, fmtDuration((new Date(a.ended_at) - new Date(a.started_at)) / 1000)),
      Ferry.el("td", {}, Ferry.fmtTime(a.started_at)), Ferry.el("td", {}, Ferry.fmtTime(a.ended_at)), status(a))));
    if (!resolved.length) r.replaceChildren(Ferry.el("tr", {}, Ferry.el("td", {colspan: 8, class: "muted"}, "No resolved alerts yet.")));
  }

  new FerryStream("/ws/fleet/", (msg) => {
    if (msg.type === "snapshot") {
      // The snapshot lists the firing alerts: one no longer in it has resolved while the page was away.
      if (msg.overview) msg.overview.datacenters.forEach(dc => dc.clusters.forEach(c => c.pools.forEach(p => { poolNames[p.id] = p.name; })));
      msg.alerts.forEach(a => { alerts[a.id] = {...a, pool_name: poolNames[a.pool_id]}; });
    } else if (msg.type === "telemetry.alert") {
      alerts[msg.alert.id] = {...msg.alert, pool_name: poolNames[msg.alert.pool_id]};
    } else return;
    render();
  });
  render();
  setInterval(() => document.querySelectorAll("#alerts-firing td.duration").forEach(td => {
    td.textContent = fmtDuration((Date.now() - new Date(td.dataset.since)) / 1000);
  }), 1000);
})();
