"""The kinds of fault the supervisor injects, and the host monitors act out on real
processes. Imports nothing from supervisor, host_monitor or training.

The simulator's traces (supervisor/simulate/) name what the simulated cluster acts out in
a vocabulary of their own (`SimulatedFault`): a GPU's faults as the events the supervisor
raises for them (`gpu_xid`, `gpu_ecc`: the GPU itself failed, where `xid` and `ecc` inject
a report of it), and `network`, which no real node acts out.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class FaultKind(StrEnum):
    """What `POST /api/v1/faults` injects (the wire values)."""

    HEARTBEAT_LOSS = "heartbeat_loss"  # the supervisor stops taking a node's heartbeats
    XID = "xid"  # an XID error on a GPU
    ECC = "ecc"  # uncorrected ECC errors on a GPU
    NODE_DOWN = "node_down"
    WORKER_CRASH = "worker_crash"
    WORKER_HANG = "worker_hang"
    STRAGGLER = "straggler"


#: The kinds a host monitor acts out on its node's processes (POST /v1/faults).
ProcessFaultKind = Literal[
    FaultKind.WORKER_CRASH,
    FaultKind.WORKER_HANG,
    FaultKind.STRAGGLER,
    FaultKind.XID,
    FaultKind.ECC,
    FaultKind.NODE_DOWN,
]
PROCESS_FAULT_KINDS: frozenset[FaultKind] = frozenset(
    {
        FaultKind.WORKER_CRASH,
        FaultKind.WORKER_HANG,
        FaultKind.STRAGGLER,
        FaultKind.XID,
        FaultKind.ECC,
        FaultKind.NODE_DOWN,
    }
)


class SimulatedFault(StrEnum):
    """What a simulator trace line's `kind` says happened."""

    NODE_DOWN = "node_down"  # as FaultKind.NODE_DOWN
    NETWORK = "network"  # unreachable for a while, then back
    GPU_XID = "gpu_xid"  # what FaultKind.XID reports
    GPU_ECC = "gpu_ecc"  # what FaultKind.ECC reports
    WORKER_CRASH = "worker_crash"  # as FaultKind.WORKER_CRASH
    WORKER_HANG = "worker_hang"  # as FaultKind.WORKER_HANG
