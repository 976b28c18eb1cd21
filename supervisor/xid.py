"""NVIDIA XID codes: what each means, what it points at, and the response users expect.

The codes and their meaning follow NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors):
its "resolution bucket" says whether restarting the application is enough (the GPU is
fine; the fault was the program's or a transient of the driver) or whether the GPU needs a
reset, a reboot or service, which for a training job means moving off the node. A code
not in the table is treated as the hardware's, as every XID was before there was a table.

Settings (`xid_responses`) override the response per code, for a fleet whose experience
differs (for example to keep training through XID 94, a contained ECC error that only
kills the process that touched the memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from supervisor.domain import Event, EventType
from supervisor.event_details import GpuClassDetails


class XidOrigin(StrEnum):
    APPLICATION = "application"  # the program's own fault: an illegal address, a bad kernel
    DRIVER = "driver"  # the driver cleaning up after another error, or a transient
    HARDWARE = "hardware"  # the GPU, its memory, NVLink or the bus
    UNKNOWN = "unknown"  # not in the table


class XidResponse(StrEnum):
    RESTART_WORKLOAD = "restart_workload"  # the node stays; it is not counted as failing
    REPLACE_NODE = "replace_node"  # the GPU needs a reset or service: off the node
    IGNORE = "ignore"  # informational: recorded, nothing done


@dataclass(frozen=True, slots=True)
class XidClass:
    code: int | None
    meaning: str
    origin: XidOrigin
    response: XidResponse

    def details(self) -> dict[str, Any]:
        """What a `gpu_xid` event carries of it."""
        return {
            "meaning": self.meaning,
            "origin": self.origin.value,
            "response": self.response.value,
        }


_A, _D, _H = XidOrigin.APPLICATION, XidOrigin.DRIVER, XidOrigin.HARDWARE
_RESTART, _REPLACE = XidResponse.RESTART_WORKLOAD, XidResponse.REPLACE_NODE

#: code -> (meaning, origin, response)
CATALOG: Mapping[int, XidClass] = {
    code: XidClass(code, meaning, origin, response)
    for code, (meaning, origin, response) in {
        8: ("GPU stopped processing (channel idle timeout)", _D, _RESTART),
        13: ("graphics engine exception", _A, _RESTART),
        31: ("GPU memory page fault", _A, _RESTART),
        43: ("GPU stopped processing", _A, _RESTART),
        45: ("preemptive cleanup, due to previous errors", _D, _RESTART),
        48: ("double-bit ECC error", _H, _REPLACE),
        61: ("internal micro-controller breakpoint or warning", _H, _REPLACE),
        62: ("internal micro-controller halt", _H, _REPLACE),
        63: ("row remapping or page retirement recorded; a GPU reset applies it", _H, _REPLACE),
        64: ("row remapping or page retirement failed", _H, _REPLACE),
        74: ("NVLink error", _H, _REPLACE),
        79: ("GPU has fallen off the bus", _H, _REPLACE),
        92: ("high single-bit ECC error rate", _H, _REPLACE),
        94: ("contained ECC error", _H, _REPLACE),
        95: ("uncontained ECC error", _H, _REPLACE),
        119: ("GSP RPC timeout", _H, _REPLACE),
        120: ("GSP error", _H, _REPLACE),
    }.items()
}


#: NVML's other health signals (`gpu_health` events), by report kind: (meaning, response).
HEALTH: Mapping[str, XidClass] = {
    "row_remap": XidClass(None, "row remapping pending a GPU reset, or failed", _H, _REPLACE),
    "nvlink": XidClass(None, "NVLink errors counted", _H, _REPLACE),
    # A slow GPU slows the whole job; it is not broken: recorded, and the straggler it
    # makes is what gets acted on.
    "throttle": XidClass(
        None, "clocks slowed by the hardware for heat or power", _H, XidResponse.IGNORE
    ),
}


def classify(code: int | None, overrides: Mapping[int, XidResponse] | None = None) -> XidClass:
    """The code's class, with the response `overrides` sets for it if any."""
    known = CATALOG.get(code) if code is not None else None
    xid = known or XidClass(code, "not in the XID table", XidOrigin.UNKNOWN, _REPLACE)
    response = (overrides or {}).get(code) if code is not None else None
    if response is not None and response != xid.response:
        xid = XidClass(xid.code, xid.meaning, xid.origin, response)
    return xid


def response_of(event: Event) -> XidResponse | None:
    """The response a `gpu_xid` or `gpu_health` event carries (None for other events).
    An event recorded before events carried one counts as the hardware's, as it was
    handled then."""
    if event.type not in (EventType.GPU_XID, EventType.GPU_HEALTH):
        return None
    try:
        return XidResponse(GpuClassDetails.from_mapping(event.details).response or _REPLACE)
    except ValueError:
        return _REPLACE


def blames_node(event: Event) -> bool:
    """Whether a node failure event counts against its node (towards
    `max_workload_restarts`, and cordoning): an XID only when the node must go."""
    response = response_of(event)
    return response is None or response is XidResponse.REPLACE_NODE
