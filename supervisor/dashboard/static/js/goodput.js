// Goodput per job (GET /api/v1/jobs/{job}/goodput) with a chart of goodput and badput
// over time, and checkpoint advice (GET /api/v1/jobs/{job}/advice).

import { api, query } from "./api.js";
import { $, debounce, h, replaceChildren, s, setOptions } from "./dom.js";
import { clock, duration, percent } from "./format.js";

// The figure moves slowly between incidents; what changes it (the job's events and
// actions, from the live stream) refreshes it within a moment. Reading it every few
// seconds from each open tab cost a large job's supervisor more than all its nodes' views.
const REFRESH_MS = 30000;
const RETRY_MS = 2000;
const POINTS = 24;

/** Badput causes, in the order they are stacked, with their labels and colours. */
export const CAUSES = [
  ["lost_progress_s", "lost progress", "#b42318"],
  ["detection_s", "detection", "#e8590c"],
  ["remediation_s", "remediation", "#f59f00"],
  ["restart_s", "restart", "#9c36b5"],
  ["checkpoint_save_s", "checkpoint saves", "#1c7ed6"],
  ["reduced_capacity_s", "fewer replicas", "#0b7285"],
  ["idle_s", "idle", "#868e96"],
];
const PRODUCTIVE = "#2b8a3e";

export class Goodput {
  constructor() {
    this.select = $("#goodput-job");
    this.panel = $("#goodput");
    this.advicePanel = $("#advice");
    this.job = "";
    this.sizing = {};
    this.timer = null;
    this.generation = 0;
    this.state = null; // the job's state (GET /api/v1/jobs/{job})
    this.select.addEventListener("change", () => {
      this.job = this.select.value;
      this.load();
    });
    this.soon = debounce(() => this.load(), 1500);
    // Built once: redrawing the panels must not wipe what someone is typing.
    $("#sizing").replaceChildren(this.sizingForm());
  }

  setJobs(jobs) {
    const names = jobs.map((j) => j.name);
    setOptions(this.select, names.map((n) => [n, n]));
    if (!names.length) {
      this.job = "";
      this.panel.replaceChildren(h("p", { class: "summary" }, "No job yet."));
      this.advicePanel.replaceChildren();
      return;
    }
    if (!names.includes(this.job)) {
      this.job = this.select.value || names[0];
      this.select.value = this.job;
      this.load();
    }
  }

  /** Something happened to `job`: refresh a little later (events come in bursts). */
  onEvent(item) {
    if (this.job && item.job === this.job) this.soon();
  }

