"""The torch.distributed world of a JobSet that heals in-process, kept in its annotation
`resiliency.supervisor.io/world`: `{"attempt": n, "master_port": p, "at": t}`. Absent:
attempt 0 on the port of its pods' `MASTER_PORT`. Each in-process heal moves the JobSet to
the next attempt on a new port (the old rendezvous store may still be held by a surviving
rank); `at` is when a heal into it completed (empty until then, and for the first).

**World numbers.** A job's world, as its workers report it (WORKLOAD_ATTEMPT) and the
supervisor fences it (supervisor/sensor/worlds.py), is one number: the JobSet's restart
count plus its in-process attempt, `status.restarts + attempt` (a pod's: its
`restart-attempt` label plus the attempt it was told). A JobSet restart raises the first
and keeps the second; an in-process heal raises the second and keeps the first; neither
ever goes down while the JobSet lives. So the sum goes up at every restart and every
heal, never back, and no two worlds of one JobSet share a number. A JobSet that does not
heal in-process has attempt 0 throughout: its world is `status.restarts`, the label its
pods pass as WORKLOAD_ATTEMPT. A JobSet made again (a rescale) is a new run: its count
starts from 0 again (the supervisor keys its fence on the JobSet's UID)."""

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

    def number(self, restarts: int) -> int:
        """The world number of a pod of JobSet restart `restarts` in this world."""
        return restarts + self.attempt

    def env(self, world_size: int, restarts: int) -> dict[str, str]:
        return {
            worker_env.WORKLOAD_ATTEMPT: str(self.number(restarts)),
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


def fenced_world(js: Obj) -> int:
    """The JobSet's world number the supervisor fences: reports of an older one are
    refused. Of a JobSet that heals in-process, the attempt counts once the heal into it
    completed (`at`: every rank trains in it): until then a survivor may not have been
    told it yet, and its reports of the world before must be taken."""
    if not o.in_process_enabled(js):
        return o.jobset_restarts(js)
    world = current_world(js, [])
    formed = world.attempt if world.at or world.attempt == 0 else world.attempt - 1
    return o.jobset_restarts(js) + formed
