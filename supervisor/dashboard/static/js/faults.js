// Fault injection (shown only when the supervisor has it enabled and the page holds the
// operator token): a form for POST /api/v1/faults and the list of active faults.

import { api, query } from "./api.js";
import { $, h, setOptions } from "./dom.js";
import { timeEl, words } from "./format.js";

export class Faults {
  constructor() {
    this.section = $("#faults-section");
    this.form = $("#fault-form");
    this.kind = $("#fault-kind");
    this.node = $("#fault-node");
    this.result = $("#fault-result");
    this.enabled = false;
    this.params = {};
    this.kind.addEventListener("change", () => this.showFields());
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.inject();
    });
  }

  /** Shown only with fault injection on and the operator token in hand. */
  setInfo(info) {
    this.enabled = Boolean(info.enable_fault_injection && info.operator);
    this.section.hidden = !this.enabled;
    $("#faults-link").hidden = !this.enabled;
    if (!this.enabled) return;
    // Each kind's parameters come from the protocol's table, through /api/v1/info.
    this.params = info.fault_params;
    setOptions(this.kind, info.fault_kinds.map((k) => [k, words(k)]));
    this.showFields();
  }

  setNodes(nodes) {
    setOptions(this.node, nodes.map((n) => [n.name, n.job ? `${n.name} (${n.job})` : n.name]));
  }

  showFields() {
    const taken = this.params?.[this.kind.value] ?? [];
    for (const field of this.form.querySelectorAll(".field[data-param]")) {
      const on = [...field.querySelectorAll("input")].some((input) => taken.includes(input.name));
      field.hidden = !on;
      for (const input of field.querySelectorAll("input")) input.disabled = !on;
    }
  }

  body() {
    const body = { kind: this.kind.value, node: this.node.value };
    for (const input of this.form.querySelectorAll(".field[data-param] input")) {
      if (input.disabled || input.value === "") continue;
      body[input.name] = Number(input.value);
    }
    return body;
  }

  async inject() {
    const body = this.body();
    const missing = [...this.form.querySelectorAll("input:not(:disabled), select")].find(
      (el) => !el.checkValidity(),
    );
    if (missing) {
      this.report(`${missing.labels[0]?.textContent ?? missing.name}: ${missing.validationMessage}`, true);
      missing.focus();
      return;
    }
    const button = this.form.querySelector("button[type=submit]");
    button.disabled = true;
    try {
      const fault = await api("/api/v1/faults", { method: "POST", body });
      this.report(`Fault #${fault.id} injected: ${words(fault.kind)} on ${fault.node}.`, false);
      this.load();
    } catch (err) {
      this.report(`Not injected: ${err.message}`, true);
    } finally {
      button.disabled = false;
    }
  }

  report(text, isError) {
    this.result.textContent = text;
    this.result.className = isError ? "error" : "";
  }

  async load() {
    if (!this.enabled) return;
    const list = $("#active-faults");
    try {
      const faults = await api(`/api/v1/faults${query({ active: true })}`);
      $("#active-faults-title").textContent = faults.length ? `Active faults (${faults.length})` : "Active faults";
      if (!faults.length) {
        list.replaceChildren(h("li", {}, "None."));
        return;
      }
      list.replaceChildren(
        ...faults.map((f) =>
          h(
            "li",
            { "data-fault": f.id },
            h("span", {}, `#${f.id} ${words(f.kind)} ${f.node ?? f.job ?? ""} since `, timeEl(f.created_at)),
            h(
              "button",
              { type: "button", class: "secondary", "aria-label": `End fault #${f.id}`, onclick: () => this.end(f.id) },
              "End",
            ),
          ),
        ),
      );
    } catch (err) {
      list.replaceChildren(h("li", { class: "error" }, `Could not list faults: ${err.message}`));
    }
  }

  async end(id) {
    try {
      await api(`/api/v1/faults/${id}`, { method: "DELETE" });
      this.report(`Fault #${id} ended.`, false);
    } catch (err) {
      this.report(`Could not end fault #${id}: ${err.message}`, true);
    }
    this.load();
  }
}
