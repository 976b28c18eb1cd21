// Tiny DOM helpers: build elements without innerHTML (no markup injection from data).

/**
 * h("td", {class: "num", title: "x"}, "text", childNode, ...)
 * Attributes starting with "on" are listeners; `null`/`false` attributes are skipped.
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";

export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else {
      el.setAttribute(name, value === true ? "" : String(value));
    }
  }
}

function append(el, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

export function $(selector, root = document) {
  return root.querySelector(selector);
}

export function replaceChildren(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

/** Options for a <select>: [[value, label], ...]; keeps the current value if still offered. */
export function setOptions(select, options, { keep = true } = {}) {
  const current = select.value;
  select.replaceChildren(...options.map(([value, label]) => h("option", { value }, label)));
  if (keep && options.some(([value]) => value === current)) select.value = current;
}

/** Run `fn` at most once per `ms`, trailing. */
export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}
