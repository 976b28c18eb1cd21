"""One worker's side of the fence between worlds, for the NumPy workload's tiers (the rule
is training/checkpoint/fencing.py's, and so are the starts' files).

Starts are kept in the worker's local tier (`LOCAL_CKPT_DIR/.worlds`) and in the shared
durable tier (`DURABLE_CKPT_DIR/.worlds`), which also fences the emergency tier inside it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import fencing
from training.checkpoint.fencing import WorldStart
from training.worker_client import CheckpointTier

log = logging.getLogger(__name__)


def starts_roots(tiers: Mapping[CheckpointTier, Path]) -> dict[CheckpointTier, Path]:
    """Where the starts that fence each tier are kept: the emergency tier lives in the
    durable one and shares its starts."""
    roots = dict(tiers)
    if Tier.EMERGENCY in roots and Tier.DURABLE in roots:
        roots[Tier.EMERGENCY] = roots[Tier.DURABLE]
    return roots


class TierFence:
    def __init__(self, world: int | None, roots: Mapping[CheckpointTier, Path]) -> None:
        """`world`: the world this worker starts in (None: not known); `roots`: where
        the starts of each tier are kept (`starts_roots`)."""
        #: The world of this worker's checkpoints (None: not known, nothing fenced).
        self.world = world
        self.roots = dict(roots)

    def _distinct_roots(self) -> list[Path]:
        return list(dict.fromkeys(self.roots.values()))

    def starts(self) -> list[WorldStart]:
        """The starts this worker sees, in all its tiers."""
        return sorted({s for root in self._distinct_roots() for s in fencing.read_local(root)})

    def tier_starts(self, tier: CheckpointTier) -> list[WorldStart]:
        root = self.roots.get(tier)
        return fencing.read_local(root) if root is not None else []

    def adopt(self, starts: Iterable[WorldStart]) -> int | None:
        """At a restore, before this world's start is recorded: an older world than the
        newest start, or none, is a new run that reuses the tiers (`fencing.adopted`)."""
        self.world = fencing.adopted(self.world, starts)
        return self.world

    def check(self, tier: CheckpointTier) -> None:
        """Before a save to `tier`: StaleWorldCommit when a newer world started there."""
        if self.world is None:
            return
        fencing.refuse_if_stale(
            self.world, self.tier_starts(tier), f"{tier} tier {self.roots.get(tier)}"
        )

    def record(self, step: int) -> None:
        """This world restored `step` (0: starts fresh), in every tier this worker sees. A
        failure is logged: the check before each save and the other tiers still fence."""
        if self.world is None:
            return
        start = WorldStart(self.world, step)
        for root in self._distinct_roots():
            try:
                fencing.record_local(root, start)
            except OSError as exc:
                log.warning(
                    "checkpoint: start of world %d not recorded in %s: %r", self.world, root, exc
                )
