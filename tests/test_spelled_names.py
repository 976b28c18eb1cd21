"""No fault kind and no checkpoint tier is spelled as a string literal in the source
packages: each is a member of its table (`FaultKind`, resiliency_protocol/faults.py;
`Tier`, resiliency_protocol/checkpoint_reports.py), so that a kind or tier renamed or
removed there is caught by mypy everywhere it is used; and the checkpoint manifest's file
name is spelled once, beside its one model. Reads the sources; starts nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

from resiliency_protocol.checkpoint_manifest import MANIFEST
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.faults import FaultKind
from resiliency_protocol.shared_settings import DEFAULT_CHECKPOINT_ROOT, HOST_MONITOR_ENV_PREFIX

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "host_monitor", "training", "policies", "bench")
TIERS = (Tier.RAM, Tier.PEER, Tier.DURABLE)
NAMES = frozenset(k.value for k in FaultKind) | frozenset(t.value for t in TIERS)
#: The modules that declare a vocabulary of their own with one of those words as a
#: member, each with why, in one word.
ALLOWED = {
    "supervisor/domain.py": "events",  # EventType.STRAGGLER: the event the sensor raises
}


def spelled(source: str, names: frozenset[str] = NAMES) -> list[tuple[int, str]]:
    """(line, word) of every string literal of `source` that is one of `names`."""
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    )


def test_no_fault_kind_or_tier_is_spelled_outside_its_table() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in ALLOWED:
                continue
            found += [f"{name}:{line}: {word!r}" for line, word in spelled(path.read_text())]
    assert not found, "spelled as strings, use FaultKind / Tier:\n" + "\n".join(found)


def test_each_allowed_module_declares_one_of_the_names() -> None:
    stale = [name for name in ALLOWED if not spelled((ROOT / name).read_text())]
    assert not stale, f"allowed but spelling none of the names any more: {stale}"


def test_the_scan_finds_a_name_wherever_it_is_spelled() -> None:
    source = (
        'KINDS = ("node_down", "other")\n'
        "def f(tier: str = 'durable') -> bool:\n"
        '    return tier in {"ram": 1}\n'
    )
    assert spelled(source) == [(1, "node_down"), (2, "durable"), (3, "ram")]
    assert spelled('x = f"{kind}_worker_crash"; y = "peers"; z = Tier.PEER') == []


def test_the_manifests_file_name_is_spelled_once() -> None:
    declared = "resiliency_protocol/checkpoint_manifest.py"
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line}"
        for package in (*PACKAGES, "resiliency_protocol")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != declared
        for line, _ in spelled(path.read_text(), frozenset({MANIFEST}))
    ]
    assert not found, f"{MANIFEST} spelled outside {declared}: {found}"
    assert spelled((ROOT / declared).read_text(), frozenset({MANIFEST}))


def test_the_shared_settings_strings_are_spelled_once() -> None:
    """The checkpoint root and the host monitor's environment prefix, which the supervisor,
    the host monitor and the workers must agree on, are spelled only where declared."""
    declared = "resiliency_protocol/shared_settings.py"
    words = frozenset({DEFAULT_CHECKPOINT_ROOT, HOST_MONITOR_ENV_PREFIX})
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line}: {word!r}"
        for package in (*PACKAGES, "resiliency_protocol")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != declared
        for line, word in spelled(path.read_text(), words)
    ]
    assert not found, f"spelled outside {declared}:\n" + "\n".join(found)
    assert len(spelled((ROOT / declared).read_text(), words)) == len(words)


def test_the_scan_finds_a_prefix_inside_a_formatted_string() -> None:
    words = frozenset({HOST_MONITOR_ENV_PREFIX})
    assert spelled('env = f"HOST_MONITOR_{name.upper()}"', words) == [(1, "HOST_MONITOR_")]


#: The checkpoint modules that loop over the tiers (training/checkpoint/tiers.py): none
#: of them names a tier, so that a new tier is a class in tiers.py and a row of `Tier`.
TIER_LOOPS = ("saver.py", "restorer.py", "world_fence.py", "emergency.py", "agreement.py")


def named_tiers(source: str) -> list[tuple[int, str]]:
    """(line, member) of every `Tier.<member>` of a tier that stores checkpoints."""
    members = {t.name for t in TIERS}
    return sorted(
        (node.lineno, node.attr)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Tier"
        and node.attr in members
    )


def test_the_saver_and_the_restorer_name_no_tier() -> None:
    found = [
        f"training/checkpoint/{name}:{line}: Tier.{member}"
        for name in TIER_LOOPS
        for line, member in named_tiers((ROOT / "training" / "checkpoint" / name).read_text())
    ]
    assert not found, "a branch on one tier, loop over `Tiers` instead:\n" + "\n".join(found)


def test_the_tier_scan_finds_a_member_wherever_it_is_named() -> None:
    source = "if tier == Tier.RAM:\n    pass\nx = (Tier.PEER, None)\ny = Tier.EMERGENCY\n"
    assert named_tiers(source) == [(1, "RAM"), (3, "PEER")]
