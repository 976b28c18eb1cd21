"""`-o jsonpath=TEMPLATE` as kubectl reads it: text with `{...}` expressions.

kubectl's template language, not RFC 9535 JSONPath (no Python library reads the former):
`{.items[*].name}`, `{.items[0].workers[*].step}`, `{..name}`, filters such as
`{.items[?(@.status=="lost")].name}`, `{range .items[*]}{.name}{"\\n"}{end}`, and quoted
literals. Several results of one expression print space-separated; strings print as
they are, anything else as JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from supervisor.errors import SupervisorError


class JsonPathError(SupervisorError, ValueError):
    """A template that is not one of kubectl's JSONPath templates (its message says where)."""


@dataclass(frozen=True, slots=True)
class _Text:
    text: str


@dataclass(frozen=True, slots=True)
class _Expr:
    path: str


@dataclass(frozen=True, slots=True)
class _Range:
    path: str
    body: list[_Text | _Expr | _Range]


Node = _Text | _Expr | _Range


def parse(template: str) -> list[Node]:
    """The template's parts; JsonPathError for one kubectl would refuse."""
    stack: list[tuple[str, list[Node]]] = [("", [])]
    at = 0
    while at < len(template):
        start = template.find("{", at)
        if start < 0:
            stack[-1][1].append(_Text(template[at:]))
            break
        if start > at:
            stack[-1][1].append(_Text(template[at:start]))
        end = _closing(template, start)
        inner = template[start + 1 : end].strip()
        at = end + 1
        if inner.startswith("range "):
            stack.append((inner[6:].strip(), []))
        elif inner == "end":
            if len(stack) == 1:
                raise JsonPathError("{end} without {range}")
            path, body = stack.pop()
            stack[-1][1].append(_Range(path, body))
        elif inner[:1] in ("'", '"'):
            stack[-1][1].append(_Text(_literal(inner)))
        else:
            _steps(inner)  # checked now: an error names the template, not the data
            stack[-1][1].append(_Expr(inner))
    if len(stack) > 1:
        raise JsonPathError(f"{{range {stack[-1][0]}}} without {{end}}")
    return stack[0][1]


def render(template: str, data: Any) -> str:
    return "".join(_render(parse(template), data))


def _render(nodes: list[Node], data: Any) -> Iterator[str]:
    for node in nodes:
        if isinstance(node, _Text):
            yield node.text
        elif isinstance(node, _Expr):
            yield " ".join(_show(v) for v in evaluate(node.path, data))
        else:
            for item in evaluate(node.path, data):
                yield from _render(node.body, item)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _closing(template: str, start: int) -> int:
    quote = None
    for i in range(start + 1, len(template)):
        ch = template[i]
        if quote:
            if ch == "\\":
                continue
            if ch == quote and template[i - 1] != "\\":
                quote = None
        elif ch in ("'", '"'):
            quote = ch
        elif ch == "}":
            return i
    raise JsonPathError(f"unclosed {{ at {start}: {template[start:]!r}")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}


def _literal(text: str) -> str:
    if len(text) < 2 or text[-1] != text[0]:
        raise JsonPathError(f"unclosed quote: {text}")
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[0]), text[1:-1])


# --- paths --------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][\w-]*")
_FILTER = re.compile(r"^@((?:\.[\w-]+|\[\d+\])*)\s*(?:(==|!=|<=|>=|<|>)\s*(.+))?$")

Step = tuple[str, Any]