  async load() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.load(), REFRESH_MS);
    if (!this.job || document.hidden) return; // a hidden tab costs the server nothing
    const job = this.job;
    const generation = ++this.generation;
    const name = encodeURIComponent(job);
    const [goodput, advice, view] = await Promise.allSettled([
      api(`/api/v1/jobs/${name}/goodput${query({ points: POINTS })}`),
      api(`/api/v1/jobs/${name}/advice${query(this.sizing)}`),
      api(`/api/v1/jobs/${name}`),
    ]);
    if (generation !== this.generation) return;
    const reason = view.status === "fulfilled" ? view.value.given_up_reason : null;
    this.state = view.status === "fulfilled" ? view.value.state + (reason ? `: ${reason}` : "") : null;
    const open = new Set([...document.querySelectorAll("#goodput-section details[open]")].map((d) => d.dataset.key));
    if (goodput.status === "fulfilled") this.renderGoodput(goodput.value);
    else {
      this.panel.replaceChildren(h("p", { class: "error" }, `Could not compute goodput: ${goodput.reason.message}`));
      // A failed request (the server busy, a connection dropped) is asked again soon, not
      // left on screen until the next refresh.
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.load(), RETRY_MS);
    }
    if (advice.status === "fulfilled") this.renderAdvice(advice.value);
    else this.renderAdviceError(advice.reason.message);
    for (const details of document.querySelectorAll("#goodput-section details")) {
      details.open = open.has(details.dataset.key);
    }
  }

  renderGoodput(g) {
    const rows = [
      ["productive", g.productive_s, PRODUCTIVE],
      ...CAUSES.map(([key, label, colour]) => [label, g.badput[key], colour]),
    ];
    const breakdown = h(
      "table",
      { class: "kv breakdown" },
      h("caption", { class: "visually-hidden" }, "Where the wall time went"),
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Time spent"), h("th", { scope: "col" }, "Seconds"), h("th", { scope: "col" }, "Share"))),
      h(
        "tbody",
        {},
        rows.map(([label, secs, colour]) =>
          h(
            "tr",
            {},
            h("th", { scope: "row" }, swatch(colour), label),
            h("td", { class: "num" }, secs.toFixed(1)),
            h("td", { class: "num" }, g.wall_s ? percent(secs / g.wall_s) : "—"),
          ),
        ),
      ),
    );
    const facts = h(
      "table",
      { class: "kv" },
      h("caption", { class: "visually-hidden" }, "Figures of the job"),
      h(
        "tbody",
        {},
        fact("State", this.state ?? "—"),
        fact("Wall time", duration(g.wall_s)),
        fact("Failures", g.failures),
        fact("Starts", g.attempts),
        fact("Last step", g.last_step ?? "—"),
        fact("Steps kept / redone", `${g.steps_kept} / ${g.steps_redone}`),
        fact("Step time", g.step_time_s === null ? "—" : duration(g.step_time_s)),
        fact("Downtime per failure", g.downtime_per_failure_s === null ? "—" : duration(g.downtime_per_failure_s)),
      ),
    );
    const notes = g.notes.length ? h("ul", { class: "summary" }, g.notes.map((n) => h("li", {}, n))) : null;
    this.panel.replaceChildren(
      h(
        "div",
        { class: "goodput-body" },
        h(
          "div",
          {},
          h("p", { class: "figure-big", id: "goodput-figure" }, `Goodput ${percent(g.goodput)}`),
          h("p", { class: "summary" }, `Productive time over wall time since ${clock(new Date(g.start))}; badput ${duration(g.badput_total_s)}.`),
          chart(g),
          notes,
        ),
        h("div", {}, h("h3", {}, "Badput breakdown"), breakdown, h("h3", {}, "Figures"), facts),
      ),
      h("h3", {}, "Checkpoint tiers"),
      h("div", { class: "table-wrap" }, tierTable(g.tiers)),
    );
  }

  renderAdviceError(message) {
    this.advicePanel.replaceChildren(
      h("h3", {}, "Checkpoint advice"),
      h("p", { class: "summary" }, `No advice: ${message}`),
    );
  }

  renderAdvice(a) {
    const interval = (steps, secs) =>
      steps === null && secs === null ? "—" : `${steps ?? "?"} steps${secs === null ? "" : ` (${duration(secs)})`}`;
    const tiers = h(
      "table",
      { class: "advice-tiers" },
      h("caption", { class: "visually-hidden" }, "Checkpoint interval per tier"),
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          ["Tier", "Save cost", "MTBF", "Current interval", "Recommended interval", "Waste now", "Waste at recommended"].map((t) =>
            h("th", { scope: "col" }, t),
          ),
        ),
      ),
      h(
        "tbody",
        {},
        a.tiers.length
          ? a.tiers.map((t) =>
              h(
                "tr",
                {},
                h("th", { scope: "row" }, t.name),
                h("td", { class: "num" }, duration(t.save_cost_s)),
                h("td", { class: "num" }, t.mtbf_s === null ? "—" : duration(t.mtbf_s)),
                h("td", {}, interval(t.current_interval_steps, t.current_interval_s)),
                h("td", {}, interval(t.recommended_interval_steps, t.recommended_interval_s)),
                h("td", { class: "num" }, percent(t.waste_current)),
                h("td", { class: "num" }, percent(t.waste_recommended)),
              ),
            )
          : h("tr", { class: "empty" }, h("td", { colspan: 7 }, "No checkpoint tier measured yet.")),
      ),
    );
    const expected =
      a.expected_goodput_current === null && a.expected_goodput_recommended === null
        ? null
        : h(
            "p",
            { id: "advice-expected" },
            `Expected goodput: ${percent(a.expected_goodput_current)} at the current intervals, ` +
              `${percent(a.expected_goodput_recommended)} at the recommended ones ` +
              `(measured so far: ${percent(a.measured_goodput)}).`,
          );
    const mtbf = a.observed.mtbf_s === null ? a.observed.note : `observed MTBF ${duration(a.observed.mtbf_s)} (${a.observed.failures} failures)`;
    replaceChildren(
      this.advicePanel,
      h("h3", {}, "Checkpoint advice"),
      h("p", { class: "summary" }, `Young/Daly intervals from the measured save costs and the failures seen: ${mtbf}.`),
      h("details", { "data-key": "model" }, h("summary", {}, "How this is computed"), h("p", { class: "summary" }, a.model)),
      a.warnings.map((w) => h("p", { class: "warning", role: "note" }, w)),
      h("div", { class: "table-wrap" }, tiers),
      expected,
      a.ramdisk
        ? h(
            "p",
            { id: "advice-ramdisk" },
            `Ramdisk per host: ${a.ramdisk.size_mib.toLocaleString()} MiB for ${Number(a.ramdisk.parameters).toExponential(2)} parameters on ${a.ramdisk.hosts} hosts ` +
              `(${a.ramdisk.bytes_per_parameter} bytes per parameter, sharded, double-buffered, +${percent(a.ramdisk.buffer, 0)}).`,
          )
        : null,
    );
  }

  /** Parameters (and hosts) for the ramdisk sizing, passed to the advice endpoint. */
  sizingForm() {
    const form = h(
      "form",
      { class: "filters", "aria-label": "Ramdisk sizing" },
      h("div", { class: "field" }, h("label", { for: "sizing-parameters" }, "Model parameters"),
        h("input", { id: "sizing-parameters", name: "parameters", inputmode: "decimal", placeholder: "e.g. 70e9", value: this.sizing.parameters ?? "" })),
      h("div", { class: "field" }, h("label", { for: "sizing-hosts" }, "Hosts"),
        h("input", { id: "sizing-hosts", name: "hosts", type: "number", min: 1, placeholder: "job's nodes", value: this.sizing.hosts ?? "" })),
      h("div", { class: "buttons" }, h("button", { type: "submit" }, "Size the ramdisk")),
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      if (!this.job) return;
      const data = new FormData(form);
      const parameters = String(data.get("parameters") ?? "").trim();
      const hosts = String(data.get("hosts") ?? "").trim();
      this.sizing = {};
      if (parameters) this.sizing.parameters = parameters; // as typed: "70e9" reads well
      if (hosts) this.sizing.hosts = hosts;
      this.load();
    });
    return form;
  }
}

