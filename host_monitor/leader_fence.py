"""A host monitor obeys no command from an older supervisor epoch than the newest it has
obeyed (resiliency_protocol/leaders.py): the refusal is a 409 `stale_leader`, counted.

Judged on the commands only (not GET): reading a node's state changes nothing. The newest
epoch is kept in memory: a host monitor that restarts has no workers any supervisor
commanded, and the first command that comes sets it again.
"""

from __future__ import annotations

import logging

import msgspec
from fastapi import HTTPException, Request, Response

from host_monitor.errors import HostMonitorError
from resiliency_protocol.leaders import LEADER_EPOCH_HEADER, StaleLeader, parse_epoch

log = logging.getLogger(__name__)

_JUDGED = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class LeaderFence:
    """The newest supervisor epoch obeyed, and the commands refused for an older one."""

    def __init__(self) -> None:
        self.newest: int | None = None
        self.refused = 0

    def admit(self, epoch: int) -> StaleLeader | None:
        """None when a command of `epoch` may be obeyed (it becomes the newest if it is);
        else the refusal."""
        if self.newest is not None and epoch < self.newest:
            self.refused += 1
            return StaleLeader(
                message=f"command from supervisor epoch {epoch}, older than epoch"
                f" {self.newest} this host monitor already obeys: refused",
                epoch=epoch,
                newest=self.newest,
            )
        if self.newest is None or epoch > self.newest:
            if self.newest is not None:
                log.info("a newer supervisor commands: epoch %d (was %d)", epoch, self.newest)
            self.newest = epoch
        return None

    async def check(self, request: Request) -> None:
        """A FastAPI dependency, after the actuator's token is checked (an unauthenticated
        request must not raise the newest epoch): 400 for a malformed epoch, 409
        (`StaleLeaderRefused`) for an older one."""
        if request.method not in _JUDGED:
            return
        text = request.headers.get(LEADER_EPOCH_HEADER)
        if text is None:
            return
        epoch = parse_epoch(text)
        if epoch is None:
            raise HTTPException(
                400, f"{LEADER_EPOCH_HEADER}: expected a positive integer, got {text[:40]!r}"
            )
        refused = self.admit(epoch)
        if refused is not None:
            log.warning("%s %s: %s", request.method, request.url.path, refused.message)
            raise StaleLeaderRefused(refused)


class StaleLeaderRefused(HostMonitorError):
    """A command from an older supervisor epoch than the newest obeyed: 409."""

    def __init__(self, refusal: StaleLeader) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


async def stale_leader_error(request: Request, exc: Exception) -> Response:
    """409 whose body is the `StaleLeader` (the supervisor reads it as `Fenced`)."""
    assert isinstance(exc, StaleLeaderRefused)
    return Response(msgspec.json.encode(exc.refusal), 409, media_type="application/json")
