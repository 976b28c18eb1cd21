"""A job's record in the sensor: its shape, its nodes, its progress, the ranks held."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.domain import JobView
from supervisor.sensor.progress import JobProgress


@dataclass(slots=True)
class JobRecord:
    name: str
    num_dp_replicas: int
    min_num_dp_replicas: int
    max_num_dp_replicas: int
    num_nodes_per_dp: int
    progress: JobProgress
    nodes: set[str] = field(default_factory=set)
    hang_reported: bool = False
    #: When a hang check last waited for a silent node's deadline (None: it has not since
    #: the last progress). A node heard from after that is no reason to wait again.
    hang_deferred_at: float | None = None
    #: When its first worker left the loop (finishing.py); None while it runs.
    finishing_since: float | None = None
    # rank -> the node whose last accepted heartbeat has it running or starting. A rank
    # moves to another node only once its holder stopped reporting it, or is not alive
    # (claims.py).
    claims: dict[int, str] = field(default_factory=dict)
    # `nodes` sorted, and the set it was sorted from: a snapshot reads every job's view,
    # and sorting thousands of names each time cost more than comparing the two sets.
    _sorted: tuple[str, ...] = field(default=(), repr=False, compare=False)
    _sorted_of: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def sorted_nodes(self) -> tuple[str, ...]:
        if self.nodes != self._sorted_of:
            self._sorted_of = frozenset(self.nodes)
            self._sorted = tuple(sorted(self._sorted_of))
        return self._sorted

    def view(self) -> JobView:
        return JobView(
            name=self.name,
            num_dp_replicas=self.num_dp_replicas,
            min_num_dp_replicas=self.min_num_dp_replicas,
            max_num_dp_replicas=self.max_num_dp_replicas,
            num_nodes_per_dp=self.num_nodes_per_dp,
            nodes=self.sorted_nodes(),
            last_step=self.progress.max_step if self.progress.max_step >= 0 else None,
            step_interval_s=self.progress.learned_interval_s,
        )