function swatch(colour) {
  return s("svg", { width: 12, height: 12, "aria-hidden": "true", class: "swatch-svg" }, s("rect", { width: 12, height: 12, rx: 2, fill: colour }));
}

function fact(label, value) {
  return h("tr", {}, h("th", { scope: "row" }, label), h("td", {}, String(value)));
}

/** Seconds, with sub-second ones in ms (blocking saves are often short). */
function secs(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : duration(seconds);
}

/** "512 KiB", "1.5 GiB". */
function size(bytes) {
  if (bytes === null || bytes === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = bytes;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${i && v < 10 ? v.toFixed(1) : Math.round(v)} ${units[i]}`;
}

function rate(mibPerS) {
  return mibPerS === null || mibPerS === undefined ? "—" : `${mibPerS.toFixed(mibPerS < 10 ? 1 : 0)} MiB/s`;
}

/**
 * Per checkpoint tier: saves and loads (a load counts for the tier that served it), the
 * time they blocked training, a rank's checkpoint size and the throughput from start to
 * commit, where the workers reported them.
 */
function tierTable(tiers) {
  const head = ["Tier", "Saves", "Save blocks", "Size (rank)", "Save rate", "Loads", "Load blocks", "Load rate"];
  return h(
    "table",
    { id: "goodput-tiers" },
    h("caption", { class: "visually-hidden" }, "Checkpoints per tier"),
    h("thead", {}, h("tr", {}, head.map((t) => h("th", { scope: "col" }, t)))),
    h(
      "tbody",
      {},
      tiers.length
        ? tiers.map((t) =>
            h(
              "tr",
              { "data-tier": t.tier },
              h("th", { scope: "row" }, t.tier),
              h("td", { class: "num" }, String(t.saves)),
              h("td", { class: "num" }, secs(t.mean_save_s)),
              h("td", { class: "num" }, size(t.mean_save_bytes ?? t.mean_load_bytes)),
              h("td", { class: "num" }, rate(t.save_mib_per_s)),
              h("td", { class: "num" }, String(t.loads)),
              h("td", { class: "num" }, secs(t.mean_load_s)),
              h("td", { class: "num" }, rate(t.load_mib_per_s)),
            ),
          )
        : h("tr", { class: "empty" }, h("td", { colspan: head.length }, "No checkpoint reported yet.")),
    ),
  );
}

/**
 * One stacked bar per point of the series: the job's wall time up to that moment, split
 * into productive time and each cause of badput (the goodput as it stood then). The
 * series is recomputed as more becomes known (progress thrown away by a rollback is
 * known only once it happens), so the bars are compared, not subtracted.
 */
function chart(g) {
  const points = g.series;
  const figure = h("figure", { class: "chart" });
  if (points.length < 2) {
    figure.append(h("p", { class: "summary" }, "Not enough history for a chart yet."));
    return figure;
  }
  const width = 640;
  const height = 220;
  const left = 44;
  const right = width - 8;
  const top = 8;
  const bottom = height - 24;
  const t0 = Date.parse(points[0].time);
  const t1 = Date.parse(points[points.length - 1].time);
  const x = (t) => left + ((t - t0) / Math.max(1, t1 - t0)) * (right - left);
  const y = (fraction) => bottom - fraction * (bottom - top);
  const parts = [];
  for (const f of [0, 0.25, 0.5, 0.75, 1]) {
    parts.push(
      s("line", { x1: left, x2: right, y1: y(f), y2: y(f), class: "grid-line" }),
      s("text", { x: left - 4, y: y(f) + 4, "text-anchor": "end" }, `${f * 100}%`),
    );
  }
  const rows = [];
  for (let i = 1; i < points.length; i++) {
    const a = points[i - 1];
    const b = points[i];
    const wall = b.wall_s;
    if (wall <= 0) continue;
    const x0 = x(Date.parse(a.time));
    const w = Math.max(1, x(Date.parse(b.time)) - x0 - 1);
    const shares = [
      ["productive", b.productive_s / wall, PRODUCTIVE],
      ...CAUSES.map(([key, label, colour]) => [label, b.badput[key] / wall, colour]),
    ];
    let base = 0;
    const label = [];
    for (const [name, share, colour] of shares) {
      const v = Math.max(0, share);
      if (v > 0.0005) {
        parts.push(
          s("rect", { x: x0, y: y(Math.min(1, base + v)), width: w, height: Math.max(0, y(base) - y(Math.min(1, base + v))), fill: colour },
            s("title", {}, `Up to ${clock(new Date(b.time))}: ${name} ${percent(v)}`)),
        );
        label.push(`${name} ${percent(v)}`);
      }
      base += v;
    }
    rows.push([b.time, percent(b.goodput), label.join(", ")]);
  }
  parts.push(
    s("text", { x: left, y: height - 6 }, clock(new Date(t0))),
    s("text", { x: right, y: height - 6, "text-anchor": "end" }, clock(new Date(t1))),
  );
  const svg = s(
    "svg",
    { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-labelledby": "goodput-chart-caption", id: "goodput-chart" },
    parts,
  );
  const legend = h(
    "div",
    { class: "legend" },
    h("span", {}, swatch(PRODUCTIVE), " productive"),
    CAUSES.map(([, label, colour]) => h("span", {}, swatch(colour), ` ${label}`)),
  );
  const table = h(
    "details",
    { "data-key": "chart-data" },
    h("summary", {}, "The chart's data"),
    h(
      "table",
      {},
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Up to"), h("th", { scope: "col" }, "Goodput"), h("th", { scope: "col" }, "Wall time so far"))),
      h("tbody", {}, rows.map(([t, goodput, text]) => h("tr", {}, h("td", {}, clock(new Date(t))), h("td", { class: "num" }, goodput), h("td", {}, text)))),
    ),
  );
  figure.append(
    svg,
    legend,
    h("figcaption", { id: "goodput-chart-caption", class: "summary" },
      `Goodput and badput of ${g.job} over time: each bar is the wall time up to that moment, split into productive time (green, the goodput then) and the causes of badput. Now: ${percent(g.goodput)}.`),
    table,
  );
  return figure;
}
