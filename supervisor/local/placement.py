"""Where the peer checkpoint tier keeps each node's copies: its partner in the placement.

Every placement change (a restart, a hot-swap, a scale) gives each node its partner in
the new placement: the started nodes with their start, the survivors of an in-process
heal with their new world (supervisor/local/cluster.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.local.cluster_state import JobSpec


def checkpoint_partner(job: JobSpec, rank: int) -> str | None:
    """The node whose host monitor keeps copies of `rank`'s RAM checkpoints (the peer
    tier): the node of the same shard in the next data-parallel replica, so that losing a
    whole replica loses no shard; with one replica, the node of the next rank. None for a
    job of one node."""
    world = len(job.placement)
    offset = job.num_nodes_per_dp if job.num_dp_replicas > 1 else 1
    partner = job.placement[(rank + offset) % world]
    return None if partner == job.placement[rank] else partner
