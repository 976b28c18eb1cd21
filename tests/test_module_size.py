"""The layout's rules that hold themselves: no module of the product over 500 lines (a
module that grows past it has more than one job: split it by what it does)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("resiliency_protocol", "supervisor", "host_monitor", "policies", "training", "bench")
MAX_LINES = 500
#: Written by Alembic, one per schema change, never edited afterwards.
GENERATED = ("supervisor/store/migrations/versions/",)


def test_no_module_is_over_500_lines() -> None:
    over = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name.startswith(GENERATED):
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                over[name] = lines
    assert not over, f"modules over {MAX_LINES} lines: {over}"
