"""The heartbeat a host monitor sends: what one node and its workers look like right now.

The host monitor encodes these types and the supervisor decodes them, so the two cannot
drift apart; imports nothing from supervisor, host_monitor or training.

Decoding it is the supervisor's hottest path (every node, every few seconds), so it is
decoded and validated by msgspec straight from the request bytes: about a third of
pydantic's cost for the same checks. The JSON Schema in /openapi.json is generated from
these same types. The structs hold no references back to anything, so they are kept out
of the cyclic garbage collector (`gc=False`): with 10,000 nodes' latest heartbeats in
memory, full collections would otherwise pause the event loop for a few hundred ms.

Encoding (the host monitor's) leaves out the fields left at their defaults
(`omit_defaults`): no `"exit_code":null` per worker, no empty `gpu_reports` or
`topology`; a steady heartbeat of 8 workers is 20% smaller, and faster to decode.

Validation comes in two parts. `parse_heartbeat` checks every field on its own (types,
ranges, unknown fields). `check_heartbeat` checks what spans fields (a running node names
its job, ranks are unique, names match NAME_PATTERN). The sensor runs the second part only
on a heartbeat that differs from what it already holds for the node: one that repeats the
node's validated name, state, job and worker ranks cannot fail it. `decode_heartbeat`
runs both, for every other caller.
"""

from __future__ import annotations

import operator
import re
from datetime import datetime
from typing import Annotated, Any, Final, Literal

import msgspec

from resiliency_protocol.exceptions import ProtocolError
from resiliency_protocol.peer_probes import MAX_UNREACHABLE
from resiliency_protocol.states import NAME_PATTERN, NodeState, WorkerState
from resiliency_protocol.worlds import World

#: The supervisor's route a host monitor (or its relay) posts a heartbeat to, relative to
#: its base URL, and its bound on a heartbeat's body: the relay takes no larger one.
HEARTBEAT_PATH: Final = "/api/v1/heartbeats"
MAX_HEARTBEAT_BODY_BYTES: Final = 1 << 20
#: Marks a heartbeat sent at once (a worker changed state, a GPU report came): a relay
#: sends it to the supervisor without waiting for the rest of its interval.
URGENT_HEADER: Final = "x-heartbeat-urgent"

# Node and job names follow NAME_PATTERN. The pattern is checked in `check_heartbeat`
# rather than by msgspec: a regex match on every heartbeat cost more than the rest of the
# validation together, and the same few thousand names come back every period.
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
# Integers are bounded to a signed 64-bit value: steps, ranks and codes are stored in SQL
# BIGINT columns and JSON, and a larger one would be accepted here and fail there.
_INT64_MAX = 2**63 - 1
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]
Int64 = Annotated[int, msgspec.Meta(ge=-_INT64_MAX - 1, le=_INT64_MAX)]
# Ranks go to SQL INTEGER columns (events, checkpoint reports): bounded as a checkpoint
# report's rank is, far beyond any job.
MAX_RANK = 10_000_000
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]


class WorkerReport(
    msgspec.Struct,
    forbid_unknown_fields=True,
    frozen=True,
    gc=False,
    kw_only=True,
    omit_defaults=True,
):
    # In the order of the contract's example, which is the order agents send: msgspec
    # matches each key against the next field first, so a body in field order decodes
    # fastest. (kw_only lets the optional pid come before the required state.)
    rank: Rank
    local_rank: Rank
    pid: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    state: WorkerState
    step: NonNegative | None = None
    exit_code: Int64 | None = None
    # Seconds per step in the worker's own work, before it waits for the other ranks (a
    # mean over its last steps): what stragglers are scored on.
    compute_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] | None = None
    # The world (the job's attempt) the worker belongs to; None while the host monitor
    # does not know it. A report from an older world than the job's newest is refused.
    world: World | None = None


#: What a GpuReport's `kind` says.
GpuReportKind = Literal["xid", "ecc", "row_remap", "nvlink", "throttle"]
#: The two kinds a fault can inject, named as the fault kinds that inject them (faults.py).
GPU_XID: Final = "xid"
GPU_ECC: Final = "ecc"
#: The largest XID code a report may carry, and the longest message: a host monitor's
#: watchdogs drop a larger code and cut a longer message rather than have it refused.
MAX_GPU_CODE: Final = 1000
MAX_GPU_MESSAGE_CHARS: Final = 2000


class GpuReport(
    msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False, omit_defaults=True
):
    """A GPU error seen by the host's watchdogs: an XID (kernel log or NVML), uncorrected
    ECC errors (`count`: the GPU's total), and NVML's other health signals: `row_remap`
    (rows waiting for a reset to be remapped, or a remapping that failed; `count`: rows
    remapped for uncorrectable errors), `nvlink` (`count`: the GPU's total NVLink error
    counters), `throttle` (a hardware clock slowdown for heat or power; the reasons in
    `message`)."""

    kind: GpuReportKind
    gpu: NonNegative | None = None
    code: Annotated[int, msgspec.Meta(ge=0, le=MAX_GPU_CODE)] | None = None
    count: NonNegative | None = None
    message: Annotated[str, msgspec.Meta(max_length=MAX_GPU_MESSAGE_CHARS)] | None = None
    time: datetime | None = None

    def __post_init__(self) -> None:
        if self.kind == GPU_XID and self.code is None:
            raise ValueError("code is required for an xid report")
        if self.kind == GPU_ECC and self.count is None:
            raise ValueError("count is required for an ecc report")


