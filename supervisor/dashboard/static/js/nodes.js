// The node grid: state, job, last heartbeat age and GPU health (from GPU error events).

import { api, query } from "./api.js";
import { $, h } from "./dom.js";
import { ago, duration } from "./format.js";

const REFRESH_MS = 2000;

/** What the grid calls a node's state. */
export function nodeState(node) {
  // A silent node is the most urgent news, cordoned or not (the card says both).
  if (!node.alive || node.state === "failed") return "failed";
  if (node.cordoned) return "cordoned";
  if (node.state === "spare") return "spare";
  if (node.state === "running") return "running";
  return node.state;
}

export class Nodes {
  constructor({ onChange }) {
    this.onChange = onChange;
    this.list = $("#nodes");
    this.nodes = [];
    this.fetchedAt = 0;
    this.gpu = new Map(); // node -> newest GPU error event
    this.stragglers = new Map(); // node -> newest straggler or straggler_recovered event
    this.timer = null;
    this.loading = null;
    setInterval(() => this.render(), 1000); // heartbeat ages tick between refreshes
  }

  async load() {
    if (this.loading) return this.loading;
    this.loading = (async () => {
      try {
        const [nodes, gpuEvents, stragglerEvents] = await Promise.all([
          api("/api/v1/nodes"),
          api(`/api/v1/events${query({ type: GPU_EVENTS, limit: 500 })}`),
          api(`/api/v1/events${query({ type: STRAGGLER_EVENTS, limit: 500 })}`),
        ]);
        this.nodes = nodes;
        this.fetchedAt = performance.now();
        this.gpu.clear();
        for (const event of gpuEvents.items.slice().reverse()) this.noteGpu(event);
        this.stragglers.clear();
        for (const event of stragglerEvents.items.slice().reverse()) this.noteStraggler(event);
        this.render();
        this.onChange(nodes);
      } catch (err) {
        $("#nodes-summary").textContent = `Could not load the nodes: ${err.message}`;
      } finally {
        this.loading = null;
        clearTimeout(this.timer);
        this.timer = setTimeout(() => this.load(), REFRESH_MS);
      }
    })();
    return this.loading;
  }

  noteGpu(event) {
    if (event.node && GPU_EVENTS.includes(event.type)) {
      this.gpu.set(event.node, event);
    }
  }

  /** The newest straggler event of each node: marked while it is not recovered. */
  noteStraggler(event) {
    if (event.node && STRAGGLER_EVENTS.includes(event.type)) this.stragglers.set(event.node, event);
  }

  /** A live event: GPU errors count at once; anything else may change a node's state. */
  onEvent(event) {
    this.noteGpu(event);
    this.noteStraggler(event);
    this.render();
  }

  render() {
    if (!this.nodes.length) {
      this.list.replaceChildren();
      $("#nodes-summary").textContent = this.fetchedAt ? "No node has sent a heartbeat yet." : "Loading…";
      return;
    }
    const elapsed = (performance.now() - this.fetchedAt) / 1000;
    const counts = {};
    const cards = this.nodes.map((node) => {
      const state = nodeState(node);
      counts[state] = (counts[state] ?? 0) + 1;
      // A live node's age is as the server saw it (it keeps beating); a silent one's grows.
      const age =
        node.heartbeat_age_s === null ? null : node.heartbeat_age_s + (node.alive ? 0 : elapsed);
      const gpu = this.gpu.get(node.name);
      const steps = node.workers.map((w) => w.step).filter((x) => x !== null);
      const computes = node.workers.map((w) => w.compute_s).filter((x) => x !== null && x !== undefined);
      const straggler = this.stragglers.get(node.name);
      const slow = straggler?.type === "straggler" ? straggler : null;
      return h(
        "li",
        { class: `node ${state}`, "data-node": node.name, "data-state": state, "aria-label": `${node.name}: ${state}` },
        h("h3", {}, node.name, h("span", { class: `badge ${state}` }, state)),
        h(
          "dl",
          {},
          h("dt", {}, "Job"),
          h("dd", {}, node.job ?? "—"),
          h("dt", {}, "Heartbeat"),
          h("dd", { class: "heartbeat" }, ago(age)),
          h("dt", {}, "GPU"),
          h("dd", { class: "gpu" }, gpuHealth(gpu)),
          h("dt", {}, "Workers"),
          h(
            "dd",
            {},
            node.workers.length
              ? `${node.workers.length}${steps.length ? `, step ${Math.max(...steps)}` : ""}`
              : "none",
          ),
          computes.length
            ? [
                h("dt", {}, "Step compute"),
                h(
                  "dd",
                  { class: "compute" },
                  `${(Math.max(...computes) * 1000).toFixed(1)} ms${slow ? " " : ""}`,
                  slow
                    ? h(
                        "span",
                        { class: "badge failed", title: `rank ${slow.rank}: score ${slow.details?.score}` },
                        `straggler +${slow.details?.slowdown_pct ?? "?"}%`,
                      )
                    : null,
                ),
              ]
            : null,
          notes(node, state).length ? [h("dt", {}, "Note"), h("dd", {}, notes(node, state).join(", "))] : null,
        ),
      );
    });
    this.list.replaceChildren(...cards);
    const order = ["running", "spare", "failed", "cordoned"];
    const parts = Object.entries(counts)
      .sort(([a], [b]) => (order.indexOf(a) + 99) % 99 - (order.indexOf(b) + 99) % 99)
      .map(([state, n]) => `${n} ${state}`);
    $("#nodes-summary").textContent = `${this.nodes.length} nodes: ${parts.join(", ")}.`;
  }
}

function notes(node, state) {
  const out = [];
  if (!node.alive) out.push("no heartbeat");
  if (node.cordoned && state !== "cordoned") out.push("cordoned");
  if (node.flapping) out.push("flapping");
  return out;
}

const GPU_EVENTS = ["gpu_xid", "gpu_ecc", "gpu_health"];
const STRAGGLER_EVENTS = ["straggler", "straggler_recovered"];

function gpuHealth(event) {
  if (!event) return h("span", { class: "badge ok" }, "no errors");
  const d = event.details ?? {};
  const gpu = d.gpu !== undefined && d.gpu !== null ? ` on GPU ${d.gpu}` : "";
  const what =
    event.type === "gpu_xid"
      ? `XID ${d.code ?? "?"}`
      : event.type === "gpu_ecc"
        ? `ECC ×${d.count ?? "?"}`
        : (d.meaning ?? d.kind ?? "GPU health");
  const age = (Date.now() - Date.parse(event.time)) / 1000;
  return [h("span", { class: "badge failed" }, `${what}${gpu}`), ` ${duration(age)} ago`];
}
