"""Faults to simulate: read from a trace (JSON lines), sampled from a failure mix, or
taken from the supervisor's own recorded history.

A trace line is ``{"time": 3600.0, "node": "node-00012", "kind": "gpu_xid",
"details": {"code": 79}}``. `time` is seconds from the start of the trace, or an ISO
8601 time (then relative to the earliest one). Node names need not match the simulated
cluster's: each name is mapped, in order of first appearance, onto one of its nodes.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from resiliency_protocol.faults import SimulatedFault
from supervisor.domain import Event, EventType
from supervisor.errors import SupervisorError
from supervisor.event_details import (
    GpuEccDetails,
    GpuXidDetails,
    HostHeartbeatLostDetails,
    WorkerExitedDetails,
    details_of,
)

#: What the simulated cluster can act out.
KINDS: frozenset[str] = frozenset(SimulatedFault)

#: Cause of a failure mix -> the fault acted out (kind, details).
CAUSES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpu": (SimulatedFault.GPU_XID, {"code": 79}),  # fallen off the bus: the node needs service
    "gpu_memory": (SimulatedFault.GPU_ECC, {"count": 1}),  # an uncorrectable (double-bit) ECC error
    "network": (SimulatedFault.NETWORK, {}),  # unreachable for a while, then back
    "host": (SimulatedFault.NODE_DOWN, {}),  # the host dies: silent until repaired
    "maintenance": (SimulatedFault.NODE_DOWN, {"planned": True}),
    "software": (SimulatedFault.WORKER_CRASH, {"exit_code": 1}),
    "hang": (SimulatedFault.WORKER_HANG, {}),
}


class TraceError(SupervisorError, ValueError):
    """A trace that cannot be read; the message says which line and field."""


@dataclass(frozen=True, slots=True, order=True)
class Fault:
    time: float
    node: str = field(compare=False)
    kind: str = field(compare=False)
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self, *, unix_time: bool = False) -> str:
        """One trace line; `unix_time`: `time` is Unix seconds, written as ISO 8601."""
        when: float | str = round(self.time, 3)
        if unix_time:
            when = datetime.fromtimestamp(self.time, UTC).isoformat()
        return json.dumps(
            {"time": when, "node": self.node, "kind": self.kind, "details": self.details},
            sort_keys=True,
        )


def read_trace(path: Path) -> list[Fault]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    return parse_trace(lines, source=str(path))


def parse_trace(lines: Iterable[str], *, source: str = "trace") -> list[Fault]:
    raw: list[tuple[float | datetime, str, str, dict[str, Any]]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise TraceError(f"{where}: expected an object")
        when = item.get("time")
        if isinstance(when, str):
            try:
                when = datetime.fromisoformat(when)
            except ValueError:
                raise TraceError(f"{where}: time: not an ISO 8601 time: {when!r}") from None
        elif (
            not isinstance(when, int | float)
            or isinstance(when, bool)
            or not (math.isfinite(when) and when >= 0)
        ):
            raise TraceError(f"{where}: time: expected seconds >= 0 or an ISO 8601 time")
        node, kind = item.get("node"), item.get("kind")
        if not isinstance(node, str) or not node:
            raise TraceError(f"{where}: node: expected a node name")
        if kind not in KINDS:
            raise TraceError(f"{where}: kind: {kind!r} is not one of {', '.join(sorted(KINDS))}")
        details = item.get("details") or {}
        if not isinstance(details, dict):
            raise TraceError(f"{where}: details: expected an object")
        raw.append((when, node, kind, details))
    stamps = [r[0] for r in raw if isinstance(r[0], datetime)]
    if stamps and len(stamps) != len(raw):
        raise TraceError(f"{source}: time: mixes seconds and ISO times")
    if stamps:
        # A time with no zone is UTC, as the supervisor writes them.
        aware = [t if t.tzinfo else t.replace(tzinfo=UTC) for t in stamps]
        origin = min(aware)
        return sorted(
            Fault((t - origin).total_seconds(), r[1], r[2], r[3])
            for t, r in zip(aware, raw, strict=True)
        )
    return sorted(Fault(float(r[0]), r[1], r[2], r[3]) for r in raw)  # type: ignore[arg-type]


def write_trace(faults: Iterable[Fault], *, unix_time: bool = False) -> Iterator[str]:
    for fault in faults:
        yield fault.to_json(unix_time=unix_time) + "\n"


def map_nodes(faults: Sequence[Fault], nodes: Sequence[str]) -> list[Fault]:
    """The faults on the simulated nodes: a name the cluster has stays; the others are
    mapped, in order of first appearance, onto the nodes no fault names yet."""
    known = set(nodes)
    free = iter([n for n in nodes if n not in {f.node for f in faults}])
    mapping: dict[str, str] = {}
    out = []
    for fault in faults:
        name = fault.node
        if name not in known:
            if name not in mapping:
                target = next(free, None)
                if target is None:
                    raise TraceError(f"the trace names more nodes than the cluster's {len(nodes)}")
                mapping[name] = target
            name = mapping[name]
        out.append(Fault(fault.time, name, fault.kind, fault.details))
    return out


def sample_mix(
    rates: dict[str, float],
    *,
    per_gpu: bool,
    nodes: Sequence[str],
    gpus_per_node: int,
    duration_s: float,
    seed: int,
    network_outage_s: float,
) -> list[Fault]:
    """Faults drawn from independent Poisson processes, one per cause and node (rates per
    node-hour, or per GPU-hour times the node's GPUs), seeded: the same arguments give
    the same faults."""
    rng = random.Random(seed)
    scale = gpus_per_node if per_gpu else 1
    faults: list[Fault] = []
    for cause in sorted(rates):
        per_node_s = rates[cause] * scale / 3600.0
        if per_node_s <= 0:
            continue
        kind, details = CAUSES[cause]
        total = per_node_s * len(nodes)  # the superposition: one stream for all nodes
        t = rng.expovariate(total)
        while t < duration_s:
            node = nodes[rng.randrange(len(nodes))]
            extra: dict[str, Any] = {"cause": cause, **details}
            if kind == SimulatedFault.NETWORK:
                extra["duration_s"] = network_outage_s
            if kind in (SimulatedFault.GPU_XID, SimulatedFault.GPU_ECC):
                extra["gpu"] = rng.randrange(gpus_per_node)
            faults.append(Fault(t, node, kind, extra))
            t += rng.expovariate(total)
    return sorted(faults)


#: Recorded events that tell of a fault, and the fault they are replayed as.
_FROM_EVENTS: dict[EventType, str] = {
    EventType.HOST_HEARTBEAT_LOST: SimulatedFault.NODE_DOWN,
    EventType.NODE_NOT_READY: SimulatedFault.NODE_DOWN,
    EventType.GPU_XID: SimulatedFault.GPU_XID,
    EventType.GPU_ECC: SimulatedFault.GPU_ECC,
    EventType.WORKER_EXITED: SimulatedFault.WORKER_CRASH,
    EventType.WORKER_HEARTBEAT_LOST: SimulatedFault.WORKER_CRASH,
    EventType.HANG: SimulatedFault.WORKER_HANG,
}


def faults_from_events(events: Iterable[Event]) -> list[Fault]:
    """A trace of the faults a supervisor recorded, from its events (times in Unix
    seconds: write them with `unix_time`; `parse_trace` makes them relative). A node's
    loss is placed at its last heartbeat; a clean exit (code 0) and events with no node
    are no fault."""
    out: list[Fault] = []
    for event in events:
        kind = _FROM_EVENTS.get(event.type)
        if kind is None or event.node is None:
            continue
        details: dict[str, Any] = {"event": event.type.value}
        when = event.time.timestamp()
        match details_of(event):
            case WorkerExitedDetails(exit_code=code):
                if code == 0:
                    continue
                details["exit_code"] = code
            case HostHeartbeatLostDetails(last_heartbeat=str(last)):
                with contextlib.suppress(ValueError):
                    when = datetime.fromisoformat(last).timestamp()
            case GpuXidDetails(code=code, gpu=gpu):
                details["code"], details["gpu"] = code, gpu
            case GpuEccDetails(gpu=gpu):
                details["gpu"] = gpu
        out.append(
            Fault(when, event.node, kind, {k: v for k, v in details.items() if v is not None})
        )
    return sorted(out)
