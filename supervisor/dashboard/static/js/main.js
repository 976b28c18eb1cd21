// Boots the dashboard: asks for the operator token when the API wants one, loads each
// panel, and keeps them current from the live stream.

import { ApiError, api, onUnauthorized, setToken, token } from "./api.js";
import { $ } from "./dom.js";
import { Faults } from "./faults.js";
import { words } from "./format.js";
import { Goodput } from "./goodput.js";
import { History } from "./history.js";
import { Maintenance } from "./maintenance.js";
import { Nodes } from "./nodes.js";
import { LiveStream } from "./stream.js";

const STATUS_TEXT = {
  connecting: "Connecting…",
  live: "Live",
  reconnecting: "Connection lost: reconnecting",
  "signed-out": "Signed out",
};

class Announcer {
  // Screen readers hear live updates in small batches, not one message per row.
  constructor(el) {
    this.el = el;
    this.pending = [];
    this.timer = null;
  }

  say(text) {
    this.pending.push(text);
    if (this.timer) return;
    this.timer = setTimeout(() => {
      const items = this.pending.splice(0);
      this.timer = null;
      this.el.textContent = items.length > 3 ? `${items.length} updates: ${items.slice(-3).join("; ")}` : items.join("; ");
    }, 1000);
  }
}

class Dashboard {
  constructor() {
    this.announcer = new Announcer($("#announcer"));
    this.history = new History({ announce: (t) => this.announcer.say(t) });
    this.nodes = new Nodes({
      onChange: (nodes) => this.nodesChanged(nodes),
      maintenanceOf: (name) => this.maintenance.of(name),
    });
    this.maintenance = new Maintenance({ onChange: () => this.nodes.render() });
    this.faults = new Faults();
    this.goodput = new Goodput();
    this.stream = new LiveStream({
      message: (m) => this.onMessage(m),
      resync: () => this.loadAll(),
      status: (state, detail) => this.setStatus(state, detail),
    });
    this.jobs = [];
    this.loaded = false;
    this.refreshJobs = debounceLeading(() => this.loadJobs(), 1000);
    onUnauthorized(() => this.signIn("The operator token was refused. Enter it again."));
    $("#login-form").addEventListener("submit", (e) => this.submitToken(e));
    $("#forget-token").addEventListener("click", () => {
      if (!token()) {
        this.signIn();
        return;
      }
      setToken(null);
      location.reload();
    });
    window.addEventListener("online", () => this.stream.retryNow());
    // Escape on the token prompt: leave a way back to it.
    $("#login").addEventListener("cancel", () => {
      const button = $("#forget-token");
      button.hidden = false;
      button.textContent = "Enter operator token";
    });
  }

  async start() {
    await this.history.init();
    let info;
    try {
      info = await api("/api/v1/info");
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return; // signIn() is showing
      this.setStatus("offline", `cannot reach the supervisor: ${err.message}`);
      setTimeout(() => this.start(), 3000);
      return;
    }
    this.info = info;
    $("#about").textContent = `v${info.version} · backend ${info.backend}${info.dry_run ? " (dry run)" : ""}`;
    const button = $("#forget-token");
    button.hidden = false;
    button.textContent = token() ? "Forget token" : "Enter operator token";
    this.faults.setInfo(info);
    this.maintenance.setInfo(info);
    this.stream.start();
    // The stream's first message (resync) loads everything; if it cannot connect, load
    // anyway so the page shows the history while it keeps trying.
    setTimeout(() => {
      if (!this.loaded) this.loadAll();
    }, 3000);
  }

  signIn(message = "") {
    this.stream.stop();
    this.setStatus("signed-out", "");
    const dialog = $("#login");
    $("#login-error").textContent = token() ? message : "";
    if (!dialog.open) dialog.showModal();
    $("#token").focus();
  }

  async submitToken(event) {
    event.preventDefault();
    const value = $("#token").value.trim();
    if (!value) return;
    setToken(value);
    try {
      await api("/api/v1/info");
    } catch (err) {
      $("#login-error").textContent =
        err instanceof ApiError && err.status === 401 ? "That token was refused." : `Cannot check the token: ${err.message}`;
      return;
    }
    $("#login").close();
    $("#token").value = "";
    this.start();
  }

  setStatus(state, detail) {
    const el = $("#connection");
    el.dataset.state = state;
    el.textContent = (STATUS_TEXT[state] ?? "Offline") + (detail ? ` (${detail})` : "");
  }

  async loadAll() {
    this.loaded = true;
    await Promise.all([
      this.nodes.load(),
      this.loadJobs(),
      this.history.reload(),
      this.faults.load(),
      this.maintenance.load(),
    ]);
  }

  async loadJobs() {
    try {
      this.jobs = await api("/api/v1/jobs");
    } catch {
      return;
    }
    this.goodput.setJobs(this.jobs);
    this.history.setTargets(this.nodes.nodes.map((n) => n.name), this.jobs.map((j) => j.name));
  }

  nodesChanged(nodes) {
    this.faults.setNodes(nodes);
    this.history.setTargets(nodes.map((n) => n.name), this.jobs.map((j) => j.name));
  }

  onMessage({ kind, data }) {
    if (kind === "event") {
      this.history.onEvent(data);
      this.nodes.onEvent(data);
      this.goodput.onEvent(data);
      if (data.job && !this.jobs.some((j) => j.name === data.job)) this.refreshJobs();
      if (data.fault_id !== null) this.faults.load();
      this.announcer.say(`Event ${words(data.type)}${data.node ? ` on ${data.node}` : ""}`);
    } else if (kind === "action") {
      this.history.onAction(data);
      this.goodput.onEvent(data);
      this.nodes.onAction(data);
      this.maintenance.onAction(data);
      const target = data.node ?? data.job ?? "";
      this.announcer.say(`Action ${words(data.type)}${target ? ` on ${target}` : ""}: ${data.status}`);
    }
  }
}

/** Runs at once, then at most once per `ms` (a burst of messages -> two refreshes). */
function debounceLeading(fn, ms) {
  let waiting = false;
  let again = false;
  return () => {
    if (waiting) {
      again = true;
      return;
    }
    waiting = true;
    fn();
    setTimeout(() => {
      waiting = false;
      if (again) {
        again = false;
        fn();
      }
    }, ms);
  };
}

const dashboard = new Dashboard();
window.supervisorDashboard = dashboard; // for the browser tests and the curious
dashboard.start();
