"""The worlds the supervisor assigns to ranks (POST /v1/workers/world): the newest of
each (job, rank), kept for the instance it names until that instance registers here."""

from __future__ import annotations

from collections import OrderedDict

from host_monitor.workers import Worker
from resiliency_protocol.node_commands import AssignWorldRequest

KEEP_WORLDS = 256  # worlds assigned per (job, rank), newest kept


class AssignedWorlds:
    def __init__(self) -> None:
        self._worlds: OrderedDict[tuple[str, int], AssignWorldRequest] = OrderedDict()

    def keep(self, req: AssignWorldRequest) -> None:
        """`req` replaces the world its (job, rank) had."""
        key = (req.job, req.rank)
        self._worlds.pop(key, None)
        self._worlds[key] = req
        while len(self._worlds) > KEEP_WORLDS:
            self._worlds.popitem(last=False)

    def for_worker(self, job: str | None, worker: Worker) -> AssignWorldRequest | None:
        """The world assigned to `worker`, a rank of `job`: only a live, registered worker
        of the instance it was assigned to has one."""
        if job is None or worker.instance is None or not worker.registered:
            return None
        req = self._worlds.get((job, worker.rank))
        if req is None or req.instance != worker.instance or not worker.alive:
            return None
        return req
