"""Worlds in the checkpoint tiers: which world wrote each commit, and which worlds started
from which step, so that a world cut off by a partition never wins a restore.

A world is the job's attempt (WORKLOAD_ATTEMPT, resiliency_protocol/worlds.py). Every
commit's manifest records the world it was written in (`world`; absent in checkpoints of
a job that tells no worlds, and in those written before this). Every restore records, in
the RAM tier of each node and (rank 0) in the durable tier, the world that started and
the step it restored from (0: fresh): a *start*, kept as an empty file or object named
`.worlds/world-<world>-from-<step>` (both numbers zero-padded), so a listing alone reads
them all.

The rule. A commit of step `s` written in world `w` is *shadowed* when some start
`(w', r)` has `w' > w` and `r < s`: a newer world began from an earlier step, so `s` of
world `w` is on a branch no later world continues. A restore never loads a shadowed
commit (every rank applies the union of the starts all ranks see), and among the rest
takes the newest step every rank can load, as before. A commit whose manifest names no
world counts as older than every world. Hence an older world's commit never shadows a
newer world's: a world `w` that continues from `r` only ever writes steps after `r`, and
any commit of an older world after `r` is shadowed by `w`'s start, whatever its step.

Writers fence themselves too: before a commit, a rank reads the starts of the tier it
commits to and refuses (`StaleWorldCommit`, a failed save, reported) when a newer world
than its own has started; a rank whose saves keep failing so stops training
(`max_consecutive_save_failures`). That read races with the newer world's start; in the
durable tier the commit itself is fenced as well (below). In RAM and the peer tier the
restore rule stands on its own: a commit that slips through is shadowed, and retention
removes shadowed commits first so that they never push a newer world's out. The peer
tier's host monitors refuse pushes of an older world themselves
(host_monitor/peer/worlds.py).

The durable tier's commit fence (commit_fence.py). Every durable commit of a rank in a
numbered world (a save's, the emergency copy from RAM, the step's `.metadata`,
`global_view.consolidate` given the store's fence) is conditional on the tier's world
records, written only by compare-and-swap (records.py): S3 `If-None-Match: *` and
`If-Match: <ETag>` on PUT, GCS `ifGenerationMatch`, a directory's `link()` of version
n+1 (EEXIST: someone else's landed first). S3 has no transaction over two objects, so
the manifest cannot be written on the condition of another object; instead a commit
*counts* only once a per-(world, rank) record says so, and that record is the one
object the writer and the newer world both write:

- `.worlds/current` `{"world": w}`: raised (never lowered) by each newer world's ranks
  as their restore begins, before they list anything.
- `.worlds/commits/world-<w>-rank-<k>` `{"upto": s, "sealed": w'|null}`.

Writer of world w, rank k, step s: (1) on its first commit, create its record (if
absent), *then* read `.worlds/current`: a newer world there means refuse, and seal the
record; every commit then reads the record and refuses when sealed (early, before the
upload); (2) upload the files; (3) write the manifest where there is none (`If-None-
Match: *`; a directory renames into place); (4) *the commit point*: advance the record to
`upto = s` with `If-Match` the version read, only if not sealed. A lost race re-reads; a
sealed record means StaleWorldCommit, and the writer deletes the manifest it wrote.

Newer world w2 (every rank, at restore, after `adopt`, before listing): (a) raise
`.worlds/current` to w2; (b) list `.worlds/commits/` and seal every record of an older
world (its share of them; `If-Match`, re-read on conflict); (c) when the restore reads a
commit of an older world w and rank k, it seals that record itself if it is not yet (its
own CAS) and loads the commit only if `s <= upto`; a commit with no record (written
before records existed) is left to the rule above.

Why no interleaving lets an older world's commit that a newer world fenced count. Each
record is changed only by CAS, so the writer's advance (4) and a seal (b, c) of the same
record are ordered: if the seal comes first, (4) fails and `upto` stays below s forever
(sealed records never move), so no restore of a newer world loads s (c); if (4) comes
first, the commit preceded the fence of its record, and the newer world may continue
from it (its start then names that step: nothing is shadowed). A record created after a
newer world listed the records in (b) is created after that world raised
`.worlds/current` in (a), so the writer's read of it in (1) sees the newer world and
refuses. Every restorer is newer than every world it reads the commits of (`adopted`),
so a record, once read, is sealed. Not covered: a commit of a world's own rank read by
its own world (an in-process restart) is trusted as written.

A store without conditional writes (an S3-compatible server that ignores the headers, a
filesystem without hard links; probed once per store by creating one object twice) falls
back to the same steps written as reads then writes: the fence is then no stronger than
the read before each commit, and the restore rule above is what keeps an older world's
commit out. The tier says so once in the log, and every durable save result says which
fence it had (`SaveResult.fence`: "conditional" or "read-then-write").

Worlds only grow as the supervisor counts them within one run of a job; a new run that
reuses the tiers counts from 0 again (a JobSet made again, a second `supervisor run` on
the same durable directory) or counts nothing (plain torchrun). A world restores only
when it starts, so a restore in a world older than the newest start, or in no numbered
world, is such a new run: it goes on as the world after the newest start
(`adopted`), and its commits are neither refused nor shadowed. A world cut off by
a partition does not restore: it stays fenced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from resiliency_protocol import worker_env
from resiliency_protocol.worlds import parse_world
from training.errors import TrainingError

log = logging.getLogger(__name__)

#: The directory (a bucket's prefix) of the starts, in each tier's root.
STARTS = ".worlds"
#: The step of a world known only from the durable tier's world record (a world that
#: fenced the tier and never recorded its start): it shadows nothing, and counts as newer.
NO_STEP = 2**63 - 1
_NAME = re.compile(r"^world-(\d{1,19})-from-(\d{1,19})$")


class StaleWorldCommit(TrainingError):
    """A commit refused: a newer world than the writer's has started since."""


