"""The torch.distributed world of a JobSet that heals in-process, kept in its annotation
`resiliency.supervisor.io/world`: `{"attempt": n, "master_port": p, "at": t}`. Absent:
attempt 0 on the port of its pods' `MASTER_PORT`. Each in-process heal moves the JobSet to
the next attempt on a new port (the old rendezvous store may still be held by a surviving
rank); `at` is when a heal into it completed (empty until then, and for the first)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from resiliency_protocol import worker_env
from supervisor.kube import objects as o
from supervisor.kube.objects import Obj

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
#: Ports a JobSet's worlds cycle through, above its pods' MASTER_PORT.
PORT_SPAN = 100


@dataclass(frozen=True, slots=True)
class World:
    attempt: int
    master_port: int
    at: str = ""  # when the heal into it completed (ISO 8601); "" until then
    #: UIDs of the pods the heal into it replaces: never members of it, even while
    #: their node, down, still shows them running.
    replaced: tuple[str, ...] = ()

    def env(self, world_size: int) -> dict[str, str]:
        return {
            worker_env.WORKLOAD_ATTEMPT: str(self.attempt),
            "MASTER_PORT": str(self.master_port),
            "WORLD_SIZE": str(world_size),
        }


def base_port(pods: list[Obj]) -> int:
    for pod in pods:
        raw = o.container_env(pod, "MASTER_PORT")
        if raw is not None and raw.isdigit():
            return int(raw)
    return DEFAULT_MASTER_PORT


def current_world(js: Obj, pods: list[Obj]) -> World:
    """The JobSet's world (its annotation), or the first one."""
    raw = o.annotations_of(js).get(o.WORLD)
    if raw:
        try:
            value = json.loads(raw)
            return World(
                int(value["attempt"]),
                int(value["master_port"]),
                str(value.get("at", "")),
                tuple(str(uid) for uid in value.get("replaced", ())),
            )
        except (ValueError, TypeError, KeyError):
            log.warning("JobSet %s: unreadable %s annotation %r", o.name_of(js), o.WORLD, raw)
    return World(0, base_port(pods))


def next_world(js: Obj, pods: list[Obj], replaced: list[str]) -> World:
    attempt = current_world(js, pods).attempt + 1
    port = base_port(pods) + 1 + (attempt - 1) % PORT_SPAN
    return World(attempt, port, replaced=tuple(replaced))


def set_world(js: Obj, world: World) -> None:
    o.meta(js).setdefault("annotations", {})[o.WORLD] = json.dumps(dataclasses.asdict(world))


def healed_since(js: Obj, when: datetime) -> bool:
    """Whether an in-process heal completed after `when` (a failure seen before then is
    healed already)."""
    at = o.parse_time(current_world(js, []).at or None)
    return at is not None and at > when


def healed(world: World) -> World:
    return dataclasses.replace(world, at=datetime.now(UTC).isoformat())
