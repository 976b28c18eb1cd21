"""The layout's rules that hold themselves: no module of the product over 500 lines (a
module that grows past it has more than one job: split it by what it does), and each
vocabulary spelled out once, in its table: a fault kind only in resiliency_protocol's
`FAULTS` table (`FaultKind`), a checkpoint tier's name compared only in the training
side's tiers (training/checkpoint/tiers.py). A string spelled elsewhere is missed when the
table changes: a new kind is handled nowhere, a renamed tier is never matched."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.faults import FaultKind

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("resiliency_protocol", "supervisor", "host_monitor", "policies", "training", "bench")
MAX_LINES = 500
#: Written by Alembic, one per schema change, never edited afterwards.
GENERATED = ("supervisor/store/migrations/versions/",)
#: The fault kinds' one table.
FAULT_TABLE = "resiliency_protocol/faults.py"
FAULT_KINDS = frozenset(kind.value for kind in FaultKind)
#: The tiers a training process saves to, and the one module that names them.
TIER_NAMES = frozenset({Tier.RAM.value, Tier.PEER.value, Tier.DURABLE.value})
TIERS_MODULE = "training/checkpoint/tiers.py"


def modules(*packages: str) -> Iterator[tuple[str, Path]]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if not name.startswith(GENERATED):
                yield name, path


def test_no_module_is_over_500_lines() -> None:
    over = {}
    for name, path in modules(*PACKAGES):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            over[name] = lines
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def _declarations(tree: ast.Module) -> set[int]:
    """The string constants that declare a vocabulary rather than use one: docstrings,
    enum members' values, `Literal[...]`'s arguments and `Final` constants (another
    vocabulary may share a spelling: the GPU reports' `xid`, the `straggler` event)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            found.add(id(body[0].value))  # a docstring, if a string
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.Assign):
                    found.add(id(statement.value))
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
            found.update(id(n) for n in ast.walk(node.slice))
        if (
            isinstance(node, ast.AnnAssign)
            and node.value is not None
            and ast.unparse(node.annotation).startswith(("Final", "typing.Final"))
        ):
            found.add(id(node.value))
    return found


def fault_kinds_spelled_out(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Where a fault kind is written as a string outside its table."""
    found = []
    for name, path in modules(*packages):
        if name == FAULT_TABLE:
            continue
        tree = ast.parse(path.read_text())
        declared = _declarations(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in FAULT_KINDS
                and id(node) not in declared
            ):
                found.append(f"{name}:{node.lineno}: {node.value!r}")
    return found


def _strings(node: ast.expr) -> Iterator[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _strings(element)


def tier_names_compared(packages: tuple[str, ...] = ("training",)) -> list[str]:
    """Where a checkpoint tier's name is compared as a string (`==`, `in`, `case`)
    outside the tiers' module."""
    found = []
    for name, path in modules(*packages):
        if name == TIERS_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
            elif isinstance(node, ast.MatchValue):
                sides = [node.value]
            else:
                continue
            for side in sides:
                for constant in _strings(side):
                    if constant.value in TIER_NAMES:
                        found.append(f"{name}:{constant.lineno}: {constant.value!r}")
    return found


def test_fault_kinds_are_spelled_only_in_their_table() -> None:
    found = fault_kinds_spelled_out()
    where = f"fault kinds spelled as strings outside {FAULT_TABLE}"
    assert not found, f"{where} (use FaultKind, or another vocabulary's named constant): {found}"


def test_tier_names_are_compared_only_in_the_tiers_module() -> None:
    found = tier_names_compared()
    assert not found, (
        f"checkpoint tiers compared by name outside {TIERS_MODULE} (use the tier objects): {found}"
    )
