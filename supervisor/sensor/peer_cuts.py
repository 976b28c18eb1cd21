"""A node cut off from its peers while the supervisor still hears it: `node_cut_off`.

Each host monitor probes its neighbours on a ring of every live node, spares included
(resiliency_protocol/peer_probes.py), and names in its heartbeats the ones it cannot reach.
A cut link shows as a broken edge between two nodes; which side is cut off is told by the
others' views: the node with the most broken edges is the one cut off (cut from
everyone, it is the common end of every broken edge). A job's collectives need every pair
of its nodes, so a cut between two nodes of one job stalls it however the cut runs: one
of them must go, and on a tie the one holding the higher ranks goes (rank 0's node hosts
the rendezvous; a spare taking the other's ranks can reach it, or is judged in turn).

Raised once per node until it reaches its peers again, only for a node of a job with a
broken edge to a node of the same job (a spare cut off disturbs no job), only once both
ends have said so (one prober's word alone could be its own fault), and only once the
judgement has held `confirm_s`: a node cut from everyone for a moment, the supervisor
included, sends what it saw then once it is heard again, before its next probes say
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from supervisor.config_parts import SensingSettings
from supervisor.domain import Event, EventType
from supervisor.sensor.nodes import NodeRecord

#: Ranks of a node in no job, on a tie: below any job's, so a job's node is the one judged.
_NO_RANK = -1
#: A host monitor's probe rounds are a heartbeat period apart, this long at least.
_PROBE_PERIOD_MIN_S = 1.0


def peer_cut_confirm_s(settings: SensingSettings) -> float:
    """`peer_cut_confirm_s`, or two probe rounds and a heartbeat period."""
    if settings.peer_cut_confirm_s is not None:
        return settings.peer_cut_confirm_s
    period = settings.heartbeat_polling_period_s
    return 2 * max(period, _PROBE_PERIOD_MIN_S) + period


class PeerCuts:
    """Keeps who reports whom unreachable, and judges the nodes a new report touches."""

    def __init__(
        self, nodes: dict[str, NodeRecord], event: Callable[..., Event], confirm_s: float
    ) -> None:
        self._nodes = nodes
        self._event = event
        self._confirm_s = confirm_s
        #: node -> the nodes that last said they cannot reach it.
        self._reported_by: dict[str, set[str]] = {}

    def heard(self, node: NodeRecord, unreachable: Iterable[str], now: float) -> list[Event]:
        """`node`'s heartbeat, at `now`, named `unreachable`; the `node_cut_off` events it
        decides."""
        said = tuple(sorted(set(unreachable) - {node.name}))
        if said == node.unreachable:
            # Nothing new: only a judgement waiting for its confirmation moves on.
            return self._judge([node.name], now) if node.cut_since is not None else []
        for peer in set(node.unreachable) - set(said):
            reporters = self._reported_by.get(peer)
            if reporters is not None:
                reporters.discard(node.name)
                if not reporters:
                    del self._reported_by[peer]
        for peer in said:
            self._reported_by.setdefault(peer, set()).add(node.name)
        node.unreachable = said
        if not said:
            node.cut_off = False  # it reaches every peer again: a new cut is news
        return self._judge({node.name, *said, *self._reported_by.get(node.name, ())}, now)

    def _judge(self, names: Iterable[str], now: float) -> list[Event]:
        events = []
        for name in sorted(names):
            candidate = self._nodes.get(name)
            if candidate is None:
                continue
            if not self._cut_off(candidate):
                candidate.cut_since = None
                continue
            if candidate.cut_since is None:
                candidate.cut_since = now
            if now - candidate.cut_since >= self._confirm_s:
                candidate.cut_off, candidate.cut_since = True, None
                events.append(self._cut_off_event(candidate))
        return events

    # --- the judgement -----------------------------------------------------------------

    def _broken(self, node: NodeRecord) -> set[str]:
        """The live nodes with a broken edge to `node`, as either end said."""
        return self._alive(set(node.unreachable) | self._reported_by.get(node.name, set()))

    def _alive(self, names: set[str]) -> set[str]:
        return {n for n in names if (peer := self._nodes.get(n)) is not None and peer.alive}

    def _key(self, node: NodeRecord) -> tuple[int, int]:
        ranks = node.ranks
        return (len(self._broken(node)), min(ranks) if node.job and ranks else _NO_RANK)

    def _cut_off(self, node: NodeRecord) -> bool:
        if node.cut_off or not node.alive or node.job is None or not node.unreachable:
            return False
        if not self._alive(self._reported_by.get(node.name, set())):
            return False  # only its own word so far
        broken = self._broken(node)
        same_job = [self._nodes[n] for n in broken if self._nodes[n].job == node.job]
        if not same_job:
            return False
        key = self._key(node)
        return all(key > self._key(self._nodes[n]) for n in broken)

    def _cut_off_event(self, node: NodeRecord) -> Event:
        return self._event(
            EventType.NODE_CUT_OFF,
            node,
            cannot_reach=list(node.unreachable),
            unreachable_from=sorted(self._reported_by.get(node.name, ())),
        )
