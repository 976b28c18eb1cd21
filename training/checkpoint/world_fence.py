"""One rank's side of the fence between worlds (the rule is fencing.py's): the world its
commits are written in, the durable tier's commit fence raised as a restore begins, the
check before each commit, the start it records after each restore, and the removal of
shadowed commits before retention counts what it keeps."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.worlds import parse_world
from training.checkpoint import fencing
from training.checkpoint import format as fmt
from training.checkpoint.commit_fence import CommitFence
from training.checkpoint.fencing import WorldStart
from training.checkpoint.tiers import Tiers

log = logging.getLogger(__name__)


class WorldFence:
    def __init__(
        self,
        *,
        rank: int,
        tiers: Tiers,
        attempt: Callable[[], str | None] | None = None,
    ) -> None:
        """`attempt`: the attempt this rank trains in now (the worker client's, which an
        in-process restart moves; asked at each restore); when it gives no world number,
        WORKLOAD_ATTEMPT."""
        self.rank = rank
        self.tiers = tiers
        self._attempt = attempt
        self._world: int | None = None
        self.world = self._now()
        for fence in self._fences():
            fence.rank = rank

    def _fences(self) -> list[CommitFence]:
        return [tier.fence for tier in self.tiers.stored if tier.fence is not None]

    @property
    def world(self) -> int | None:
        """The world of this rank's commits (None: not known, nothing fenced)."""
        return self._world

    @world.setter
    def world(self, world: int | None) -> None:
        self._world = world
        for fence in self._fences():
            fence.world = world  # every commit there is fenced as it

    def _now(self) -> int | None:
        given = parse_world(self._attempt()) if self._attempt is not None else None
        return given if given is not None else fencing.world_from_env(os.environ)

    def entered(self) -> int | None:
        """A restore begins: the world may have changed (an in-process restart)."""
        self.world = self._now()
        return self.world

    def adopt(self, starts: list[WorldStart]) -> int | None:
        """At a restore, before this world's start is recorded: a world older than the
        newest that started in these tiers, or one with no number, goes on as the world
        after it; the world this rank's commits are written in.

        A world restores only when it starts, so this is a new run that reuses the tiers
        with its attempts counted from 0 again (a JobSet made again, as a rescale does; a
        second `supervisor run` on the same durable directory; a plain torchrun job after
        a supervised one), whose commits would otherwise all be refused or shadowed. A
        world cut off by a partition trains on without restoring: its commits are still
        refused and shadowed (every rank of a world sees the same starts, so all of them
        go on as the same world)."""
        self.world = fencing.adopted(self.world, starts)
        return self.world

    def fence(self, share: int, shares: int) -> None:
        """As a restore begins, before anything is listed: fence the older worlds out of
        the tiers with a commit fence (commit_fence.py); this rank seals its `share` of
        `shares`. A tier that cannot be written is said: the shadow rule still fences."""
        if self.world is None:
            return
        for tier in self.tiers.stored:
            if tier.fence is None:
                continue
            try:
                tier.fence.fence(self.world, share, shares)
            except Exception as exc:
                log.warning(
                    "checkpoint: world %d not fenced in %s (the shadow rule alone keeps "
                    "older worlds' commits out): %r",
                    self.world,
                    tier.where,
                    exc,
                )

    def starts(self) -> list[WorldStart]:
        """The starts this rank sees, in every tier (one that cannot be listed is
        skipped, and said)."""
        found: set[WorldStart] = set()
        for tier in self.tiers.stored:
            try:
                found.update(tier.starts())
                # A world that raised the fence and died before its start was recorded
                # is newer all the same: a new run goes on after it (`adopt`).
                recorded = tier.fence.recorded_world() if tier.fence is not None else None
                if recorded is not None:
                    found.add(WorldStart(recorded, fencing.NO_STEP))
            except Exception as exc:  # a bucket down: the other tiers still fence
                log.warning("checkpoint: starts of %s not read: %r", tier.where, exc)
        return sorted(found)

    def check(self, kind: Tier) -> None:
        """Before a commit to the tier of `kind`: StaleWorldCommit when a newer world has
        started there."""
        tier = self.tiers.stored_of(kind)
        if self.world is None or tier is None:
            return
        fencing.refuse_if_stale(self.world, tier.starts(), tier.where)

    def record(self, step: int) -> None:
        """This world restored `step` (0: starts fresh): in this node's tiers, and by rank
        0 in the shared ones. A failure is logged: the check before each commit and the
        other tiers' records still fence."""
        if self.world is None:
            return
        start = WorldStart(self.world, step)
        try:
            for tier in self.tiers.stored:
                if self.rank == 0 or not tier.shared:
                    tier.record_start(start)
        except Exception as exc:
            log.warning("checkpoint: start of world %d not recorded: %r", self.world, exc)

    def drop_shadowed(self, kind: Tier, rank: int) -> list[int]:
        """Remove `rank`'s shadowed commits in the tier of `kind`, before retention keeps
        the newest steps (a shadowed step must not push a newer world's out); the steps
        removed."""
        removed: list[int] = []
        tier = self.tiers.stored_of(kind)
        if tier is None:
            return removed
        starts = tier.starts()
        for step in tier.steps(rank) if starts else []:
            try:
                manifest = tier.manifest(step, rank)
            except fmt.CheckpointCorrupt:
                continue
            if fencing.shadowed(manifest.world, step, starts) or not tier.admits(manifest):
                tier.remove(step, rank)
                removed.append(step)
        if removed:
            log.info("checkpoint: %s steps %s of rank %d shadowed by a newer world: removed",
                     kind, removed, rank)  # fmt: skip
        return removed
