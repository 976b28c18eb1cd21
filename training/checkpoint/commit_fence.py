"""The durable tier's commit fence: a commit of an older world that a newer world's
restore has fenced fails, whenever it lands (the argument is fencing.py's).

Records (records.py, compare-and-swap in the tier itself):

- `.worlds/current` `{"world": w}`: the newest world that fenced this tier. A world
  raises it as its restore begins, before it lists anything, and never lowers it.
- `.worlds/commits/world-<w>-rank-<k>` `{"upto": s, "sealed": w' | null}`: rank k's
  commits in world w. A commit of step s counts once the record says `upto >= s`; a
  newer world w' *seals* the record, after which it never moves again.

A writer's commit (`begin`, then the files and the manifest, then `advance`), a newer
world's fence (`fence`) and a restore's reading of an older world's commit (`admits`)
are in fencing.py's docstring, with why no order of them lets an older world's commit
that a newer world fenced be restored.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from training.checkpoint.fencing import StaleWorldCommit
from training.checkpoint.records import Conflict, Records

log = logging.getLogger(__name__)

CURRENT = ".worlds/current"
COMMITS = ".worlds/commits/"
#: Compare-and-swap rounds before giving up (each lost to another writer's change).
_ROUNDS = 50
#: The stores whose lack of conditional writes was said (once each per process).
_warned: set[str] = set()


def record_name(world: int, rank: int) -> str:
    return f"{COMMITS}world-{world:019d}-rank-{rank:06d}"


def _world_of(name: str) -> int | None:
    try:
        return int(name.removeprefix(COMMITS).split("-")[1])
    except (IndexError, ValueError):
        return None


class CommitFence:
    def __init__(self, records: Records, where: str) -> None:
        self.records = records
        self.where = where
        #: The world this process's commits are written in (None: not fenced) and its rank.
        self.world: int | None = None
        self.rank = 0
        self._opened: set[tuple[int, int]] = set()
        self._sealed: dict[tuple[int, int], int] = {}  # final: a sealed record never moves
        self._lock = threading.Lock()
        #: Asked right before the commit point; raises to refuse it (the rank's lease ran
        #: out while its files were uploading: training/monitor_link/lease.py).
        self.gate: Callable[[str], None] | None = None

    # --- what kind of fence ------------------------------------------------------------

    @property
    def mode(self) -> str:
        """ "conditional", or "read-then-write" where the store lacks conditional writes
        (the restore's shadow rule is then all that fences: said once, and in reports)."""
        if self.records.conditional is None:
            with self._lock:
                if self.records.conditional is None and not self.records.probe():
                    self._say_unguarded()
        return "conditional" if self.records.conditional else "read-then-write"

    @property
    def known_mode(self) -> str | None:
        """`mode` once known (for reports: asks the store nothing); None when unfenced."""
        if self.world is None or self.records.conditional is None:
            return None
        return "conditional" if self.records.conditional else "read-then-write"

    def _say_unguarded(self) -> None:
        if self.where in _warned:
            return
        _warned.add(self.where)
        log.warning(
            "checkpoint: %s does not honour conditional writes: commits are fenced by a "
            "read before the write only, and an older world's commit that races a newer "
            "world's start is kept out by the restore's shadow rule alone",
            self.where,
        )

    # --- the newer world ----------------------------------------------------------------

    def recorded_world(self) -> int | None:
        """The newest world that fenced this tier."""
        found = self.records.read(CURRENT)
        world = found[0].get("world") if found is not None else None
        return world if isinstance(world, int) else None

    def fence(self, world: int, share: int, shares: int) -> None:
        """Fence every older world out (a restore of `world` begins, before it lists):
        raise `.worlds/current`, then seal the older worlds' records, this rank's share
        of them (`share` of `shares`: every rank of the world takes one)."""
        self.mode  # noqa: B018  (probe once)
        for _ in range(_ROUNDS):
            found = self.records.read(CURRENT)
            try:
                if found is None:
                    self.records.create(CURRENT, {"world": world})
                elif int(found[0].get("world", -1)) < world:
                    self.records.replace(CURRENT, {"world": world}, found[1])
                break
            except Conflict:
                continue
        else:
            raise OSError(f"{self.where}/{CURRENT}: changing too often to raise")
        for index, name in enumerate(self.records.names(COMMITS)):
            older = _world_of(name)
            if index % shares == share and older is not None and older < world:
                self._seal(name, world)

    def _seal(self, name: str, world: int) -> int:
        """Seal a record for `world`; the newest step it lets count (-1: none)."""
        for _ in range(_ROUNDS):
            found = self.records.read(name)
            if found is None:
                return -1
            value, version = found
            upto = int(value.get("upto", -1))
            if value.get("sealed") is not None:
                return upto
            try:
                self.records.replace(name, {"upto": upto, "sealed": world}, version)
                return upto
            except Conflict:
                continue  # its writer committed meanwhile: seal what it has now
        raise OSError(f"{self.where}/{name}: changing too often to seal")

    def admits(self, world: int | None, rank: int, step: int) -> bool:
        """Whether a restore in this world may load rank `rank`'s commit of `step` written
        in `world`: always for its own world and newer (and commits that name none);
        for an older world, only what that world had committed when this one sealed it.
        A commit from before these records (none for its world and rank) is left to the
        shadow rule."""
        if world is None or self.world is None or world >= self.world:
            return True
        key = (world, rank)
        if key not in self._sealed:
            if self.records.read(record_name(world, rank)) is None:
                return True
            self._sealed[key] = self._seal(record_name(world, rank), self.world)
        return step <= self._sealed[key]

    # --- the writer -----------------------------------------------------------------------

    def _refused(self, world: int, newer: Any) -> StaleWorldCommit:
        return StaleWorldCommit(
            f"durable tier {self.where}: this rank trains in world {world}, and world "
            f"{newer} has started since: its commits are refused (an older world's)"
        )

    def begin(self, rank: int) -> None:
        """Before a commit's files: StaleWorldCommit when a newer world has sealed this
        world's record (early: nothing uploaded in vain). The first time, the record is
        made, and then `.worlds/current` read: a newer world that listed the records
        before this one existed raised it first, and is seen here."""
        world = self.world
        if world is None:
            return
        self.mode  # noqa: B018  (probe once)
        name = record_name(world, rank)
        if (world, rank) not in self._opened:
            # Made before: this world's earlier process, an in-process restart.
            with contextlib.suppress(Conflict):
                self.records.create(name, {"upto": -1, "sealed": None})
            newest = self.recorded_world()
            if newest is not None and newest > world:
                self._seal(name, newest)
                raise self._refused(world, newest)
            self._opened.add((world, rank))
        self.check(rank)

    def check(self, rank: int) -> None:
        """StaleWorldCommit when this world's record of `rank` is sealed."""
        if self.world is None:
            return
        found = self.records.read(record_name(self.world, rank))
        if found is not None and found[0].get("sealed") is not None:
            raise self._refused(self.world, found[0]["sealed"])

    def advance(self, rank: int, step: int) -> None:
        """The commit point, once the manifest is in place: the record moves to `step`
        only if no newer world sealed it (compare-and-swap). StaleWorldCommit otherwise:
        the commit does not count, and the caller removes its manifest."""
        world = self.world
        if world is None:
            return
        if self.gate is not None:
            self.gate(f"the durable commit of step {step}")
        name = record_name(world, rank)
        for _ in range(_ROUNDS):
            found = self.records.read(name)
            if found is None:
                raise OSError(f"{self.where}/{name}: the commit record is gone")
            value, version = found
            if value.get("sealed") is not None:
                raise self._refused(world, value["sealed"])
            upto = int(value.get("upto", -1))
            if upto >= step:
                return  # counted already (a step saved again, an answer lost and retried)
            try:
                self.records.replace(name, {"upto": step, "sealed": None}, version)
                return
            except Conflict:
                continue  # this rank's other save, or a seal: read again
        raise OSError(f"{self.where}/{name}: changing too often to commit")
