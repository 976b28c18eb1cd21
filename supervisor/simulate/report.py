"""A simulation's results: a table, JSON, and a chart (an SVG page, no plotting library)
of each run's goodput and badput side by side."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from supervisor.goodput.model import BADPUT_CATEGORIES
from supervisor.simulate.runner import RunResult

_HOURS = 3600.0


def as_json(runs: Sequence[RunResult], *, scenario: dict[str, Any]) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "runs": [
            {
                "name": r.name,
                "settings": r.settings,
                "goodput": round(r.goodput.goodput, 6),
                "wall_h": round(r.goodput.wall_s / _HOURS, 3),
                "productive_h": round(r.goodput.productive_s / _HOURS, 3),
                "badput_h": {
                    k.removesuffix("_s"): round(v / _HOURS, 3)
                    for k, v in r.goodput.badput.as_dict().items()
                },
                "failures": r.goodput.failures,
                "attempts": r.goodput.attempts,
                "last_step": r.goodput.last_step,
                "steps_redone": r.goodput.steps_redone,
                "faults": r.faults,
                "actions": r.actions,
                "events": r.events,
                "cluster": {
                    "spares_used": r.counters.spares_used,
                    "spares_returned": r.counters.spares_returned,
                    "repairs": r.counters.repairs,
                    "steps_lost": r.counters.steps_lost,
                    "reduced_replicas_h": round(r.counters.reduced_s / _HOURS, 3),
                    "no_spare_h": round(r.counters.no_spare_s / _HOURS, 3),
                    "pending_h": round(r.counters.pending_s / _HOURS, 3),
                    "faults_applied": r.counters.faults_applied,
                    "faults_skipped": r.counters.faults_skipped,
                },
                "simulated_s": r.simulated_s,
                "wall_clock_s": round(r.wall_s, 3),
            }
            for r in runs
        ],
    }


def as_table(runs: Sequence[RunResult]) -> str:
    """One column per run, one row per figure."""
    rows: list[tuple[str, list[str]]] = [
        ("goodput", [f"{r.goodput.goodput * 100:.2f}%" for r in runs]),
        ("wall time (h)", [f"{r.goodput.wall_s / _HOURS:.1f}" for r in runs]),
        ("productive (h)", [f"{r.goodput.productive_s / _HOURS:.2f}" for r in runs]),
    ]
    for name in BADPUT_CATEGORIES:
        label = name.removesuffix("_s").replace("_", " ")
        rows.append(
            (f"  {label} (h)", [f"{getattr(r.goodput.badput, name) / _HOURS:.2f}" for r in runs])
        )
    rows += [
        ("faults (applied)", [f"{r.faults} ({r.counters.faults_applied})" for r in runs]),
        ("failures handled", [str(r.goodput.failures) for r in runs]),
        ("steps lost", [str(r.counters.steps_lost) for r in runs]),
        (
            "spares used / back",
            [f"{r.counters.spares_used} / {r.counters.spares_returned}" for r in runs],
        ),
        ("fewer replicas (h)", [f"{r.counters.reduced_s / _HOURS:.2f}" for r in runs]),
        ("no spare left (h)", [f"{r.counters.no_spare_s / _HOURS:.2f}" for r in runs]),
        ("waiting for nodes (h)", [f"{r.counters.pending_s / _HOURS:.2f}" for r in runs]),
    ]
    types = sorted({t for r in runs for t in r.actions})
    for t in types:
        cells = []
        for r in runs:
            counts = r.actions.get(t, {})
            ok, failed = counts.get("succeeded", 0), counts.get("failed", 0)
            cells.append(f"{ok}" + (f" (+{failed} failed)" if failed else ""))
        rows.append((f"action {t}", cells))
    rows.append(("wall clock (s)", [f"{r.wall_s:.1f}" for r in runs]))
    header = ["", *(r.name for r in runs)]
    widths = [max(len(header[0]), *(len(label) for label, _ in rows))]
    for i in range(len(runs)):
        widths.append(max(len(header[i + 1]), *(len(cells[i]) for _, cells in rows)))
    lines = [
        "  ".join(
            h.ljust(w) if j == 0 else h.rjust(w)
            for j, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    for label, cells in rows:
        parts = [label.ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)
        ]
        lines.append("  ".join(parts))
    return "\n".join(lines) + "\n"


_COLOURS = {
    "productive_s": "#2e7d32",
    "lost_progress_s": "#c62828",
    "detection_s": "#ef6c00",
    "remediation_s": "#f9a825",
    "restart_s": "#6a1b9a",
    "checkpoint_save_s": "#1565c0",
    "reduced_capacity_s": "#00838f",
    "idle_s": "#9e9e9e",
}


def as_html(runs: Sequence[RunResult], *, title: str) -> str:
    """A page with one stacked bar per run: productive time and each badput category,
    as shares of the wall time (the badput part magnified, since it is small)."""
    bar_h, gap, left, width = 28, 14, 160, 640
    height = len(runs) * (bar_h + gap) + 90
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 40}" '
        f'height="{height}" font-family="sans-serif" font-size="12">'
    ]
    worst = (
        max(
            (r.goodput.badput.total_s / r.goodput.wall_s for r in runs if r.goodput.wall_s),
            default=0.0,
        )
        or 1.0
    )
    for i, r in enumerate(runs):
        y = 20 + i * (bar_h + gap)
        wall = r.goodput.wall_s or 1.0
        parts.append(
            f'<text x="0" y="{y + bar_h * 0.7}">{html.escape(r.name)} '
            f"{r.goodput.goodput * 100:.2f}%</text>"
        )
        x = float(left)
        for name, seconds in r.goodput.badput.as_dict().items():
            w = width * (seconds / wall) / worst
            if w <= 0:
                continue
            parts.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar_h}" '
                f'fill="{_COLOURS[name]}"><title>{name}: {seconds / _HOURS:.2f} h'
                "</title></rect>"
            )
            x += w
    y = 20 + len(runs) * (bar_h + gap) + 10
    x = float(left)
    for name in BADPUT_CATEGORIES:
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{_COLOURS[name]}"/>')
        parts.append(f'<text x="{x + 14}" y="{y + 9}">{name.removesuffix("_s")}</text>')
        x += 14 + 7 * len(name)
        if x > left + width - 60:
            x, y = float(left), y + 16
    parts.append("</svg>")
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{r.goodput.goodput * 100:.2f}%</td>"
        + "".join(f"<td>{v / _HOURS:.2f}</td>" for v in r.goodput.badput.as_dict().values())
        + "</tr>"
        for r in runs
    )
    heads = "".join(f"<th>{n.removesuffix('_s')} (h)</th>" for n in BADPUT_CATEGORIES)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        "<p>Badput by cause, as a share of wall time (bars scaled to the worst run).</p>"
        + "".join(parts)
        + f"<table border='1' cellpadding='4'><tr><th>run</th><th>goodput</th>{heads}</tr>"
        + rows
        + "</table></body></html>\n"
    )


def scenario_summary(scenario: Any) -> dict[str, Any]:
    data = scenario.model_dump(mode="json")
    return {k: v for k, v in data.items() if k != "variants"} | {
        "variants": sorted(scenario.variants)
    }


__all__ = ["as_html", "as_json", "as_table", "scenario_summary"]
