// The compact view: one canvas per job, one small cell per node (most urgent first),
// the node's name and state on hover, its card on click. Thousands of nodes cost a few
// canvases, not thousands of elements.

import { h } from "./dom.js";
import { GROUP_COLOR, GROUP_LABEL, GROUPS } from "./nodestate.js";

const GAP = 2;

/** Cell size for this many nodes: all of them fit one screen up to a few thousand. */
export function cellSize(count) {
  if (count <= 300) return 18;
  if (count <= 1200) return 14;
  if (count <= 3000) return 10;
  return 7;
}

export class NodeMap {
  constructor(root, tip, { onPick }) {
    this.root = root;
    this.tip = tip;
    this.onPick = onPick;
    this.groups = []; // [{job, nodes: [entry]}], entry = {node, group}
    // One section and canvas per job, kept across renders and redrawn in place: a
    // stream of status changes must not pull the canvas from under the pointer.
    this.sections = new Map(); // job -> {section, title, canvas, layout}
  }

  /** groups: [{job, label, nodes: [{node, group}]}], each already sorted. */
  render(groups, total) {
    this.groups = groups;
    const size = cellSize(total);
    const width = Math.max(200, this.root.clientWidth || 800);
    const perRow = Math.max(1, Math.floor((width + GAP) / (size + GAP)));
    const wanted = groups.map((g) => this.section(g, size, perRow));
    const jobs = new Set(groups.map((g) => g.job ?? ""));
    for (const job of [...this.sections.keys()]) if (!jobs.has(job)) this.sections.delete(job);
    const current = [...this.root.children];
    if (current.length !== wanted.length || current.some((el, i) => el !== wanted[i])) {
      this.root.replaceChildren(...wanted);
    }
  }

  section(group, size, perRow) {
    const job = group.job ?? "";
    let kept = this.sections.get(job);
    if (!kept) {
      kept = this.makeSection(job);
      this.sections.set(job, kept);
    }
    kept.layout = { group, size, perRow };
    const counts = {};
    for (const e of group.nodes) counts[e.group] = (counts[e.group] ?? 0) + 1;
    const parts = GROUPS.filter((k) => counts[k]).map((k) => `${counts[k]} ${GROUP_LABEL[k].toLowerCase()}`);
    kept.title.replaceChildren(group.label, h("span", { class: "muted" }, ` · ${group.nodes.length} nodes: ${parts.join(", ")}`));
    const canvas = kept.canvas;
    canvas.setAttribute("aria-label", `${group.label}: ${group.nodes.length} nodes, ${parts.join(", ")}`);
    const rows = Math.ceil(group.nodes.length / perRow);
    const ratio = window.devicePixelRatio || 1;
    const cssWidth = perRow * (size + GAP) - GAP;
    const cssHeight = Math.max(size, rows * (size + GAP) - GAP);
    // Setting a canvas's size clears it; it is drawn again whole just below.
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
    canvas.style.width = `${cssWidth}px`;
    canvas.style.height = `${cssHeight}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    group.nodes.forEach((entry, i) => {
      const x = (i % perRow) * (size + GAP);
      const y = Math.floor(i / perRow) * (size + GAP);
      ctx.fillStyle = GROUP_COLOR[entry.group];
      ctx.fillRect(x, y, size, size);
      if (entry.node.status === "lost") {
        // Lost and failed share a colour; a lost node's cell is hollow: no heartbeat.
        ctx.fillStyle = "#ffffff";
        const inset = Math.max(2, Math.floor(size / 4));
        ctx.fillRect(x + inset, y + inset, size - 2 * inset, size - 2 * inset);
      }
      if (entry.maintenance?.state === "open") {
        // Out for maintenance: a white corner on the cell.
        ctx.fillStyle = "#ffffff";
        ctx.beginPath();
        ctx.moveTo(x + size / 2, y);
        ctx.lineTo(x + size, y);
        ctx.lineTo(x + size, y + size / 2);
        ctx.fill();
      }
    });
    return kept.section;
  }

  makeSection(job) {
    const canvas = h("canvas", { class: "node-cells", "data-job": job, tabindex: "0", role: "img" });
    const title = h("h3", {});
    const kept = { section: h("section", { class: "job-group", "data-job": job }, title, canvas), title, canvas, layout: null };
    // The cell under the pointer, read from the latest layout of this job's canvas.
    const at = (event) => {
      const { group, size, perRow } = kept.layout;
      const rect = canvas.getBoundingClientRect();
      const col = Math.floor((event.clientX - rect.left) / (size + GAP));
      const row = Math.floor((event.clientY - rect.top) / (size + GAP));
      const i = row * perRow + col;
      return col < perRow && i >= 0 && i < group.nodes.length ? group.nodes[i] : null;
    };
    canvas.addEventListener("mousemove", (event) => this.hover(at(event), event));
    canvas.addEventListener("mouseleave", () => this.hover(null));
    canvas.addEventListener("click", (event) => {
      const entry = at(event);
      if (entry) this.onPick(entry.node.name);
    });
    return kept;
  }

  hover(entry, event) {
    if (!entry) {
      this.tip.hidden = true;
      return;
    }
    const n = entry.node;
    const marks = n.marks.length ? ` · ${n.marks.join(", ")}` : "";
    const out = entry.maintenance?.state === "open" ? " · maintenance" : "";
    this.tip.textContent = `${n.name}: ${n.status}${n.job ? ` · ${n.job}` : ""}${marks}${out}`;
    this.tip.dataset.node = n.name;
    this.tip.hidden = false;
    this.tip.style.left = `${event.clientX + 12}px`;
    this.tip.style.top = `${event.clientY + 12}px`;
  }
}
