// The nodes panel: counts by group, filters (job, state, name; kept in the URL), the
// nodes that need attention by name, and the nodes themselves: cards for a few, a
// compact grid per job (nodemap.js) for many.
//
// Live: the whole list is read once (and again on a resync, or every RESYNC_MS for what
// no event tells, such as a late heartbeat); after that only the nodes the stream's
// events and actions name are read again.

import { api, query } from "./api.js";
import { $, h, setOptions } from "./dom.js";
import { ago, duration } from "./format.js";
import { maintenanceNote } from "./maintenance.js";
import { NodeMap } from "./nodemap.js";
import { GROUP_LABEL, GROUPS, groupOf, rank } from "./nodestate.js";

const RESYNC_MS = 60000;
// After an action moved a job's nodes: about a heartbeat period (a cluster's is 5 s).
const JOB_SETTLE_MS = 6000;
const FLUSH_MS = 250;
// More changed nodes than this at once (a rack went down): one read of the whole list.
const MANY = 100;
// Up to this many nodes shown, cards; more, the compact grid ("view" in the URL decides).
const CARDS_UP_TO = 48;
const ATTENTION_SHOWN = 200;
// A GPU error keeps its node suspect this long (then the card still shows it).
const GPU_SUSPECT_MS = 3600 * 1000;
const GPU_EVENTS = ["gpu_xid", "gpu_ecc", "gpu_health"];
const STRAGGLER_EVENTS = ["straggler", "straggler_recovered"];
const JOB_ACTIONS = ["restart_in_place", "restart_workload", "hot_swap", "scale_down", "scale_up"];

/** `map[key] = event` unless it holds a newer event (a higher id) already. */
function keepNewest(map, key, event) {
  const held = map.get(key);
  if (!held || held.id == null || event.id == null || held.id <= event.id) map.set(key, event);
}

export class Nodes {
  constructor({ onChange, maintenanceOf = () => undefined }) {
    this.onChange = onChange;
    this.maintenanceOf = maintenanceOf; // node -> its maintenance window (maintenance.js)
    this.list = $("#nodes");
    this.byName = new Map();
    this.nodes = [];
    this.fetchedAt = 0;
    this.gpu = new Map(); // node -> newest GPU error event
    this.stragglers = new Map(); // node -> newest straggler or straggler_recovered event
    this.liveDuringLoad = null; // live events while a load's reads are in flight
    this.statusSeen = new Map(); // node -> {status, at}: when the page learned its status
    this.dirty = new Set();
    this.dirtyJobs = new Set();
    this.flushTimer = null;
    this.timer = null;
    this.loading = null;
    this.fullLoads = 0;
    this.nodeReads = 0;
    this.map = new NodeMap($("#node-map"), $("#node-tip"), { onPick: (name) => this.pick(name) });
    this.filters = readFilters();
    this.bindFilters();
    this.ticker = setInterval(() => this.tick(), 1000); // ages of silent nodes
    window.addEventListener("resize", () => this.render());
  }

  async load() {
    if (this.loading) return this.loading;
    this.loading = (async () => {
      // Events that come live while the reads are in flight: the lists read may predate
      // them, and they must not be wiped with the maps below.
      this.liveDuringLoad = [];
      try {
        const [nodes, gpuEvents, stragglerEvents] = await Promise.all([
          api("/api/v1/nodes"),
          api(`/api/v1/events${query({ type: GPU_EVENTS, limit: 500 })}`),
          api(`/api/v1/events${query({ type: STRAGGLER_EVENTS, limit: 500 })}`),
        ]);
        this.fullLoads += 1;
        this.byName = new Map(nodes.map((n) => [n.name, { node: n, at: performance.now() }]));
        for (const node of nodes) this.noteStatus(node);
        this.fetchedAt = performance.now();
        this.gpu.clear();
        for (const event of gpuEvents.items.slice().reverse()) this.noteGpu(event);
        this.stragglers.clear();
        for (const event of stragglerEvents.items.slice().reverse()) this.noteStraggler(event);
        for (const event of this.liveDuringLoad) {
          this.noteGpu(event);
          this.noteStraggler(event);
        }
        this.changed();
      } catch (err) {
        $("#nodes-summary").textContent = `Could not load the nodes: ${err.message}`;
      } finally {
        this.liveDuringLoad = null;
        this.loading = null;
        clearTimeout(this.timer);
        this.timer = setTimeout(() => this.load(), RESYNC_MS);
      }
    })();
    return this.loading;
  }

  noteStatus(node) {
    if (this.statusSeen.get(node.name)?.status !== node.status) {
      this.statusSeen.set(node.name, { status: node.status, at: Date.now() });
    }
  }

