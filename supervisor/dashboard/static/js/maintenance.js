// Maintenance windows (GET /api/v1/maintenance): the open ones (their node is out until
// the end) and the ones to come, in the nodes panel; the nodes under them are marked on
// their cards and in the grid's hover text.
//
// Live, and light: one read of the list at each resync, again when the stream tells of
// an action a window took (its start or its end, `source: maintenance`), and every
// RESYNC_MS for windows another client created or cancelled (no event tells of those).
// Never a read per node.

import { api } from "./api.js";
import { $, h } from "./dom.js";
import { clock, duration, timeEl, words } from "./format.js";

const RESYNC_MS = 60000;
// A window's steps are several actions in a row: read the list once they are through.
const AFTER_ACTION_MS = 500;
const SHOWN = 20;

export class Maintenance {
  constructor({ onChange }) {
    this.onChange = onChange;
    this.box = $("#maintenance");
    this.list = $("#maintenance-list");
    this.result = $("#maintenance-result");
    this.windows = [];
    this.byNode = new Map(); // node -> its open window, else its next one
    this.operator = false;
    this.reads = 0;
    this.timer = null;
    this.soon = null;
    this.loading = null;
    setInterval(() => this.tickTimes(), 15000); // "in 3 min" grows stale otherwise
  }

  setInfo(info) {
    this.operator = Boolean(info.operator);
  }

  /** The window that concerns a node: open now, else the first to come; or undefined. */
  of(name) {
    return this.byNode.get(name);
  }

  async load() {
    if (this.loading) return this.loading;
    this.loading = (async () => {
      try {
        this.reads += 1;
        this.set(await api("/api/v1/maintenance"));
      } catch (err) {
        // 503: this replica does not act (a standby); it holds no windows to show.
        this.set([], err.status === 503 ? "" : `Could not list maintenance windows: ${err.message}`);
      } finally {
        this.loading = null;
        clearTimeout(this.timer);
        this.timer = setTimeout(() => this.load(), RESYNC_MS);
      }
    })();
    return this.loading;
  }

  /** A live action: one a window took means the list moved on (opened, or ended). */
  onAction(action) {
    if (action.source !== "maintenance" || this.soon) return;
    this.soon = setTimeout(() => {
      this.soon = null;
      this.load();
    }, AFTER_ACTION_MS);
  }

  set(windows, error = "") {
    const before = JSON.stringify(this.windows);
    this.windows = windows;
    this.byNode = new Map();
    for (const w of windows) {
      const known = this.byNode.get(w.node);
      if (!known || (w.state === "open" && known.state !== "open")) this.byNode.set(w.node, w);
    }
    this.render(error);
    if (JSON.stringify(windows) !== before) this.onChange();
  }

  render(error = "") {
    const open = this.windows.filter((w) => w.state === "open");
    this.box.hidden = !this.windows.length && !error && !this.result.textContent;
    $("#maintenance-title").textContent = this.windows.length
      ? `Maintenance: ${open.length} open, ${this.windows.length - open.length} to come`
      : "Maintenance";
    if (error) {
      this.list.replaceChildren(h("li", { class: "error" }, error));
      return;
    }
    if (!this.windows.length) {
      this.list.replaceChildren(h("li", {}, "None."));
      return;
    }
    const items = this.windows.slice(0, SHOWN).map((w) => this.item(w));
    if (this.windows.length > SHOWN) items.push(h("li", {}, `and ${this.windows.length - SHOWN} more (supervisor get maintenance)`));
    this.list.replaceChildren(...items);
  }

  item(w) {
    const isOpen = w.state === "open";
    return h(
      "li",
      { "data-window": w.id, "data-node": w.node, "data-state": w.state },
      h("span", { class: `badge ${isOpen ? "cordoned" : "pending"}` }, isOpen ? "open" : "scheduled"),
      " ",
      h("strong", {}, w.node),
      w.job ? ` (${w.job})` : "",
      isOpen ? " out until " : " out from ",
      isOpen ? null : [timeEl(w.start), " to "],
      timeEl(w.end),
      " ",
      h("span", { class: "when", "data-at": isOpen ? w.end : w.start }, relative(isOpen ? w.end : w.start)),
      ` · next: ${w.steps.map(words).join(", ")}`,
      w.reason ? h("span", { class: "muted" }, ` · ${w.reason}`) : null,
      this.operator
        ? h(
            "button",
            {
              type: "button",
              class: "secondary",
              "aria-label": `Cancel the maintenance window on ${w.node}`,
              onclick: () => this.cancel(w),
            },
            isOpen ? "End now" : "Cancel",
          )
        : null,
    );
  }

  tickTimes() {
    for (const el of this.list.querySelectorAll(".when[data-at]")) el.textContent = relative(el.dataset.at);
  }

  async cancel(w) {
    try {
      await api(`/api/v1/maintenance/${w.id}`, { method: "DELETE" });
      this.report(w.state === "open" ? `Window on ${w.node} ended: it is uncordoned.` : `Window on ${w.node} cancelled.`, false);
    } catch (err) {
      this.report(`Could not cancel the window on ${w.node}: ${err.message}`, true);
    }
    this.load();
  }

  report(text, isError) {
    this.result.textContent = text;
    this.result.className = isError ? "error" : "";
  }
}

/** "(in 2.0 h)" for a time to come, "(3 min ago)" for one past. */
function relative(iso) {
  const seconds = (Date.parse(iso) - Date.now()) / 1000;
  return seconds >= 0 ? `(in ${duration(seconds)})` : `(${duration(-seconds)} ago)`;
}

/** A node's note on its card: what its window does to it, and when. */
export function maintenanceNote(w) {
  if (!w) return null;
  const until = clock(new Date(w.end));
  if (w.state === "open") return `maintenance: out until ${until}${w.reason ? ` (${w.reason})` : ""}`;
  return `maintenance from ${clock(new Date(w.start))} to ${until}`;
}
