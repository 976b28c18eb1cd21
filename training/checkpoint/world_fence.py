"""One rank's side of the fence between worlds (the rule is fencing.py's): the world its
commits are written in, the durable tier's commit fence raised as a restore begins, the
check before each commit, the start it records after each restore, and the removal of
shadowed commits before retention counts what it keeps."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.worlds import parse_world
from training.checkpoint import fencing
from training.checkpoint import format as fmt
from training.checkpoint.durable import DurableStore
from training.checkpoint.fencing import WorldStart

log = logging.getLogger(__name__)


class WorldFence:
    def __init__(
        self,
        *,
        rank: int,
        ram_root: Path | None,
        durable: DurableStore | None,
        attempt: Callable[[], str | None] | None = None,
    ) -> None:
        """`attempt`: the attempt this rank trains in now (the worker client's, which an
        in-process restart moves; asked at each restore); when it gives no world number,
        WORKLOAD_ATTEMPT."""
        self.rank = rank
        self.ram_root = ram_root
        self.durable = durable
        self._attempt = attempt
        self._world: int | None = None
        self.world = self._now()
        if durable is not None:
            durable.fence.rank = rank

    @property
    def world(self) -> int | None:
        """The world of this rank's commits (None: not known, nothing fenced)."""
        return self._world

    @world.setter
    def world(self, world: int | None) -> None:
        self._world = world
        if self.durable is not None:
            self.durable.fence.world = world  # every durable commit is fenced as it

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
        the durable tier (commit_fence.py); this rank seals its `share` of `shares`. A
        tier that cannot be written is said: the shadow rule still fences."""
        if self.world is None or self.durable is None:
            return
        try:
            self.durable.fence.fence(self.world, share, shares)
        except Exception as exc:
            log.warning(
                "checkpoint: world %d not fenced in %s (the shadow rule alone keeps older "
                "worlds' commits out): %r",
                self.world,
                self.durable.url,
                exc,
            )

    def starts(self) -> list[WorldStart]:
        """The starts this rank sees: this node's RAM tier and the durable tier (one that
        cannot be listed is skipped, and said)."""
        found = set(fencing.read_local(self.ram_root)) if self.ram_root is not None else set()
        if self.durable is not None:
            try:
                found.update(self.durable.starts())
                # A world that raised the fence and died before its start was recorded
                # is newer all the same: a new run goes on after it (`adopt`).
                recorded = self.durable.fence.recorded_world()
                if recorded is not None:
                    found.add(WorldStart(recorded, fencing.NO_STEP))
            except Exception as exc:  # a bucket down: the other tiers still fence
                log.warning("checkpoint: starts of %s not read: %r", self.durable.url, exc)
        return sorted(found)

    def check(self, tier: str) -> None:
        """Before a commit to `tier` ("ram" or "durable"): StaleWorldCommit when a newer
        world has started there."""
        if self.world is None:
            return
        if tier == Tier.RAM:
            starts = fencing.read_local(self.ram_root) if self.ram_root is not None else []
            where = f"RAM tier {self.ram_root}"
        else:
            assert self.durable is not None
            starts, where = self.durable.starts(), f"durable tier {self.durable.url}"
        fencing.refuse_if_stale(self.world, starts, where)

    def record(self, step: int) -> None:
        """This world restored `step` (0: starts fresh): in this node's RAM tier, and by
        rank 0 in the durable tier. A failure is logged: the check before each commit
        and the other tiers' records still fence."""
        if self.world is None:
            return
        start = WorldStart(self.world, step)
        try:
            if self.ram_root is not None:
                fencing.record_local(self.ram_root, start)
            if self.durable is not None and self.rank == 0:
                self.durable.record_start(start)
        except Exception as exc:
            log.warning("checkpoint: start of world %d not recorded: %r", self.world, exc)

    def drop_shadowed(self, tier: str, rank: int) -> list[int]:
        """Remove `rank`'s shadowed commits in `tier`, before retention keeps the newest
        steps (a shadowed step must not push a newer world's out); the steps removed."""
        removed: list[int] = []
        if tier == Tier.RAM and self.ram_root is not None:
            root = self.ram_root
            starts = fencing.read_local(root)
            for step in fmt.committed_steps(root, rank) if starts else []:
                try:
                    manifest = fmt.read_manifest(fmt.rank_dir(root, step, rank))
                except fmt.CheckpointCorrupt:
                    continue
                if fencing.shadowed(manifest.world, step, starts):
                    fmt.remove_step(root, step, rank)
                    removed.append(step)
        elif tier == Tier.DURABLE and self.durable is not None:
            store = self.durable
            starts = store.starts()
            for step in store.committed_steps(rank) if starts else []:
                try:
                    manifest = store.manifest(step, rank)
                except fmt.CheckpointCorrupt:
                    continue
                if fencing.shadowed(manifest.world, step, starts) or store.fenced_out(manifest):
                    store.remove(step, rank)
                    removed.append(step)
        if removed:
            log.info("checkpoint: %s steps %s of rank %d shadowed by a newer world: removed",
                     tier, removed, rank)  # fmt: skip
        return removed
