/* KV traffic over a cluster link, from the pools' latest signals (the fleet stream's telemetry.fleet records):
   shared by the fleet page's topology and links table and by the link page. A link's KV leaves its source
   cluster from that cluster's prefill pools: their wire bytes/s are the link's live throughput. */
"use strict";

const FerryLinks = {
  /* Live KV over a link measured at `senderIds` (pool ids) from `signals` (pool id -> signals).
     Returns {bytesPerS, failureRate, answered}: bytesPerS sums kv_transfer_bytes_per_s; a sender whose workers
     answer (request_rate_per_s is a number: workers export their request counters from the start) but never
     sent KV counts 0, so an idle link reads 0, not "no data"; null only when no sender answers. failureRate is
     the worst sender's kv_transfer_failure_rate (0..1), null when nothing was transferred in the window. */
  live(senderIds, signals) {
    let bytesPerS = null, answered = 0;
    const failures = [];
    for (const id of senderIds) {
      const s = signals[id];
      if (!s) continue;
      const bytes = s.kv_transfer_bytes_per_s;
      if (typeof s.request_rate_per_s !== "number" && typeof bytes !== "number") continue;
      answered += 1;
      bytesPerS = (bytesPerS ?? 0) + (typeof bytes === "number" ? bytes : 0);
      if (typeof s.kv_transfer_failure_rate === "number") failures.push(s.kv_transfer_failure_rate);
    }
    return {bytesPerS, failureRate: failures.length ? Math.max(...failures) : null, answered};
  },

  /* Throughput as a fraction of the configured bandwidth (Gbit/s), 0 when unknown. */
  utilization(bytesPerS, bandwidthGbps) {
    return bytesPerS && bandwidthGbps ? (bytesPerS * 8) / (bandwidthGbps * 1e9) : 0;
  },

  /* Bytes/s as Gbit/s (Mbit/s or kbit/s when small); exactly 0 reads "0 Gbit/s"; null reads "no data". */
  fmtRate(bytesPerS) {
    if (bytesPerS === null || bytesPerS === undefined) return "no data";
    const bits = bytesPerS * 8;
    if (bits === 0) return "0 Gbit/s";
    if (bits >= 1e8) return `${(bits / 1e9).toFixed(2)} Gbit/s`;
    if (bits >= 1e5) return `${(bits / 1e6).toFixed(2)} Mbit/s`;
    return `${(bits / 1e3).toFixed(1)} kbit/s`;
  },

  fmtPercent(ratio, digits = 1) {
    return ratio === null || ratio === undefined ? "no transfers" : `${(ratio * 100).toFixed(digits)}%`;
  },

  /* Edge colour by utilization: green below 50%, amber below 80%, red above; grey without data. */
  colour(util, hasData) {
    if (!hasData) return "#98a2b3";
    return util < 0.5 ? "#12b76a" : util < 0.8 ? "#f79009" : "#d92d20";
  },

  NO_TRAFFIC: "no traffic yet: `make run LOAD=1` or send a long prompt to the router",
};