@dataclass(frozen=True, order=True)
class WorldStart:
    """World `world` started from step `step` (0: from nothing)."""

    world: int
    step: int

    @property
    def name(self) -> str:
        return f"world-{self.world:019d}-from-{self.step:019d}"

    @classmethod
    def parse(cls, name: str) -> WorldStart | None:
        match = _NAME.match(name)
        return cls(int(match.group(1)), int(match.group(2))) if match else None


def world_from_env(env: Mapping[str, str]) -> int | None:
    """The world a process starts in: WORKLOAD_ATTEMPT, the supervisor's count of the job's
    worlds. Not torchrun's TORCHELASTIC_RESTART_COUNT: each node's agent counts its own
    restarts, so a node that joined later would count as an older world."""
    return parse_world(env.get(worker_env.WORKLOAD_ATTEMPT))


def shadowed(world: int | None, step: int, starts: Iterable[WorldStart]) -> bool:
    """Whether a commit of `step` written in `world` is shadowed by a newer world's start."""
    written = -1 if world is None else world
    return any(start.world > written and start.step < step for start in starts)


def newest(starts: Iterable[WorldStart]) -> int | None:
    return max((start.world for start in starts), default=None)


def adopted(world: int | None, starts: Iterable[WorldStart]) -> int | None:
    """The world a rank restoring in `world` goes on as, given the starts in its tiers: a
    world older than the newest start, or one with no number, is a new run that reuses
    the tiers (see the module's docstring) and goes on as the world after the newest."""
    latest = newest(starts)
    if latest is None or (world is not None and world >= latest):
        return world
    log.info(
        "checkpoint: world %d has started in these tiers before this run (in world %s): "
        "it goes on as world %d",
        latest,
        "unknown" if world is None else world,
        latest + 1,
    )
    return latest + 1


def refuse_if_stale(world: int | None, starts: Iterable[WorldStart], where: str) -> None:
    """StaleWorldCommit when a newer world than `world` has started (None: not fenced)."""
    latest = newest(starts)
    if world is not None and latest is not None and latest > world:
        raise StaleWorldCommit(
            f"{where}: this rank trains in world {world}, and world {latest} has started "
            "since: its commits are refused (an older world's)"
        )


def read_local(root: Path) -> list[WorldStart]:
    """The starts recorded under a tier directory."""
    try:
        names = os.listdir(Path(root) / STARTS)
    except OSError:
        return []
    return sorted(start for name in names if (start := WorldStart.parse(name)) is not None)


def record_local(root: Path, start: WorldStart) -> None:
    """Record a start under a tier directory (idempotent: an empty file of its name)."""
    directory = Path(root) / STARTS
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(directory / start.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
