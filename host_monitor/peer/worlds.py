"""The peer tier's fence between worlds: a push from an older world than the newest this
node knows for the job is refused.

A world is the job's attempt (resiliency_protocol/worlds.py); every committed checkpoint's
manifest names the world it was written in (training/checkpoint/fencing.py). This node
knows a job's newest world from two sources: the copies it keeps (each commit's manifest,
and those found at start), and the supervisor, whose answer to each heartbeat names the
newest world it started for the job this node runs (`current`; a 409 `stale_world` names
it too). A node cut off by a partition keeps training in the world it was swapped out of,
and its host monitor keeps pushing: once its partner has heard from the supervisor that
a newer world started, or keeps a copy of one, those pushes are refused (409, field
`world`), before any byte of a file moves over the data channel, and at the commit;
whether or not any rank of the newer world pushed here yet. The price: a push of the older
world's emergency checkpoint still under way when this node hears of the newer world is
refused too, and a restore then takes the step before it from this tier. A push that
names no world is refused at the commit once a world is known: it counts as older than
every world, as at a restore. Refusals are counted
(`host_monitor_peer_stale_world_refusals_total`).
"""

from __future__ import annotations

import logging

from host_monitor.peer.store import StaleWorld

log = logging.getLogger(__name__)


class PeerWorlds:
    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        #: The newest world of each job, as the supervisor's heartbeat answers name it.
        self._current: dict[str, int] = {}
        #: Uploads and commits refused as an older world's (metrics).
        self.refused = 0

    def seen(self, job: str, world: int | None) -> None:
        """A copy of `job` written in `world` is kept here."""
        if world is not None and world > self._seen.get(job, -1):
            self._seen[job] = world

    def current(self, job: str, world: int) -> None:
        """The supervisor started `world` of `job` (an older one is ignored)."""
        if world > self._current.get(job, -1):
            log.info("job %s: world %d started; peer copies of older worlds refused", job, world)
            self._current[job] = world

    def newest(self, job: str) -> int | None:
        """The newer of the job's newest world in the copies here and the supervisor's."""
        seen, current = self._seen.get(job), self._current.get(job)
        if seen is None or current is None:
            return current if seen is None else seen
        return max(seen, current)

    def check(self, job: str, rank: int, step: int, world: int | None, what: str) -> None:
        """StaleWorld when `world` is older than the job's newest known here."""
        newest = self.newest(job)
        if newest is None or (world is not None and world >= newest):
            return
        self.refused += 1
        told = "names no world" if world is None else f"is of world {world}"
        log.warning(
            "peer %s of job %s rank %d step %d refused: it %s, world %d has started",
            what,
            job,
            rank,
            step,
            told,
            newest,
        )
        raise StaleWorld(
            "world",
            f"the save of rank {rank} at step {step} {told}; world {newest} of job {job} has "
            "started: a push of an older world is refused",
        )
