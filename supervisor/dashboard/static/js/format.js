// How times, ages and durations read on the page.

const pad = (n) => String(n).padStart(2, "0");

/** A <time> element: local clock time (with the date when not today), ISO in the title. */
export function timeEl(iso) {
  const el = document.createElement("time");
  if (!iso) {
    el.textContent = "—";
    return el;
  }
  const d = new Date(iso);
  el.dateTime = d.toISOString();
  el.title = d.toISOString();
  el.textContent = clock(d);
  return el;
}

export function clock(d) {
  const now = new Date();
  const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  if (d.toDateString() === now.toDateString()) return hms;
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hms}`;
}

/** "0.4 s", "12 s", "3 min", "2.5 h", "3 d". */
export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  const s = Math.max(0, seconds);
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 120) return `${Math.round(s)} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

export function ago(seconds) {
  return seconds === null || seconds === undefined ? "never" : `${duration(seconds)} ago`;
}

export function percent(fraction, digits = 1) {
  if (fraction === null || fraction === undefined || Number.isNaN(fraction)) return "—";
  return `${(fraction * 100).toFixed(digits)} %`;
}

/** Event/action type names as words: "host_heartbeat_lost" -> "host heartbeat lost". */
export function words(name) {
  return String(name).replaceAll("_", " ");
}

/** datetime-local value (local time) -> ISO 8601 UTC, or "" when empty. */
export function localInputToIso(value) {
  if (!value) return "";
  const d = new Date(value);
  return Number.isNaN(d.getTime()) ? "" : d.toISOString();
}

/** ISO 8601 -> datetime-local value in local time. */
export function isoToLocalInput(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return "";
  return (
    `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}` +
    `T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`
  );
}
