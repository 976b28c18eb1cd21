"""The acting supervisor's epoch on its commands, and a host monitor's refusal of an older one.

Each time a supervisor starts acting (it won the Lease, or it is the only replica) it
takes the next epoch from its database, a counter that only grows and that outlives
Leases (a Lease deleted and made again starts its `leaseTransitions` over). Every command
it sends to a host monitor carries the epoch in the `X-Supervisor-Epoch` header. A host
monitor obeys no command from an older epoch than the newest it has obeyed: a supervisor
that lost its Lease mid-action (frozen, cut off, then back) cannot act on a node a newer
leader already commands, even if its own check of the Lease (supervisor/kube/leader.py)
were fooled by a pause between the check and the request.

The refusal is a 409 whose body is a `StaleLeader`. A command without the header (a tool,
an operator's request) is not judged. Imports nothing from supervisor, host_monitor or
training.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

LEADER_EPOCH_HEADER = "X-Supervisor-Epoch"

#: An epoch: 1 for the first supervisor that acted on a database.
Epoch = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]

STALE_LEADER: Literal["stale_leader"] = "stale_leader"


class StaleLeader(msgspec.Struct, frozen=True, kw_only=True):
    """409 to a command from an older supervisor epoch than the newest obeyed."""

    code: Literal["stale_leader"] = STALE_LEADER
    message: str
    #: The epoch the refused command carried.
    epoch: Epoch
    #: The newest epoch this host monitor has obeyed.
    newest: Epoch


_decoder = msgspec.json.Decoder(StaleLeader)


def parse_epoch(text: str) -> int | None:
    """An epoch from the header's text; None when it is not one (then the command is
    refused as malformed, not judged)."""
    text = text.strip()
    if not text.isdigit() or len(text) > 18 or int(text) < 1:
        return None
    return int(text)


def stale_leader_of(body: bytes) -> StaleLeader | None:
    """The `StaleLeader` a 409 carries; None for any other 409."""
    try:
        return _decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
