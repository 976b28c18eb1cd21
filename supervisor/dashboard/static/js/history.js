// Event history: filters, a timeline, and the tables of events and actions (newest
// first, cursor pagination), kept up to date by the live stream.

import { api, query } from "./api.js";
import { $, h, s, setOptions } from "./dom.js";
import { clock, duration, isoToLocalInput, localInputToIso, timeEl, words } from "./format.js";

const PAGE = 50;
// A page left open for days keeps this many rows per table; older ones are dropped (and
// "Load older" then starts over from the newest page).
const MAX_ROWS = 1000;

const FAILURES = new Set([
  "host_heartbeat_lost", "worker_heartbeat_lost", "worker_exited", "hang", "gpu_xid",
  "gpu_ecc", "gpu_health", "node_flapping", "pod_stuck_terminating", "workload_down",
  "node_not_ready", "node_cut_off", "straggler", "checkpoint_failed",
]);
const RECOVERIES = new Set(["node_recovered", "spare_available", "straggler_recovered"]);

export function eventCategory(type) {
  if (FAILURES.has(type)) return "failure";
  if (RECOVERIES.has(type)) return "recovery";
  return "other";
}

const FILTER_NAMES = ["type", "action_type", "status", "node", "job", "since", "until"];

/** Rows of a table kept in descending id order, updated in place by id. */
class KeyedRows {
  constructor(tbody, emptyText) {
    this.tbody = tbody;
    this.emptyText = emptyText;
    this.rows = new Map();
    this.showEmpty();
  }

  clear() {
    this.rows.clear();
    this.tbody.replaceChildren();
    this.showEmpty();
  }

  showEmpty() {
    if (this.rows.size) return;
    const columns = this.tbody.closest("table").querySelectorAll("thead th").length;
    this.tbody.replaceChildren(h("tr", { class: "empty" }, h("td", { colspan: columns }, this.emptyText)));
  }

  has(id) {
    return this.rows.has(id);
  }

  /** Drop the oldest rows beyond `max`; returns their ids. */
  trim(max) {
    if (this.rows.size <= max) return [];
    const dropped = [...this.rows.keys()].sort((a, b) => a - b).slice(0, this.rows.size - max);
    for (const id of dropped) {
      this.rows.get(id).remove();
      this.rows.delete(id);
    }
    return dropped;
  }

  upsert(id, row, { fresh = false } = {}) {
    this.tbody.querySelector("tr.empty")?.remove();
    const old = this.rows.get(id);
    if (fresh) row.classList.add("fresh");
    if (old) {
      if (old.classList.contains("fresh") && !fresh) row.classList.add("fresh");
      old.replaceWith(row);
    } else {
      // Most rows arrive in order (newest on top, older pages at the bottom): quick paths.
      const first = this.tbody.firstElementChild;
      const last = this.tbody.lastElementChild;
      if (!first || Number(last.dataset.id) > id) this.tbody.append(row);
      else if (Number(first.dataset.id) < id) this.tbody.prepend(row);
      else {
        // Before the row with the largest smaller id.
        let before = null;
        for (const [otherId, other] of this.rows) {
          if (otherId < id && (!before || otherId > Number(before.dataset.id))) before = other;
        }
        if (before) before.before(row);
        else this.tbody.append(row);
      }
    }
    this.rows.set(id, row);
  }
}