  noteGpu(event) {
    if (event.node && GPU_EVENTS.includes(event.type)) keepNewest(this.gpu, event.node, event);
  }

  /** The newest straggler event of each node: marked while it is not recovered. */
  noteStraggler(event) {
    if (event.node && STRAGGLER_EVENTS.includes(event.type)) {
      keepNewest(this.stragglers, event.node, event);
    }
  }

  /** A live event: the node it names is read again. */
  onEvent(event) {
    this.liveDuringLoad?.push(event);
    this.noteGpu(event);
    this.noteStraggler(event);
    if (event.node) this.mark(event.node);
  }

  /** A live action change: its node, and the nodes of its job when it moves them. */
  onAction(action) {
    if (action.node) this.mark(action.node);
    if (action.job && JOB_ACTIONS.includes(action.type) && action.status !== "pending") {
      this.dirtyJobs.add(action.job);
      this.schedule();
      if (action.status === "succeeded") {
        // The nodes it moved (a spare taken in) report their new job at their next
        // heartbeat, which raises no event: read the job's nodes again after it.
        setTimeout(() => {
          this.dirtyJobs.add(action.job);
          this.schedule();
        }, JOB_SETTLE_MS);
      }
    }
  }

  mark(name) {
    this.dirty.add(name);
    this.schedule();
  }

  schedule() {
    if (!this.flushTimer) this.flushTimer = setTimeout(() => this.flush(), FLUSH_MS);
  }

  async flush() {
    this.flushTimer = null;
    const names = [...this.dirty];
    const jobs = [...this.dirtyJobs];
    this.dirty.clear();
    this.dirtyJobs.clear();
    if (names.length > MANY || !this.byName.size) {
      await this.load();
      return;
    }
    this.nodeReads += names.length + jobs.length;
    const one = (name) =>
      api(`/api/v1/nodes/${encodeURIComponent(name)}`).then(
        (node) => [node],
        () => [],
      );
    // The named nodes first, on their own: a job's list (hundreds of nodes) comes after.
    this.apply((await Promise.all(names.map(one))).flat());
    if (jobs.length) {
      const lists = jobs.map((job) => api(`/api/v1/nodes${query({ job })}`).catch(() => []));
      this.apply((await Promise.all(lists)).flat());
    }
  }

  apply(found) {
    if (!found.length) return;
    const now = performance.now();
    const isNew = found.some((n) => !this.byName.has(n.name));
    for (const node of found) {
      this.byName.set(node.name, { node, at: now });
      this.noteStatus(node);
    }
    this.changed(isNew);
  }

  changed(listChanged = true) {
    this.nodes = [...this.byName.values()].map((e) => e.node).sort((a, b) => a.name.localeCompare(b.name));
    this.render();
    if (listChanged) this.onChange(this.nodes);
  }

  /** A node's age of silence grows while it is lost (the server's was at its read). */
  age(name) {
    const entry = this.byName.get(name);
    if (!entry || entry.node.heartbeat_age_s === null) return null;
    return entry.node.heartbeat_age_s + (entry.node.alive ? 0 : (performance.now() - entry.at) / 1000);
  }

  groupOf(node) {
    const straggler = this.stragglers.get(node.name)?.type === "straggler";
    const gpu = this.gpu.get(node.name);
    const recent = gpu !== undefined && Date.now() - Date.parse(gpu.time) < GPU_SUSPECT_MS;
    return groupOf(node, { straggler, gpu: recent });
  }

  // --- filters -----------------------------------------------------------------------

  bindFilters() {
    const form = $("#node-filters");
    form.addEventListener("input", () => this.applyForm());
    form.addEventListener("submit", (e) => e.preventDefault());
    form.addEventListener("reset", () => setTimeout(() => this.applyForm(), 0));
    $("#node-counts").addEventListener("click", (e) => {
      const button = e.target.closest("button[data-group]");
      if (!button) return;
      const group = button.dataset.group;
      $("#nf-state").value = this.filters.state === group ? "" : group;
      this.applyForm();
    });
    this.fillForm();
  }

  fillForm() {
    $("#nf-state").value = this.filters.state;
    $("#nf-name").value = this.filters.node;
    $("#nf-view").value = this.filters.view;
  }

  applyForm() {
    this.filters = {
      job: $("#nf-job").value,
      state: $("#nf-state").value,
      node: $("#nf-name").value.trim(),
      view: $("#nf-view").value,
    };
    writeFilters(this.filters);
    this.render();
  }

  matches(node, group) {
    const f = this.filters;
    if (f.job && (f.job === "-" ? node.job !== null : node.job !== f.job)) return false;
    if (f.state && f.state !== group && f.state !== node.status) return false;
    if (f.node && !node.name.toLowerCase().includes(f.node.toLowerCase())) return false;
    return true;
  }

