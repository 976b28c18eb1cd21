// The REST API as the page uses it: the operator token (sessionStorage) as a bearer
// header, JSON in and out, and errors carrying the server's message.

const TOKEN_KEY = "supervisor.operatorToken";

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

const listeners = new Set();

/** Called with no argument whenever the server answers 401 (token missing or wrong). */
export function onUnauthorized(fn) {
  listeners.add(fn);
}

export function unauthorized() {
  for (const fn of listeners) fn();
}

export function authHeaders(extra = {}) {
  const headers = new Headers(extra);
  const t = token();
  if (t) headers.set("Authorization", `Bearer ${t}`);
  return headers;
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = authHeaders({ Accept: "application/json" });
  if (body !== undefined) headers.set("Content-Type", "application/json");
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  if (response.status === 204) return null;
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    if (response.status === 401) unauthorized();
    throw new ApiError(response.status, messageOf(data) || `${response.status} ${response.statusText}`);
  }
  return data;
}

function messageOf(data) {
  if (!data) return "";
  if (typeof data.message === "string") return data.message;
  if (typeof data.detail === "string") return data.detail;
  return "";
}

/** A query string from an object; arrays repeat the key, empty values are left out. */
export function query(params) {
  const q = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    for (const v of Array.isArray(value) ? value : [value]) {
      if (v !== "" && v !== null && v !== undefined) q.append(key, String(v));
    }
  }
  const text = q.toString();
  return text ? `?${text}` : "";
}
