/* Ferry dashboard: websocket streams with sequence-gap resync, REST calls with the session + CSRF token,
   and small formatting helpers. Loaded by every page before the page's own script. */
"use strict";

window.ferryStats = {messages: 0, snapshots: 0, gaps: 0, resyncs: 0, reconnects: 0, lastSeq: {}};

const Ferry = {
  canOperate: document.body.dataset.canOperate === "1",

  csrfToken() {
    const input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  },

  /* Call the public REST API (/api/v1/...) as the signed-in user. Resolves to {ok, status, data}. */
  async api(method, url, body) {
    const init = {method, credentials: "same-origin", headers: {"Accept": "application/json"}};
    if (method !== "GET") {
      init.headers["Content-Type"] = "application/json";
      init.headers["X-CSRFToken"] = Ferry.csrfToken();
      if (body !== undefined) init.body = JSON.stringify(body);
    }
    const response = await fetch(url, init);
    let data = null;
    try { data = await response.json(); } catch (e) { data = null; }
    return {ok: response.ok, status: response.status, data};
  },

  /* A human-readable error from a DRF error body. */
  errorText(result) {
    if (!result.data) return `HTTP ${result.status}`;
    if (typeof result.data.detail === "string") return result.data.detail;
    // Nested serializers answer {field: {inner: [...]}}: name each leaf "field.inner".
    const flat = (prefix, value) => Array.isArray(value) ? [`${prefix}: ${value.join(" ")}`]
      : value && typeof value === "object"
        ? Object.entries(value).flatMap(([k, v]) => flat(prefix ? `${prefix}.${k}` : k, v))
        : [`${prefix}: ${value}`];
    return flat("", result.data).join("; ");
  },

  el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(child ?? ""));
    return node;
  },

  fmt(value, digits = 3) {
    if (value === null || value === undefined || Number.isNaN(value)) return "no data";
    if (Math.abs(value) >= 1000) return value.toFixed(0);
    return Number(value.toPrecision(digits)).toString();
  },

  fmtBytesPerS(value) {
    if (value === null || value === undefined) return "no data";
    const bits = value * 8;
    if (bits >= 1e9) return `${(bits / 1e9).toFixed(2)} Gbit/s`;
    if (bits >= 1e6) return `${(bits / 1e6).toFixed(2)} Mbit/s`;
    return `${(bits / 1e3).toFixed(1)} kbit/s`;
  },

  /* An empty time chart's x axis: the last `windowS` seconds up to now (Plotly's default for a date axis
     without data is a range in the year 2000), as Plotly layout updates ("xaxis.range"). */
  emptyTimeAxis(windowS) {
    const now = Date.now();
    return {"xaxis.autorange": false, "xaxis.range": [new Date(now - windowS * 1000), new Date(now)]};
  },

  /* The "no data yet" note in the middle of an empty chart (a Plotly annotation). */
  NO_DATA: [{text: "no data yet", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
    font: {size: 16, color: "#98a2b3"}}],

  fmtTime(iso) { return iso ? new Date(iso).toLocaleTimeString() : ""; },

  /* Alert badges: {alert id -> payload} of firing alerts, rendered into `container`. */
  renderAlerts(container, alerts) {
    container.replaceChildren(...Object.values(alerts).map(a => Ferry.el("span",
      {class: `badge alert-${a.severity}`, title: `${a.signal} ${a.comparison} ${a.threshold} (value ${Ferry.fmt(a.value)})`},
      a.rule)));
    if (!Object.keys(alerts).length) container.append(Ferry.el("span", {class: "badge ok"}, "no alerts"));
  },

  applyAlert(alerts, alert) {
    if (alert.state === "firing") alerts[alert.id] = alert; else delete alerts[alert.id];
  },
};

/* One websocket to `path` carrying one or more streams. Each stream's messages carry `seq`; a snapshot sets
   the stream's last seq, older messages are dropped, and a skipped number asks the server for a snapshot
   ({"type": "resync", "stream": ...}); messages of that stream are ignored until the snapshot arrives.
   A dropped last message has no successor to reveal the gap: every SEQ_CHECK_MS the client asks for each
   stream's last number ({"type": "seq"}) and resyncs a stream that is behind. */
const SEQ_CHECK_MS = 5000;

class FerryStream {
  constructor(path, onMessage) {
    this.path = path;
    this.onMessage = onMessage;
    this.lastSeq = window.ferryStats.lastSeq;
    this.pending = {};
    this.streams = new Set();  // the streams this socket carries (learnt from their snapshots)
    this.retryMs = 500;
    this.setStatus("connecting");  // the badge is hidden on pages without a stream: they are not "offline"
    this.connect();
    setInterval(() => this.checkSeq(), SEQ_CHECK_MS);
  }

  checkSeq() {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return;
    for (const stream of this.streams) {
      if (!this.pending[stream] && this.lastSeq[stream] !== undefined) this.ws.send(JSON.stringify({type: "seq", stream}));
    }
  }

  connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    this.ws = new WebSocket(`${scheme}://${location.host}${this.path}`);
    this.ws.onopen = () => { this.setStatus("live"); this.retryMs = 500; };
    this.ws.onmessage = (event) => this.receive(JSON.parse(event.data));
    this.ws.onclose = () => {
      this.setStatus("offline");
      window.ferryStats.reconnects += 1;
      setTimeout(() => this.connect(), this.retryMs);  // the new connection starts with snapshots
      this.retryMs = Math.min(this.retryMs * 2, 10000);
    };
  }

  setStatus(text) {
    const node = document.getElementById("ws-status");
    if (node) { node.textContent = text; node.className = `ws-status ws-${text}`; node.hidden = false; }
  }

  resync(stream) {
    this.pending[stream] = true;
    window.ferryStats.resyncs += 1;
    this.ws.send(JSON.stringify({type: "resync", stream}));
  }

  receive(msg) {
    window.ferryStats.messages += 1;
    const stream = msg.stream;
    if (msg.type === "seq") {  // the answer to checkSeq: behind means a message was lost
      const last = this.lastSeq[stream];
      if (!this.pending[stream] && last !== undefined && msg.seq > last) {
        window.ferryStats.gaps += 1;
        this.resync(stream);
      }
      return;
    }
    if (msg.type === "snapshot") {
      window.ferryStats.snapshots += 1;
      this.streams.add(stream);
      this.pending[stream] = false;
      if (msg.seq !== null && msg.seq !== undefined) this.lastSeq[stream] = msg.seq;
      this.onMessage(msg);
      return;
    }
    if (msg.seq === undefined || msg.seq === null) { this.onMessage(msg); return; }
    if (this.pending[stream]) return;
    const last = this.lastSeq[stream];
    if (last !== undefined && msg.seq <= last) return;  // already in the snapshot
    if (last !== undefined && msg.seq > last + 1) {
      window.ferryStats.gaps += 1;
      this.resync(stream);
      return;
    }
    this.lastSeq[stream] = msg.seq;
    this.onMessage(msg);
  }
}