export class History {
  constructor({ announce }) {
    this.announce = announce;
    this.form = $("#filters");
    this.filters = {};
    this.events = new Map();
    this.actions = new Map();
    this.actionsByEvent = new Map();
    // Every event and action seen (pages, stream, look-ups), shown or filtered out.
    this.seenActions = new Map();
    this.eventCache = new Map();
    this.eventsCursor = null;
    this.actionsCursor = null;
    this.eventRows = new KeyedRows($("#events-table tbody"), "No events match these filters.");
    this.actionRows = new KeyedRows($("#actions-table tbody"), "No actions match these filters.");
    this.generation = 0;
    this.timelineQueued = false;

    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.apply();
    });
    this.form.addEventListener("reset", () => setTimeout(() => this.apply(), 0));
    for (const select of this.form.querySelectorAll("select")) {
      select.addEventListener("change", () => this.apply());
    }
    $("#events-more").addEventListener("click", () => (this.trimmed ? this.reload() : this.loadEvents(true)));
    $("#actions-more").addEventListener("click", () => (this.trimmed ? this.reload() : this.loadActions(true)));
    // Links to rows ("event #12") move focus there without touching the URL's filters.
    $("#history").addEventListener("click", (e) => {
      const link = e.target.closest("a[href^='#event-'], a[href^='#action-']");
      const row = link && document.getElementById(link.getAttribute("href").slice(1));
      if (!row) return;
      e.preventDefault();
      row.tabIndex = -1;
      row.focus();
    });
    window.addEventListener("resize", () => this.queueTimeline());
    window.addEventListener("hashchange", () => {
      // "#event-12" or "#history" are places on the page, not filters.
      const filtering = location.hash === "" || location.hash.includes("=");
      if (filtering && this.readHash()) this.reload();
    });
  }

  /** Fill the type selects from the API's own schema, so they never drift from it. */
  async init() {
    try {
      const schema = await fetch("/openapi.json", { cache: "no-store" }).then((r) => r.json());
      const enumOf = (name) => schema.components?.schemas?.[name]?.enum ?? [];
      const opts = (values) => [["", "All"], ...values.map((v) => [v, words(v)])];
      setOptions($("#f-type"), opts(enumOf("EventType")));
      setOptions($("#f-action-type"), opts(enumOf("ActionType")));
      setOptions($("#f-status"), opts(enumOf("ActionStatus")));
    } catch {
      // The selects keep "All" only; filtering by the other fields still works.
    }
    this.readHash();
  }

  /** Node and job choices (the API answers 404 for names it has never seen). */
  setTargets(nodes, jobs) {
    const keep = (select, names) => {
      const value = this.filters[select.name] || select.value;
      const all = new Set(names);
      if (value) all.add(value);
      setOptions(select, [["", "All"], ...[...all].sort().map((n) => [n, n])]);
      select.value = value || "";
    };
    keep($("#f-node"), nodes);
    keep($("#f-job"), jobs);
  }

  readForm() {
    const data = new FormData(this.form);
    const filters = {};
    for (const name of FILTER_NAMES) {
      let value = String(data.get(name) ?? "");
      if (name === "since" || name === "until") value = localInputToIso(value);
      if (value) filters[name] = value;
    }
    return filters;
  }

  /** Filters live in the URL fragment, so a filtered view can be bookmarked or shared. */
  readHash() {
    const hash = location.hash.includes("=") ? location.hash.slice(1) : "";
    const params = new URLSearchParams(hash);
    const filters = {};
    for (const name of FILTER_NAMES) {
      const value = params.get(name);
      if (value) filters[name] = value;
    }
    if (JSON.stringify(filters) === JSON.stringify(this.filters)) return false;
    this.filters = filters;
    for (const name of FILTER_NAMES) {
      const field = this.form.elements.namedItem(name);
      const value = filters[name] ?? "";
      if (name === "since" || name === "until") field.value = isoToLocalInput(value);
      else {
        if (value && ![...field.options].some((o) => o.value === value)) {
          field.append(h("option", { value }, value));
        }
        field.value = value;
      }
    }
    return true;
  }

  apply() {
    this.filters = this.readForm();
    const hash = new URLSearchParams(this.filters).toString();
    history.replaceState(null, "", hash ? `#${hash}` : location.pathname + location.search);
    this.reload();
  }

  async reload() {
    this.generation += 1;
    this.trimmed = false;
    $("#events-more").textContent = "Load older events";
    $("#actions-more").textContent = "Load older actions";
    this.events.clear();
    this.actions.clear();
    this.eventsCursor = null;
    this.actionsCursor = null;
    this.eventRows.clear();
    this.actionRows.clear();
    $("#filter-summary").textContent = "Loading…";
    await Promise.all([this.loadEvents(false), this.loadActions(false)]);
    this.summarise();
  }

  common() {
    const f = this.filters;
    return { node: f.node, job: f.job, since: f.since, until: f.until };
  }

  async loadEvents(older) {
    const generation = this.generation;
    const params = { ...this.common(), type: this.filters.type, limit: PAGE };
    if (older) params.cursor = this.eventsCursor;
    try {
      const page = await api(`/api/v1/events${query(params)}`);
      if (generation !== this.generation) return;
      for (const event of page.items) this.putEvent(event, false);
      this.eventsCursor = page.next_cursor;
      $("#events-more").hidden = !page.next_cursor;
      if (older) this.summarise();
    } catch (err) {
      if (generation === this.generation) this.fail(err);
    }
  }

  async loadActions(older) {
    const generation = this.generation;
    const f = this.filters;
    const params = { ...this.common(), type: f.action_type, status: f.status, limit: PAGE };
    if (older) params.cursor = this.actionsCursor;
    try {
      const page = await api(`/api/v1/actions${query(params)}`);
      if (generation !== this.generation) return;
      for (const action of page.items) this.putAction(action, false);
      this.actionsCursor = page.next_cursor;
      $("#actions-more").hidden = !page.next_cursor;
      if (older) this.summarise();
    } catch (err) {
      if (generation === this.generation) this.fail(err);
    }
  }

  fail(err) {
    $("#filter-summary").textContent = `Could not load the history: ${err.message}`;
  }

  summarise() {
    const more = [];
    if (this.eventsCursor) more.push("older events");
    if (this.actionsCursor) more.push("older actions");
    const active = Object.keys(this.filters).length ? "matching the filters" : "";
    $("#filter-summary").textContent =
      `Showing ${this.events.size} events and ${this.actions.size} actions ${active}`.trim() +
      (more.length ? ` (${more.join(" and ")} can be loaded below).` : ".");
  }

  // --- live updates ----------------------------------------------------------------

  onEvent(event) {
    this.eventCache.set(event.id, event);
    if (this.matchesEvent(event)) {
      this.putEvent(event, true);
      this.summarise();
    }
    // Actions shown before their event arrived can now name it.
    for (const actionId of this.actionsByEvent.get(event.id) ?? []) {
      const action = this.actions.get(actionId);
      if (action) this.putAction(action, false);
    }
  }

  onAction(action) {
    const seen = this.seenActions.get(action.id);
    if (seen && !newer(action, seen)) return;
    const shown = this.actions.has(action.id);
    if (shown || this.matchesAction(action)) {
      this.putAction(action, !shown);
      this.summarise();
    } else {
      this.index(action);
      this.redrawCause(action);
    }
  }

  matchesEvent(e) {
    const f = this.filters;
    return (
      (!f.type || e.type === f.type) &&
      (!f.node || e.node === f.node) &&
      (!f.job || e.job === f.job) &&
      inRange(e.time, f)
    );
  }

  matchesAction(a) {
    const f = this.filters;
    return (
      (!f.action_type || a.type === f.action_type) &&
      (!f.status || a.status === f.status) &&
      (!f.node || a.node === f.node) &&
      (!f.job || a.job === f.job) &&
      inRange(a.created_at, f)
    );
  }

  // --- rows ------------------------------------------------------------------------

  putEvent(event, fresh) {
    this.events.set(event.id, event);
    this.eventCache.set(event.id, event);
    this.eventRows.upsert(event.id, this.eventRow(event), { fresh });
    if (fresh) this.trim();
    this.queueTimeline();
  }

  markTrimmed() {
    if (this.trimmed) return;
    this.trimmed = true;
    for (const [id, what] of [["#events-more", "events"], ["#actions-more", "actions"]]) {
      $(id).hidden = false;
      $(id).textContent = `Reload from the newest ${what}`;
    }
  }

  index(action) {
    const seen = this.seenActions.get(action.id);
    if (!seen || newer(action, seen)) this.seenActions.set(action.id, action);
    if (action.event_id === null) return;
    let ids = this.actionsByEvent.get(action.event_id);
    if (!ids) this.actionsByEvent.set(action.event_id, (ids = new Set()));
    ids.add(action.id);
  }

  putAction(action, fresh) {
    const known = this.actions.get(action.id);
    if (known && !newer(action, known)) action = known;
    this.index(action);
    action = this.seenActions.get(action.id);
    this.actions.set(action.id, action);
    this.actionRows.upsert(action.id, this.actionRow(action), { fresh });
    if (fresh) this.trim();
    this.redrawCause(action);
    this.queueTimeline();
  }

  /** Live rows push the oldest out past MAX_ROWS (pages asked for are kept). */
  trim() {
    const events = this.eventRows.trim(MAX_ROWS);
    const actions = this.actionRows.trim(MAX_ROWS);
    if (!events.length && !actions.length) return;
    for (const id of events) this.events.delete(id);
    for (const id of actions) this.actions.delete(id);
    this.markTrimmed();
    // The look-up caches follow, so a page open for weeks stays small.
    for (const cache of [this.eventCache, this.seenActions]) {
      if (cache.size <= 4 * MAX_ROWS) continue;
      for (const id of [...cache.keys()].sort((a, b) => a - b).slice(0, cache.size - 2 * MAX_ROWS)) {
        cache.delete(id);
      }
    }
  }

  /** The row of the event that caused `action` lists it: redraw that row. */
  redrawCause(action) {
    const cause = action.event_id !== null && this.events.get(action.event_id);
    if (cause) this.eventRows.upsert(cause.id, this.eventRow(cause));
  }

  eventRow(e) {
    const category = eventCategory(e.type);
    const chips = [...(this.actionsByEvent.get(e.id) ?? [])]
      .map((id) => this.seenActions.get(id))
      .filter(Boolean)
      .sort((a, b) => a.id - b.id)
      .map((a) =>
        h(this.actions.has(a.id) ? "a" : "span",
          { href: this.actions.has(a.id) ? `#action-${a.id}` : null, class: `badge ${a.status}`, title: `action #${a.id}` },
          `${a.dry_run ? "would " : ""}${words(a.type)}: ${a.status}`),
      );
    return h(
      "tr",
      { id: `event-${e.id}`, "data-id": e.id, "data-type": e.type },
      h("td", { class: "num" }, e.id),
      h("td", {}, timeEl(e.time)),
      h("td", {}, h("span", { class: `badge ${category}` }, words(e.type))),
      h("td", {}, e.node ?? "—"),
      h("td", {}, e.job ?? "—"),
      h("td", { class: "details" }, details(e)),
      h("td", {}, e.fault_id === null ? "—" : `fault #${e.fault_id}`),
      h("td", {}, chips.length ? h("span", { class: "chips" }, chips) : "—"),
    );
  }

  actionRow(a) {
    const target = [a.node && `node ${a.node}`, a.job && `job ${a.job}`].filter(Boolean).join(", ");
    const dur =
      a.duration_s !== null
        ? duration(a.duration_s)
        : a.started_at
          ? `${duration((Date.now() - Date.parse(a.started_at)) / 1000)} so far`
          : "—";
    return h(
      "tr",
      { id: `action-${a.id}`, "data-id": a.id, "data-status": a.status, "data-event": a.event_id ?? "", "data-dry-run": a.dry_run },
      h("td", { class: "num" }, a.id),
      h("td", {}, timeEl(a.created_at)),
      h("td", {}, words(a.type), a.reason ? h("div", { class: "summary" }, a.reason) : null),
      h("td", {}, target || "—"),
      h("td", {},
        h("span", { class: `badge ${a.status}` }, a.status),
        // A dry-run supervisor's record: what it would have done, nothing was done.
        a.dry_run ? h("span", { class: "badge dry-run", title: "dry run: nothing was done" }, "would have") : null),
      h("td", { class: "num" }, dur),
      h("td", { class: "num" }, a.attempts),
      h("td", { class: "error-cell" }, a.error ?? ""),
      h("td", { class: "cause" }, this.cause(a)),
    );
  }

  cause(a) {
    const parts = [];
    if (a.event_id !== null) {
      const event = this.eventCache.get(a.event_id);
      const link = h("a", { href: `#event-${a.event_id}` }, `event #${a.event_id}`);
      if (event && typeof event === "object" && !(event instanceof Promise)) {
        parts.push(link, ` ${words(event.type)}${event.node ? ` on ${event.node}` : ""}`);
      } else {
        parts.push(link);
        this.fetchEvent(a.event_id);
      }
    } else {
      parts.push(a.source === "operator" ? "operator request" : a.source);
    }
    if (a.fault_id !== null) parts.push(h("br"), `fault #${a.fault_id}`);
    return parts;
  }

  /** An action's cause may be on a page not loaded: fetch it once, then redraw. */
  fetchEvent(id) {
    if (this.eventCache.has(id)) return;
    const pending = api(`/api/v1/events/${id}`)
      .then((event) => {
        this.eventCache.set(id, event);
        for (const actionId of this.actionsByEvent.get(id) ?? []) {
          const action = this.actions.get(actionId);
          if (action) this.actionRows.upsert(action.id, this.actionRow(action));
        }
      })
      .catch(() => this.eventCache.delete(id));
    this.eventCache.set(id, pending);
  }

  // --- timeline --------------------------------------------------------------------

  queueTimeline() {
    if (this.timelineQueued) return;
    this.timelineQueued = true;
    requestAnimationFrame(() => {
      this.timelineQueued = false;
      this.drawTimeline();
    });
  }

  drawTimeline() {
    const svg = $("#timeline");
    const width = Math.max(320, Math.round(svg.getBoundingClientRect().width) || 800);
    const height = 92;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const events = [...this.events.values()];
    const actions = [...this.actions.values()];
    const times = [
      ...events.map((e) => Date.parse(e.time)),
      ...actions.flatMap((a) => [a.created_at, a.finished_at].filter(Boolean).map(Date.parse)),
    ];
    const caption = $("#timeline-caption");
    if (!times.length) {
      svg.replaceChildren(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "Nothing to show"));
      caption.textContent = "Timeline: no events or actions to show.";
      return;
    }
    let t0 = this.filters.since ? Date.parse(this.filters.since) : Math.min(...times);
    let t1 = this.filters.until ? Date.parse(this.filters.until) : Math.max(...times, Date.now());
    if (t1 - t0 < 10000) {
      const mid = (t0 + t1) / 2;
      t0 = mid - 5000;
      t1 = mid + 5000;
    }
    const left = 70;
    const right = width - 12;
    const x = (t) => left + ((t - t0) / (t1 - t0)) * (right - left);
    const children = [
      s("text", { x: 6, y: 28, class: "lane-label" }, "Events"),
      s("text", { x: 6, y: 60, class: "lane-label" }, "Actions"),
      s("line", { x1: left, x2: right, y1: 76, y2: 76, class: "axis" }),
    ];
    for (const tick of ticks(t0, t1)) {
      children.push(
        s("line", { x1: x(tick), x2: x(tick), y1: 10, y2: 76, class: "axis" }),
        s("text", { x: x(tick), y: 89, "text-anchor": "middle" }, clock(new Date(tick))),
      );
    }
    for (const a of actions) {
      const start = Date.parse(a.started_at ?? a.created_at);
      const end = a.finished_at ? Date.parse(a.finished_at) : Date.now();
      const x0 = x(start);
      const w = Math.max(4, x(end) - x0);
      children.push(
        s("rect", { x: x0, y: 49, width: w, height: 14, rx: 2, class: `ac-${a.status}` },
          s("title", {}, `#${a.id} ${words(a.type)} ${a.node ?? a.job ?? ""}: ${a.status}`)),
      );
    }
    for (const e of events) {
      children.push(
        s("circle", { cx: x(Date.parse(e.time)), cy: 24, r: 5, class: `ev-${eventCategory(e.type)}` },
          s("title", {}, `#${e.id} ${words(e.type)}${e.node ? ` on ${e.node}` : ""} at ${clock(new Date(e.time))}`)),
      );
    }
    svg.replaceChildren(...children);
    const failures = events.filter((e) => eventCategory(e.type) === "failure").length;
    caption.textContent =
      `Timeline from ${clock(new Date(t0))} to ${clock(new Date(t1))}: ${events.length} events ` +
      `(${failures} failures) and ${actions.length} actions. The tables below list them.`;
  }
}

