"""How the operator commands print, with kubectl's `-o`: aligned tables (`wide` adds
columns), `name` (kind/name lines), JSON, YAML and `jsonpath=TEMPLATE`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from supervisor.ops import jsonpath

#: `table`, `json`, `yaml` (every command); `wide`, `name` and `jsonpath=TEMPLATE` where
#: the command lists or shows objects (`output_format`).
Format = str
FORMATS: tuple[Format, ...] = ("table", "json", "yaml")
KUBECTL_FORMATS: tuple[Format, ...] = ("table", "wide", "name", "json", "yaml")
JSONPATH = "jsonpath="
Row = Mapping[str, Any]

#: Spaces between table columns (as kubectl).
GAP = "   "


def output_format(value: str) -> Format:
    """`-o` of the commands with kubectl's formats: a template is checked here, so a bad
    one is a usage error before anything is asked of the server."""
    if value.startswith(JSONPATH):
        try:
            jsonpath.parse(value[len(JSONPATH) :])
        except jsonpath.JsonPathError as exc:
            raise argparse.ArgumentTypeError(f"jsonpath: {exc}") from None
        return value
    if value not in KUBECTL_FORMATS:
        raise argparse.ArgumentTypeError(
            f"{value!r}: one of {', '.join(KUBECTL_FORMATS)}, jsonpath=TEMPLATE"
        )
    return value


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    value: Callable[[Row], str]
    #: Shown with `-o wide` only.
    wide: bool = False


def field(
    header: str, key: str, render: Callable[[Any], str] | None = None, *, wide: bool = False
) -> Column:
    """A column showing one field of each row."""
    shown = render or text
    return Column(header, lambda row: shown(row.get(key)), wide)


def text(value: Any) -> str:
    """A value on one line: `-` for nothing, `k=v` pairs for a mapping."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(text(v) for v in value) or "-"
    if isinstance(value, dict):
        return " ".join(f"{k}={text(v)}" for k, v in value.items()) or "-"
    return " ".join(str(value).split())  # a newline would break the table's rows


def truncated(value: str, width: int) -> str:
    return value if len(value) <= width else value[: width - 3] + "..."


def when(value: Any) -> str:
    """An API time (ISO 8601) to the second, in UTC."""
    if not isinstance(value, str):
        return text(value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return value
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def age(value: Any, now: datetime | None = None) -> str:
    """How long ago an API time (ISO 8601) was, as kubectl's AGE column: 12s, 3m12s."""
    if not isinstance(value, str):
        return text(value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return value
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    seconds = ((now or datetime.now(UTC)) - parsed).total_seconds()
    return duration(max(0.0, seconds))


def duration(seconds: Any) -> str:
    """Seconds as kubectl writes ages: 4.2s, 3m12s, 5h2m, 2d3h."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return text(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60}m"
    return f"{whole // 86400}d{whole % 86400 // 3600}h"


def percent(fraction: Any) -> str:
    if not isinstance(fraction, int | float) or isinstance(fraction, bool):
        return text(fraction)
    return f"{fraction * 100:.1f}%"


def table(
    rows: Sequence[Row], columns: Sequence[Column], *, wide: bool = False, headers: bool = True
) -> str:
    columns = [c for c in columns if wide or not c.wide]
    cells = [[c.header for c in columns]] if headers else []
    cells += [[c.value(row) for c in columns] for row in rows]
    if not cells:
        return ""
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        GAP.join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def auto_columns(rows: Sequence[Row]) -> list[Column]:
    """A column per key of the rows, in the order they first appear."""
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row))
    return [field(key.upper().replace("_", "-"), key) for key in keys]


def describe(obj: Row) -> str:
    """An object as `key: value` lines; nested objects indented, lists of objects as
    tables (a node's workers)."""
    return "\n".join(_described(obj, 0))


def _described(obj: Row, indent: int) -> Iterator[str]:
    pad = " " * indent
    width = max((len(str(key)) for key in obj), default=0) + 1
    for key, value in obj.items():
        if isinstance(value, dict) and value:
            yield f"{pad}{key}:"
            yield from _described(value, indent + 2)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            yield f"{pad}{key}:"
            yield indented(table(value, auto_columns(value)), indent + 2)
        else:
            yield f"{pad}{f'{key}:'.ljust(width)}  {text(value)}"


def indented(block: str, by: int) -> str:
    return "\n".join(" " * by + line if line else line for line in block.split("\n"))


def names(data: Any, kind: str) -> str:
    """`-o name`: one `kind/name` line per object (its id where it has no name)."""
    items = data if isinstance(data, list) else [data]
    return "\n".join(f"{kind}/{item.get('name', item.get('id'))}" for item in items)


def dump(data: Any, fmt: Format) -> str:
    """JSON, YAML or a jsonpath template of what the API answered, for scripts. A
    template sees a list as kubectl's do: `{.items[*].name}`."""
    if fmt.startswith(JSONPATH):
        scope = {"items": data} if isinstance(data, list) else data
        return jsonpath.render(fmt[len(JSONPATH) :], scope)
    if fmt == "yaml":
        import yaml  # here: only this format needs it, and every call would pay its import

        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")
    return json.dumps(data, indent=2, ensure_ascii=False)


def json_line(record: Any) -> str:
    """One object on one line (a stream of them is what jq reads)."""
    return json.dumps(record, ensure_ascii=False)
