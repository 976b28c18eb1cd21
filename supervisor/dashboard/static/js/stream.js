// The live stream (GET /api/v1/stream, server-sent events) read with fetch(), so the
// token travels in a header and never in a URL. Reconnects with backoff and sends the
// last id seen as Last-Event-ID, so the server replays what was missed (or says resync).

import { authHeaders, unauthorized } from "./api.js";

const FIRST_DELAY_MS = 500;
const MAX_DELAY_MS = 15000;
// The server sends a keepalive comment every 15 s: a silent stream is a dead one.
const SILENCE_MS = 40000;

export class LiveStream {
  /**
   * handlers: message({kind, id, data}), resync(), status(state, detail)
   * where state is "connecting" | "live" | "reconnecting" | "signed-out".
   */
  constructor(handlers, url = "/api/v1/stream") {
    this.handlers = handlers;
    this.url = url;
    this.lastId = null;
    this.connections = 0;
    this.controller = null;
    this.stopped = true;
    this.wake = null;
    this.generation = 0;
  }

  start() {
    if (!this.stopped) return;
    this.stopped = false;
    this.generation += 1;
    this.run(this.generation);
  }

  stop() {
    this.stopped = true;
    this.controller?.abort();
    this.wake?.();
  }

  /** Try again now (e.g. the browser says it is back online). */
  retryNow() {
    this.wake?.();
  }

  async run(generation) {
    let failures = 0;
    const over = () => this.stopped || generation !== this.generation;
    while (!over()) {
      this.controller = new AbortController();
      this.handlers.status(failures ? "reconnecting" : "connecting", "");
      let response;
      try {
        const headers = authHeaders({ Accept: "text/event-stream" });
        if (this.lastId) headers.set("Last-Event-ID", this.lastId);
        response = await fetch(this.url, {
          headers,
          cache: "no-store",
          signal: this.controller.signal,
        });
      } catch {
        response = null;
      }
      if (over()) return;
      if (response && response.status === 401) {
        this.stopped = true;
        this.handlers.status("signed-out", "");
        unauthorized();
        return;
      }
      if (response && response.ok && response.body) {
        this.connections += 1;
        failures = 0;
        this.handlers.status("live", "");
        try {
          await this.read(response.body);
        } catch {
          // dropped: fall through to reconnect
        }
        if (over()) return;
      }
      failures += 1;
      const base = Math.min(MAX_DELAY_MS, FIRST_DELAY_MS * 2 ** (failures - 1));
      const delay = Math.round(base * (0.75 + Math.random() * 0.5));
      this.handlers.status("reconnecting", `retrying in ${Math.ceil(delay / 1000)} s`);
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, delay);
        this.wake = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      this.wake = null;
    }
  }

  async read(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let silence = setTimeout(() => this.controller.abort(), SILENCE_MS);
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        clearTimeout(silence);
        silence = setTimeout(() => this.controller.abort(), SILENCE_MS);
        buffer += value.replaceAll("\r\n", "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          this.dispatch(block);
        }
      }
    } finally {
      clearTimeout(silence);
      reader.cancel().catch(() => {});
    }
  }

  dispatch(block) {
    let id = null;
    let kind = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "id") id = value;
      else if (field === "event") kind = value;
      else if (field === "data") data.push(value);
    }
    if (id !== null) this.lastId = id;
    if (!data.length) return;
    if (kind === "resync") {
      this.handlers.resync();
      return;
    }
    let parsed;
    try {
      parsed = JSON.parse(data.join("\n"));
    } catch {
      return;
    }
    this.handlers.message({ kind, id, data: parsed });
  }
}