function inRange(iso, f) {
  const t = Date.parse(iso);
  return (!f.since || t >= Date.parse(f.since)) && (!f.until || t < Date.parse(f.until));
}

const STATUS_ORDER = { pending: 0, running: 1, succeeded: 2, failed: 2 };

/** Whether `a` is a later state of the same action than `b` (updates may cross a reload). */
function newer(a, b) {
  const rank = (x) => [STATUS_ORDER[x.status] ?? 0, x.attempts, x.error ? 1 : 0];
  const [ra, rb] = [rank(a), rank(b)];
  for (let i = 0; i < ra.length; i++) if (ra[i] !== rb[i]) return ra[i] > rb[i];
  return true;
}

function details(e) {
  const entries = Object.entries(e.details ?? {});
  const parts = [];
  if (e.policy_error) parts.push(`policy failed: ${e.policy_error.slice(0, 120)}`);
  if (e.rank !== null && e.rank !== undefined) parts.push(`rank ${e.rank}`);
  for (const [key, value] of entries) {
    let text = typeof value === "object" ? JSON.stringify(value) : String(value);
    if (/^\d{4}-\d\d-\d\dT\d\d:\d\d/.test(text)) text = clock(new Date(text));
    parts.push(`${words(key)} ${text.length > 80 ? `${text.slice(0, 77)}…` : text}`);
  }
  return parts.join(" · ") || "—";
}

const STEPS_MS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]
  .map((sec) => sec * 1000);

function ticks(t0, t1) {
  const step = STEPS_MS.find((ms) => (t1 - t0) / ms <= 6) ?? 86400000 * Math.ceil((t1 - t0) / 86400000 / 6);
  const out = [];
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) out.push(t);
  return out;
}