  // --- drawing -----------------------------------------------------------------------

  render() {
    const summary = $("#nodes-summary");
    if (!this.nodes.length) {
      this.list.replaceChildren();
      $("#node-map").replaceChildren();
      $("#attention").hidden = true;
      summary.textContent = this.fetchedAt ? "No node has sent a heartbeat yet." : "Loading…";
      return;
    }
    const entries = this.nodes.map((node) => ({ node, group: this.groupOf(node), maintenance: this.maintenanceOf(node.name) }));
    this.renderCounts(entries);
    this.renderJobOptions(entries);
    const shown = entries.filter((e) => this.matches(e.node, e.group));
    shown.sort((a, b) => rank(a.group) - rank(b.group) || a.node.name.localeCompare(b.node.name));
    const counts = countBy(shown);
    const parts = GROUPS.filter((g) => counts[g]).map((g) => `${counts[g]} ${GROUP_LABEL[g].toLowerCase()}`);
    const of = shown.length === entries.length ? `${entries.length} nodes` : `${shown.length} of ${entries.length} nodes`;
    summary.textContent = `${of}: ${parts.join(", ") || "none"}.`;
    this.renderAttention(shown);
    const cards = this.filters.view === "cards" || (this.filters.view !== "compact" && shown.length <= CARDS_UP_TO);
    this.list.hidden = !cards;
    $("#node-map").hidden = cards;
    if (cards) {
      this.list.replaceChildren(...shown.map((e) => this.card(e.node, e.group)));
      $("#node-map").replaceChildren();
    } else {
      this.list.replaceChildren();
      this.map.render(byJob(shown), shown.length);
    }
    this.renderPicked();
  }

  renderCounts(entries) {
    const counts = countBy(entries);
    $("#node-counts").replaceChildren(
      ...GROUPS.map((g) =>
        h(
          "button",
          {
            type: "button",
            class: `count ${g}`,
            "data-group": g,
            "aria-pressed": String(this.filters.state === g),
          },
          h("strong", {}, String(counts[g] ?? 0)),
          ` ${GROUP_LABEL[g].toLowerCase()}`,
        ),
      ),
    );
  }

  renderJobOptions(entries) {
    const jobs = [...new Set(entries.map((e) => e.node.job).filter((j) => j !== null))].sort();
    const select = $("#nf-job");
    const key = jobs.join("\n");
    if (select.dataset.jobs !== key) {
      select.dataset.jobs = key;
      setOptions(select, [["", "All jobs"], ...jobs.map((j) => [j, j]), ["-", "No job (spares, idle)"]], { keep: false });
    }
    select.value = this.filters.job;
    if (select.value !== this.filters.job) select.value = "";
  }

  /** Failed and suspect nodes by name, most urgent first: what on-call looks for. */
  renderAttention(shown) {
    const urgent = shown.filter((e) => e.group === "failed" || e.group === "suspect");
    const box = $("#attention");
    box.hidden = !urgent.length;
    if (!urgent.length) return;
    $("#attention-title").textContent = `Needs attention: ${urgent.length}`;
    const items = urgent.slice(0, ATTENTION_SHOWN).map(({ node, group }) =>
      h(
        "li",
        { "data-node": node.name, "data-state": node.status, class: group },
        h("button", { type: "button", class: "link", onclick: () => this.pick(node.name) }, node.name),
        ` ${node.status}`,
        node.marks.length ? ` (${node.marks.join(", ")})` : "",
        node.job ? ` · ${node.job}` : "",
        !node.alive ? h("span", { class: "age", "data-age-of": node.name }, ` · silent ${duration(this.age(node.name))}`) : "",
      ),
    );
    if (urgent.length > ATTENTION_SHOWN) items.push(h("li", {}, `and ${urgent.length - ATTENTION_SHOWN} more (filter by job or name)`));
    $("#attention-list").replaceChildren(...items);
  }

  tick() {
    for (const el of document.querySelectorAll("[data-age-of]")) {
      el.textContent = ` · silent ${duration(this.age(el.dataset.ageOf))}`;
    }
    for (const el of this.list.querySelectorAll(".heartbeat[data-node]")) {
      el.textContent = ago(this.age(el.dataset.node));
    }
  }

  pick(name) {
    this.picked = name;
    this.renderPicked();
  }

  renderPicked() {
    const box = $("#node-detail");
    const entry = this.picked ? this.byName.get(this.picked) : null;
    box.hidden = !entry || !this.list.hidden;
    if (box.hidden) return;
    box.replaceChildren(
      h("button", { type: "button", class: "close", "aria-label": "Close", onclick: () => this.pick(null) }, "×"),
      this.card(entry.node, this.groupOf(entry.node), "div"),
    );
  }

