"""Which committed copies of a rank the peer store keeps: its newest save, and the save
before it in the same world.

Ranks that train in lockstep can end one save apart: a rank saved step s+1 (and had it
copied here) while another was stopped before its save of s+1. A new world restores the
newest step every rank holds; had this node kept only its partner's newest copy (s+1),
that rank would hold no copy of s, and the job would go back to an older step every rank
has (a durable one), losing every step since (seen with a cut-off node whose world trained
on for a few steps after the emergency checkpoint). The save before the newest is kept
while there is room for it beside the next copy under the store's cap
(HOST_MONITOR_PEER_STORE_MAX_BYTES), and only within the newest copy's world: once a new
world saves, it has already restored from a step no later than that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from host_monitor.peer.files import parse_step, read_manifest
from resiliency_protocol.checkpoint_manifest import Manifest


@dataclass(frozen=True, slots=True)
class Kept:
    """A committed copy: its step directory holds `manifest` and every file of it."""

    step: int
    manifest: Manifest
    path: Path


def committed(rank_dir: Path) -> list[Kept]:
    """The committed copies in `rank_dir`, the newest save first."""
    try:
        entries = list(rank_dir.iterdir())
    except FileNotFoundError:
        return []
    copies = []
    for entry in entries:
        step = parse_step(entry.name)
        if step is None:
            continue
        manifest = read_manifest(entry)
        if manifest is None or manifest.step != step:
            continue  # not committed (or not ours)
        copies.append(Kept(step, manifest, entry))
    return sorted(copies, key=functools.cmp_to_key(_newest_first))


def _newest_first(a: Kept, b: Kept) -> int:
    if a.manifest.newer_than(b.manifest):
        return -1
    return 1 if b.manifest.newer_than(a.manifest) else 0


def to_keep(copies: list[Kept], room_for: Callable[[Kept], bool]) -> list[Kept]:
    """Of `copies` (newest first), those to keep: the newest, and the save before it when
    it is of the same world and `room_for(it)` (the store's cap allows it beside the next
    copy)."""
    if not copies:
        return []
    newest, *older = copies
    kept = [newest]
    if older and older[0].manifest.world == newest.manifest.world and room_for(older[0]):
        kept.append(older[0])
    return kept