class HostHeartbeat(
    msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False, omit_defaults=True
):
    node: Name
    state: NodeState
    job: Name | None = None
    workers: Annotated[list[WorkerReport], msgspec.Meta(max_length=1024)] = []
    gpu_reports: Annotated[list[GpuReport], msgspec.Meta(max_length=256)] = []
    address: Annotated[str, msgspec.Meta(max_length=255)] | None = None
    topology: Annotated[dict[str, str], msgspec.Meta(max_length=16)] = {}
    # Peers whose host monitors this one probed and could not reach (resiliency_protocol/
    # peer_probes.py); empty while every one answers.
    unreachable_peers: Annotated[list[Name], msgspec.Meta(max_length=MAX_UNREACHABLE)] = []


_rank = operator.attrgetter("rank")


class HeartbeatError(ProtocolError, ValueError):
    """The body is not a valid heartbeat. `loc` is the path of the offending field."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


_decoder = msgspec.json.Decoder(HostHeartbeat)
# fullmatch: with match, `$` also matches before a trailing newline ("n1\n").
_name_match = re.compile(NAME_PATTERN).fullmatch
#: Names already checked against NAME_PATTERN. Bounded: emptied if it ever grows past this.
_VALID_NAMES_MAX = 200_000
_valid_names: set[str] = set()


def decode_heartbeat(body: bytes) -> HostHeartbeat:
    """Parse and validate a heartbeat from JSON bytes: both parts of the validation."""
    hb = parse_heartbeat(body)
    check_heartbeat(hb)
    return hb


def parse_heartbeat(body: bytes) -> HostHeartbeat:
    """Parse a heartbeat and check each field on its own; `check_heartbeat` does the rest."""
    try:
        try:
            return _decoder.decode(body)
        except msgspec.ValidationError as exc:
            if "got `float`" not in str(exc):
                raise
            # JSON Schema's integers (and pydantic's, on the other routes) include 2.0;
            # msgspec's do not. Rare, so decoded again only then, its errors as usual.
            return msgspec.convert(_integral_floats(msgspec.json.decode(body)), HostHeartbeat)
    except msgspec.ValidationError as exc:
        raise HeartbeatError(*split_error(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise HeartbeatError((), f"invalid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec decodes str fields as it meets them
        raise HeartbeatError((), f"invalid UTF-8: {exc.reason} at byte {exc.start}") from None


def _integral_floats(value: Any) -> Any:
    """The decoded JSON with each float that has no fraction as an int (a float field
    takes an int as well)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {key: _integral_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_floats(item) for item in value]
    return value


def check_heartbeat(hb: HostHeartbeat) -> None:
    """The checks that span fields, and the name pattern. Raises HeartbeatError."""
    if hb.node not in _valid_names:
        _check_name("node", hb.node)
    if hb.job is not None and hb.job not in _valid_names:
        _check_name("job", hb.job)
    if hb.state is NodeState.RUNNING and hb.job is None:
        raise HeartbeatError(("job",), "required when state is running")
    if hb.state is NodeState.SPARE:
        if hb.job is not None:
            raise HeartbeatError(("job",), "a spare node reports no job")
        if hb.workers:
            raise HeartbeatError(("workers",), "a spare node reports no workers")
    for i, peer in enumerate(hb.unreachable_peers):
        if peer not in _valid_names:
            _check_name(("unreachable_peers", i), peer)
    workers = hb.workers
    if len(workers) > 1 and len(set(map(_rank, workers))) != len(workers):
        seen: set[int] = set()
        for i, worker in enumerate(workers):
            if worker.rank in seen:
                raise HeartbeatError(
                    ("workers", i, "rank"), f"rank {worker.rank} is reported twice"
                )
            seen.add(worker.rank)


def _check_name(field: str | tuple[str | int, ...], name: str) -> None:
    if _name_match(name) is None:
        loc = (field,) if isinstance(field, str) else field
        raise HeartbeatError(loc, f"Expected str matching regex {NAME_PATTERN!r}")
    if len(_valid_names) >= _VALID_NAMES_MAX:
        _valid_names.clear()
    _valid_names.add(name)


def split_error(text: str) -> tuple[tuple[str | int, ...], str]:
    """'Expected `int`, got `str` - at `$.workers[0].step`' -> (("workers", 0, "step"), ...)"""
    message, sep, where = text.rpartition(" - at `")
    if not sep:
        return (), text
    path = where.rstrip("`").removeprefix("$")
    loc: list[str | int] = []
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        if part.startswith("["):  # a list index, or "[...]": some key of a mapping
            inner = part[1:-1]
            loc.append(int(inner) if inner.isdigit() else inner)
        else:
            loc.append(part)
    unknown = "Object contains unknown field `"
    if message.startswith(unknown):
        loc.append(message[len(unknown) :].rstrip("`"))
        message = "unknown field"
    return tuple(loc), message.replace("`", "")


def heartbeat_json_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema of HostHeartbeat, its component definitions) for /openapi.json."""
    schema, components = msgspec.json.schema_components(
        [HostHeartbeat], ref_template="#/components/schemas/{name}"
    )
    properties = components["HostHeartbeat"]["properties"]
    properties["node"]["pattern"] = NAME_PATTERN
    for option in properties["job"]["anyOf"]:
        if option.get("type") == "string":
            option["pattern"] = NAME_PATTERN
    return schema[0], components
