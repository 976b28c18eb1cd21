"""Whom a host monitor probes, to tell a node cut off from its peers (while the supervisor
still hears it) from a healthy one: the supervisor answers GET
/api/v1/nodes/{node}/probe-targets with the node's neighbours on a ring of every live node
(spares too: they are the third view that tells which side of a cut link is cut off),
and the host monitor names the ones it cannot reach in its heartbeats'
`unreachable_peers`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from resiliency_protocol.node_commands import HostMonitorAddress

#: Neighbours on each side of the ring: each node probes 2 * RING_NEIGHBOURS others and is
#: probed by as many, whatever the cluster's size.
RING_NEIGHBOURS = 2
#: Peers named unreachable in one heartbeat, at most (the targets are fewer).
MAX_UNREACHABLE = 64
#: A host monitor probes once a heartbeat period, this often at most; a peer that did not
#: answer PROBE_MISSES rounds in a row is named unreachable (one lost packet, or a peer
#: busy for a moment, is no cut). The supervisor confirms a cut from both.
PROBE_PERIOD_MIN_S = 1.0
PROBE_MISSES = 2


class ProbeTarget(HostMonitorAddress):
    """A peer to probe: GET {url}/healthz, no token."""


class ProbeTargets(BaseModel):
    """The host monitors a node probes."""

    model_config = ConfigDict(extra="forbid")
    peers: list[ProbeTarget] = Field(default_factory=list, max_length=2 * RING_NEIGHBOURS)
