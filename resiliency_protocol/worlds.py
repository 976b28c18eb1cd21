"""The world a report belongs to, and the supervisor's answer to a report from an older one.

A job's world is the attempt of its torch.distributed rendezvous (WORKLOAD_ATTEMPT): each
restart or heal starts a newer one. Every worker report a host monitor sends carries its
world (`WorkerReport.world`), so that the supervisor can refuse what a node cut off
during a heal says about the world it was swapped out of: such a report never drives an
action in the newer world.

The refusal is a 409 whose body is a `StaleWorld`: the newest world and the ranks that
belong to an older one. The host monitor then stops those ranks (it fences itself) and
reports again. Every accepted heartbeat's answer (204 or 202) names the newest world the
supervisor started for the heartbeat's job in the header `JOB_WORLD_HEADER` (absent while
it knows none): a header, so that the common answer keeps no body. Its host monitor
refuses peer copies of an older world from then on (host_monitor/peer/worlds.py).
Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

#: A world: the job's attempt counter, 0 for the first.
World = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]

STALE_WORLD: Literal["stale_world"] = "stale_world"

#: The heartbeat answer's header naming the job's newest world (decimal digits).
JOB_WORLD_HEADER = "x-job-world"


class StaleWorld(msgspec.Struct, frozen=True, kw_only=True):
    """409 to a report from an older world than the newest the supervisor started."""

    code: Literal["stale_world"] = STALE_WORLD
    message: str
    job: str
    #: The newest world of the job.
    world: World
    #: The ranks the report gave from an older world, still alive: to be stopped.
    ranks: list[int]


_decoder = msgspec.json.Decoder(StaleWorld)


def parse_world(text: str | None) -> int | None:
    """A world from its text form (WORKLOAD_ATTEMPT, a worker's `attempt`); None when it
    is not a world number (a workload may name its attempts otherwise)."""
    if text is None or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def stale_world_of(body: bytes) -> StaleWorld | None:
    """The `StaleWorld` a 409 carries; None for any other 409 (another rule's refusal)."""
    try:
        return _decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def job_world_header(world: int) -> tuple[bytes, bytes]:
    """The header of a heartbeat answer naming `world`, as ASGI sends it."""
    return (JOB_WORLD_HEADER.encode(), str(world).encode())


def job_world_of(value: str | None) -> int | None:
    """The world a heartbeat answer's `JOB_WORLD_HEADER` names; None when absent or not a
    world number."""
    return parse_world(value)
