"""Label and field selectors, as ``k8s.io/apimachinery/pkg/labels`` and ``.../fields`` parse them.

Label selector grammar (``labels.Parse``): comma-separated requirements, each one of
``key``, ``!key``, ``key=v``, ``key==v``, ``key!=v``, ``key in (a,b)``,
``key notin (a,b)``, ``key>n``, ``key<n``. ``!=`` and ``notin`` also match objects
that lack the key. A malformed selector is a 400 BadRequest.

Field selectors (``fields.ParseSelector``): ``field=v``, ``field==v``, ``field!=v``,
comma-separated (AND). Only the field labels the kind supports are accepted; any
other is 400 ``field label not supported: <f>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .resources import Obj, Resource, bad_request, get_path

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_KEY_RE = re.compile(rf"^({_PREFIX}/)?{_NAME}$")
_VALUE_RE = re.compile(rf"^({_NAME})?$")
_TOKEN_RE = re.compile(r"\s*(==|!=|=|!|\(|\)|,|>|<|[^\s=!(),<>]+)")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !, =, !=, in, notin, gt, lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        val = labels.get(self.key)
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if self.op in ("=", "in"):
            return has and val in self.values
        if self.op in ("!=", "notin"):
            return not has or val not in self.values
        if self.op in ("gt", "lt"):
            try:
                n = int(val or "")
            except ValueError:
                return False
            limit = int(self.values[0])
            return n > limit if self.op == "gt" else n < limit
        raise AssertionError(self.op)


LabelSelector = list[Requirement]


def _check_key(key: str) -> None:
    if not _KEY_RE.match(key) or len(key.split("/")[-1]) > 63:
        raise bad_request(
            f"unable to parse requirement: invalid label key {key!r}: name part must consist of "
            "alphanumeric characters, '-', '_' or '.', and must start and end with an "
            "alphanumeric character"
        )


def _check_value(value: str) -> None:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise bad_request(f"unable to parse requirement: invalid label value: {value!r}")


def parse_label_selector(text: str | None) -> LabelSelector:
    """labels.Parse. Raises ApiError(400) on a malformed selector."""
    if text is None or not text.strip():
        return []
    tokens = _TOKEN_RE.findall(text)
    if "".join(tokens) != re.sub(r"\s+", "", text):
        raise bad_request(f"unable to parse requirement: unexpected characters in {text!r}")
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise bad_request(f"unable to parse requirement: unexpected end of selector {text!r}")
        tok = str(tokens[pos])
        pos += 1
        return tok

    reqs: LabelSelector = []
    while True:
        tok = take()
        if tok == "!":
            key = take()
            _check_key(key)
            reqs.append(Requirement(key, "!"))
        else:
            key = tok
            _check_key(key)
            nxt = peek()
            if nxt is None or nxt == ",":
                reqs.append(Requirement(key, "exists"))
            elif nxt in ("=", "==", "!="):
                take()
                val = peek()
                value = "" if val is None or val == "," else take()
                _check_value(value)
                reqs.append(Requirement(key, "!=" if nxt == "!=" else "=", (value,)))
            elif nxt in ("in", "notin"):
                take()
                if take() != "(":
                    raise bad_request(f"unable to parse requirement: expected '(' in {text!r}")
                values: list[str] = []
                while True:
                    t = take()
                    if t == ")":
                        break
                    if t == ",":
                        continue
                    _check_value(t)
                    values.append(t)
                reqs.append(Requirement(key, nxt, tuple(values)))
            elif nxt in (">", "<"):
                take()
                num = take()
                if not num.isdigit():
                    raise bad_request(f"unable to parse requirement: {num!r} is not an integer")
                reqs.append(Requirement(key, "gt" if nxt == ">" else "lt", (num,)))
            else:
                raise bad_request(
                    f"unable to parse requirement: found '{nxt}', expected: "
                    "'=', '!=', '==', 'in', notin'"
                )
        sep = peek()
        if sep is None:
            return reqs
        if take() != ",":
            raise bad_request(f"unable to parse requirement: expected ',' in {text!r}")


def labels_of(obj: Obj) -> dict[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels if isinstance(labels, dict) else {}


def match_labels(sel: LabelSelector, obj: Obj) -> bool:
    labels = labels_of(obj)
    return all(r.matches(labels) for r in sel)


def label_selector_from_object(sel: Obj | None) -> LabelSelector | None:
    """metav1.LabelSelectorAsSelector: None matches nothing, {} matches everything."""
    if sel is None:
        return None
    reqs: LabelSelector = []
    for k, v in (sel.get("matchLabels") or {}).items():
        reqs.append(Requirement(k, "=", (v,)))
    for e in sel.get("matchExpressions") or []:
        op = e.get("operator")
        vals = tuple(e.get("values") or ())
        mapped = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}.get(op)
        if mapped is None:
            raise bad_request(f"{op!r} is not a valid label selector operator")
        reqs.append(Requirement(e["key"], mapped, vals))
    return reqs


# --- fields -------------------------------------------------------------------


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    value: str
    negate: bool


FieldSelector = list[FieldRequirement]

_FIELD_ALIASES = {"source": "source.component"}


def field_value(obj: Obj, fieldname: str) -> str:
    v: Any = get_path(obj, _FIELD_ALIASES.get(fieldname, fieldname))
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def parse_field_selector(text: str | None, res: Resource) -> FieldSelector:
    if text is None or not text.strip():
        return []
    reqs: FieldSelector = []
    for term in text.split(","):
        term = term.strip()
        if not term:
            continue
        m = re.match(r"^([^=!]+)(==|!=|=)(.*)$", term)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        fname, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if fname not in res.field_selectors:
            raise bad_request(f'field label not supported: "{fname}"')
        reqs.append(FieldRequirement(fname, value, op == "!="))
    return reqs


def match_fields(sel: FieldSelector, obj: Obj) -> bool:
    return all((field_value(obj, r.field) == r.value) != r.negate for r in sel)


Matcher = Callable[[Obj], bool]


def matcher(label_sel: LabelSelector, field_sel: FieldSelector) -> Matcher:
    def _m(obj: Obj) -> bool:
        return match_labels(label_sel, obj) and match_fields(field_sel, obj)

    return _m
