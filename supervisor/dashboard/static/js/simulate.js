// The simulation page: renders the JSON of `supervisor simulate -o json`, read locally.

import { h, s } from "./dom.js";
import { words } from "./format.js";

const CATEGORIES = [
  "lost_progress", "detection", "remediation", "restart",
  "checkpoint_save", "reduced_capacity", "idle",
];
const COLOURS = {
  lost_progress: "#c62828", detection: "#ef6c00", remediation: "#f9a825", restart: "#6a1b9a",
  checkpoint_save: "#1565c0", reduced_capacity: "#00838f", idle: "#9e9e9e",
};

const $ = (sel) => document.querySelector(sel);

function check(data) {
  if (!data || !Array.isArray(data.runs) || data.runs.length === 0) {
    throw new Error("not the output of `supervisor simulate -o json`: no runs");
  }
  for (const run of data.runs) {
    if (typeof run.goodput !== "number" || !run.badput_h || typeof run.wall_h !== "number") {
      throw new Error(`run ${run.name ?? "?"}: goodput, wall_h and badput_h are required`);
    }
  }
  return data;
}

function chart(runs) {
  const barH = 26, gap = 12, left = 200, width = 600;
  const height = runs.length * (barH + gap) + 10;
  const worst = Math.max(...runs.map((r) => (r.wall_h - r.productive_h) / r.wall_h), 1e-9);
  const svg = s("svg", { width: left + width + 20, height, role: "img",
    "aria-label": "badput by category for each run" });
  runs.forEach((run, i) => {
    const y = 5 + i * (barH + gap);
    svg.append(s("text", { x: 0, y: y + barH * 0.7 },
      `${run.name} ${(run.goodput * 100).toFixed(2)}%`));
    let x = left;
    for (const c of CATEGORIES) {
      const hours = run.badput_h[c] ?? 0;
      const w = (width * (hours / run.wall_h)) / worst;
      if (w <= 0) continue;
      svg.append(s("rect", { x, y, width: w, height: barH, fill: COLOURS[c], "data-category": c },
        s("title", {}, `${words(c)}: ${hours.toFixed(2)} h`)));
      x += w;
    }
  });
  return svg;
}

function table(runs) {
  const rows = [
    ["goodput", (r) => `${(r.goodput * 100).toFixed(2)}%`],
    ["wall time (h)", (r) => r.wall_h.toFixed(1)],
    ...CATEGORIES.map((c) => [`${words(c)} (h)`, (r) => (r.badput_h[c] ?? 0).toFixed(2)]),
    ["faults", (r) => String(r.faults ?? "")],
    ["failures handled", (r) => String(r.failures ?? "")],
    ["steps lost", (r) => String(r.cluster?.steps_lost ?? "")],
    ["spares used / back", (r) => `${r.cluster?.spares_used ?? ""} / ${r.cluster?.spares_returned ?? ""}`],
    ["no spare left (h)", (r) => (r.cluster?.no_spare_h ?? 0).toFixed(2)],
  ];
  $("#sim-table thead").replaceChildren(
    h("tr", {}, h("th", { scope: "col" }, ""), ...runs.map((r) => h("th", { scope: "col" }, r.name))));
  $("#sim-table tbody").replaceChildren(...rows.map(([label, cell]) =>
    h("tr", {}, h("th", { scope: "row" }, label), ...runs.map((r) => h("td", { class: "num" }, cell(r))))));
}

function render(data) {
  const sc = data.scenario ?? {};
  const cl = sc.cluster ?? {};
  $("#sim-scenario").textContent = `${sc.days ?? "?"} days, ${cl.num_dp_replicas ?? "?"} x `
    + `${cl.num_nodes_per_dp ?? "?"} nodes + ${cl.spares ?? "?"} spares, seed ${sc.seed ?? "?"}`;
  $("#sim-chart").replaceChildren(chart(data.runs));
  table(data.runs);
  $("#sim-result").hidden = false;
}

$("#sim-file").addEventListener("change", async (event) => {
  const file = event.target.files[0];
  if (!file) return;
  $("#sim-error").textContent = "";
  try {
    render(check(JSON.parse(await file.text())));
  } catch (err) {
    $("#sim-result").hidden = true;
    $("#sim-error").textContent = `Cannot show ${file.name}: ${err.message}`;
  }
});
