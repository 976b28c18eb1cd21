"""Plain-text table with aligned columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HEADER = ("Measurement", "Result", "Baseline (same run)", "Target", "Verdict")


@dataclass(frozen=True, slots=True)
class Row:
    measurement: str
    result: str
    baseline: str = "-"
    target: str = "-"
    verdict: str = "info"

    def cells(self) -> tuple[str, str, str, str, str]:
        return (self.measurement, self.result, self.baseline, self.target, self.verdict)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def render(rows: Sequence[Row]) -> str:
    table = [HEADER, *(row.cells() for row in rows)]
    widths = [max(len(line[col]) for line in table) for col in range(len(HEADER))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(HEADER), rule, *(line(row.cells()) for row in rows)])