  card(node, group, tag = "li") {
    const gpu = this.gpu.get(node.name);
    const steps = node.workers.map((w) => w.step).filter((x) => x !== null);
    const computes = node.workers.map((w) => w.compute_s).filter((x) => x !== null && x !== undefined);
    const straggler = this.stragglers.get(node.name);
    const slow = straggler?.type === "straggler" ? straggler : null;
    const notes = [...node.marks];
    if (node.flapping_clears_in_s !== null) notes.push(`flapping clears in ${duration(node.flapping_clears_in_s)} if steady`);
    if (node.dry_run_cordoned) notes.push("dry run: would have cordoned it");
    const mw = this.maintenanceOf(node.name);
    if (mw) notes.push(maintenanceNote(mw));
    const out = mw?.state === "open";
    const badge = h("span", { class: `badge ${group}` }, node.status);
    return h(
      tag,
      {
        class: `node ${group}`,
        "data-node": node.name,
        "data-state": node.status,
        "data-group": group,
        "data-maintenance": mw?.state ?? null,
        "aria-label": `${node.name}: ${node.status}${out ? ", in maintenance" : ""}`,
      },
      h("h3", {}, node.name, out ? h("span", {}, h("span", { class: "badge warn maintenance" }, "maintenance"), " ", badge) : badge),
      h(
        "dl",
        {},
        h("dt", {}, "Job"),
        h("dd", {}, node.job ?? "—"),
        h("dt", {}, "Heartbeat"),
        h("dd", { class: "heartbeat", "data-node": node.name }, ago(this.age(node.name))),
        h("dt", {}, "GPU"),
        h("dd", { class: "gpu" }, gpuHealth(gpu)),
        h("dt", {}, "Workers"),
        h("dd", {}, node.workers.length ? `${node.workers.length}${steps.length ? `, step ${Math.max(...steps)}` : ""}` : "none"),
        computes.length
          ? [
              h("dt", {}, "Step compute"),
              h(
                "dd",
                { class: "compute" },
                `${(Math.max(...computes) * 1000).toFixed(1)} ms${slow ? " " : ""}`,
                slow
                  ? h("span", { class: "badge failed", title: `rank ${slow.rank}: score ${slow.details?.score}` }, `straggler +${slow.details?.slowdown_pct ?? "?"}%`)
                  : null,
              ),
            ]
          : null,
        notes.length ? [h("dt", {}, "Note"), h("dd", { class: "notes" }, notes.join(", "))] : null,
      ),
    );
  }
}

function countBy(entries) {
  const counts = {};
  for (const e of entries) counts[e.group] = (counts[e.group] ?? 0) + 1;
  return counts;
}

/** Jobs in name order (the nodes of none last), each with its nodes as sorted. */
function byJob(entries) {
  const groups = new Map();
  for (const e of entries) {
    const key = e.node.job ?? "";
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(e);
  }
  return [...groups.keys()]
    .sort((a, b) => (a === "") - (b === "") || a.localeCompare(b))
    .map((job) => ({ job: job || null, label: job ? `Job ${job}` : "No job (spares, idle)", nodes: groups.get(job) }));
}

const FILTER_KEYS = { job: "job", state: "state", node: "node", view: "view" };

function readFilters() {
  const params = new URLSearchParams(location.search);
  const out = {};
  for (const [key, param] of Object.entries(FILTER_KEYS)) out[key] = params.get(param) ?? "";
  return out;
}

function writeFilters(filters) {
  const params = new URLSearchParams(location.search);
  for (const [key, param] of Object.entries(FILTER_KEYS)) {
    if (filters[key]) params.set(param, filters[key]);
    else params.delete(param);
  }
  const search = params.toString();
  history.replaceState(history.state, "", `${location.pathname}${search ? `?${search}` : ""}${location.hash}`);
}

function gpuHealth(event) {
  if (!event) return h("span", { class: "badge ok" }, "no errors");
  const d = event.details ?? {};
  const gpu = d.gpu !== undefined && d.gpu !== null ? ` on GPU ${d.gpu}` : "";
  const what =
    event.type === "gpu_xid" ? `XID ${d.code ?? "?"}` : event.type === "gpu_ecc" ? `ECC ×${d.count ?? "?"}` : (d.meaning ?? d.kind ?? "GPU health");
  const age = (Date.now() - Date.parse(event.time)) / 1000;
  return [h("span", { class: "badge failed" }, `${what}${gpu}`), ` ${duration(age)} ago`];
}
