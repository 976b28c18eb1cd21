"""The kinds of fault the supervisor injects, and `FAULTS`, the one table that says what
each kind is. Imports nothing from supervisor, host_monitor or training.

Every list of kinds derives from `FAULTS`: the operator API's kinds, the drills' kinds
and their schedule pattern, the kinds a host monitor takes (`ProcessFaultKind`), the
kinds the sensor acts out alone. A new kind is a `FaultKind` member, its row here, and
its handler in each table that acts faults out (the host monitor's `PROCESS_ACTS`, the
fault injector's `SENSOR_ACTS` and `DRILL_PARAMS`); tests/test_fault_table.py names any
row or handler missing.

The simulator's traces (supervisor/simulate/) name what the simulated cluster acts out in
a vocabulary of their own (`SimulatedFault`): a GPU's faults as the events the supervisor
raises for them (`gpu_xid`, `gpu_ecc`: the GPU itself failed, where `xid` and `ecc` inject
a report of it), and `network`, which no real node acts out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, TypeAlias


class FaultKind(StrEnum):
    """What `POST /api/v1/faults` injects (the wire values)."""

    HEARTBEAT_LOSS = "heartbeat_loss"  # the supervisor stops taking a node's heartbeats
    XID = "xid"  # an XID error on a GPU
    ECC = "ecc"  # uncorrected ECC errors on a GPU
    NODE_DOWN = "node_down"
    WORKER_CRASH = "worker_crash"
    WORKER_HANG = "worker_hang"
    STRAGGLER = "straggler"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What a fault kind is, wherever it is acted out."""

    #: A host monitor acts it out on its node's real processes (its POST /v1/faults).
    on_processes: bool
    #: The sensor can act it out by itself, with any backend (no processes needed).
    through_sensor: bool
    #: A drill or a random schedule may inject it.
    drillable: bool
    #: Over as soon as acted out (a kill, a signal, a GPU error); else it lasts a while.
    one_shot: bool
    #: Its parameters' model, by name in fault_params.py (which needs pydantic: imported
    #: by what validates them, never by an operator's command); None: it takes none.
    params: str | None
    #: The node's host monitor exits while acting it out: its answer may never come.
    agent_exits: bool = False


FAULTS: Mapping[FaultKind, FaultSpec] = MappingProxyType(
    {
        FaultKind.HEARTBEAT_LOSS: FaultSpec(
            on_processes=False,
            through_sensor=True,
            drillable=False,  # it would mute a node until the drill's fault is deleted
            one_shot=False,
            params="HeartbeatLossParams",
        ),
        FaultKind.XID: FaultSpec(
            on_processes=True,
            through_sensor=True,
            drillable=True,
            one_shot=True,
            params="XidParams",
        ),
        FaultKind.ECC: FaultSpec(
            on_processes=True,
            through_sensor=True,
            drillable=True,
            one_shot=True,
            params="EccParams",
        ),
        FaultKind.NODE_DOWN: FaultSpec(
            on_processes=True,
            through_sensor=False,
            drillable=True,
            one_shot=True,
            params=None,
            agent_exits=True,
        ),
        FaultKind.WORKER_CRASH: FaultSpec(
            on_processes=True,
            through_sensor=False,
            drillable=True,
            one_shot=True,
            params="WorkerParams",
        ),
        FaultKind.WORKER_HANG: FaultSpec(
            on_processes=True,
            through_sensor=False,
            drillable=True,
            one_shot=True,
            params="WorkerParams",
        ),
        FaultKind.STRAGGLER: FaultSpec(
            on_processes=True,
            through_sensor=False,
            drillable=True,
            one_shot=False,
            params="StragglerParams",
        ),
    }
)

# --- what derives from the table ----------------------------------------------------------

#: The kinds a host monitor acts out on its node's processes (POST /v1/faults).
PROCESS_FAULT_KINDS: frozenset[FaultKind] = frozenset(
    k for k, s in FAULTS.items() if s.on_processes
)
#: The kinds the sensor acts out by itself, with any backend.
SENSOR_FAULT_KINDS: frozenset[FaultKind] = frozenset(
    k for k, s in FAULTS.items() if s.through_sensor
)
#: The kinds a drill (or a random schedule) may inject, in the table's order.
DRILL_KINDS: tuple[FaultKind, ...] = tuple(k for k, s in FAULTS.items() if s.drillable)
#: The kinds that stop a worker (or its node) at once, which only a restart recovers from:
#: what the MTTR benchmarks inject (bench/mttr.py, bench/torchrun_mttr.py), in the table's order.
RESTART_KINDS: tuple[FaultKind, ...] = tuple(
    k for k, s in FAULTS.items() if s.on_processes and s.one_shot and not s.through_sensor
)

if TYPE_CHECKING:
    ProcessFaultKind: TypeAlias = FaultKind
else:
    # Literal[...] of the table's process kinds: validated and listed in the JSON schema
    # as a written-out Literal is.
    ProcessFaultKind = Literal[tuple(k for k in FAULTS if k in PROCESS_FAULT_KINDS)]


class SimulatedFault(StrEnum):
    """What a simulator trace line's `kind` says happened."""

    NODE_DOWN = "node_down"  # as FaultKind.NODE_DOWN
    NETWORK = "network"  # unreachable for a while, then back
    GPU_XID = "gpu_xid"  # what FaultKind.XID reports
    GPU_ECC = "gpu_ecc"  # what FaultKind.ECC reports
    WORKER_CRASH = "worker_crash"  # as FaultKind.WORKER_CRASH
    WORKER_HANG = "worker_hang"  # as FaultKind.WORKER_HANG