def _steps(path: str) -> list[Step]:
    text = path.strip()
    if text.startswith("$"):
        text = text[1:]
    steps: list[Step] = []
    at = 0
    while at < len(text):
        if text.startswith("..", at):
            match = _NAME.match(text, at + 2)
            if match is None:
                raise JsonPathError(f"expected a name after '..' in {path!r}")
            steps.append(("recursive", match[0]))
            at = match.end()
        elif text[at] == ".":
            if at + 1 == len(text):  # `{.}`: the current object
                at += 1
                continue
            match = _NAME.match(text, at + 1)
            if match is None:
                raise JsonPathError(f"expected a name after '.' in {path!r}")
            steps.append(("key", match[0]))
            at = match.end()
        elif text[at] == "[":
            end = _closing_bracket(text, at, path)
            steps.append(_bracket(text[at + 1 : end].strip(), path))
            at = end + 1
        else:
            raise JsonPathError(f"unexpected {text[at]!r} at {at} in {path!r}")
    return steps


def _closing_bracket(text: str, start: int, path: str) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "[":
            depth += 1
        elif text[i] == "]":
            depth -= 1
            if depth == 0:
                return i
    raise JsonPathError(f"unclosed [ in {path!r}")


def _bracket(inner: str, path: str) -> Step:
    if inner == "*":
        return ("all", None)
    if inner.startswith("?(") and inner.endswith(")"):
        match = _FILTER.match(inner[2:-1].strip())
        if match is None:
            raise JsonPathError(f"unsupported filter {inner!r} in {path!r}")
        sub = _steps(match[1]) if match[1] else []
        value = None if match[3] is None else _filter_value(match[3].strip(), path)
        return ("filter", (sub, match[2], value))
    if inner[:1] in ("'", '"'):
        return ("keys", [_literal(part.strip()) for part in inner.split(",")])
    try:
        if ":" in inner:
            bounds = [int(p) if p.strip() else None for p in inner.split(":")]
            if len(bounds) > 3:
                raise ValueError
            return ("slice", slice(*bounds))
        return ("indexes", [int(p) for p in inner.split(",")])
    except ValueError:
        raise JsonPathError(f"unsupported [{inner}] in {path!r}") from None


def _filter_value(text: str, path: str) -> Any:
    if text[:1] in ("'", '"'):
        return _literal(text)
    try:
        return json.loads(text)
    except ValueError:
        raise JsonPathError(f"bad value {text!r} in a filter of {path!r}") from None


def evaluate(path: str, data: Any) -> list[Any]:
    current = [data]
    for kind, arg in _steps(path):
        current = [out for value in current for out in _step(kind, arg, value)]
    return current


def _step(kind: str, arg: Any, value: Any) -> Iterator[Any]:
    if kind == "key":
        if isinstance(value, dict) and arg in value:
            yield value[arg]
    elif kind == "keys":
        if isinstance(value, dict):
            yield from (value[k] for k in arg if k in value)
    elif kind == "all":
        if isinstance(value, list):
            yield from value
        elif isinstance(value, dict):
            yield from value.values()
    elif kind == "indexes":
        if isinstance(value, list):
            yield from (value[i] for i in arg if -len(value) <= i < len(value))
    elif kind == "slice":
        if isinstance(value, list):
            yield from value[arg]
    elif kind == "recursive":
        yield from _recursive(arg, value)
    elif kind == "filter" and isinstance(value, list):
        yield from (item for item in value if _matches(arg, item))


def _recursive(name: str, value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        if name in value:
            yield value[name]
        for child in value.values():
            yield from _recursive(name, child)
    elif isinstance(value, list):
        for child in value:
            yield from _recursive(name, child)


def _matches(test: tuple[list[Step], str | None, Any], item: Any) -> bool:
    steps, op, expected = test
    found = [item]
    for kind, arg in steps:
        found = [out for value in found for out in _step(kind, arg, value)]
    if op is None:
        return bool(found) and found[0] not in (None, False)
    for value in found:
        try:
            if op == "==" and value == expected:
                return True
            if op == "!=" and value != expected:
                return True
            if op == "<" and value < expected:
                return True
            if op == "<=" and value <= expected:
                return True
            if op == ">" and value > expected:
                return True
            if op == ">=" and value >= expected:
                return True
        except TypeError:
            continue
    return False
