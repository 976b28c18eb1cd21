"""What the rest of the supervisor reads of the sensor's picture.

The node and job records are the sensor's own: others read them through these methods
(views, names, a few facts), never the records themselves. `Sensor` has them from
`SensorReads`.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.config_parts import SensingSettings
from supervisor.domain import JobView, NodeState, NodeView, wall_time
from supervisor.sensor.clock import SensorClock
from supervisor.sensor.finishing import AT_WORK, SensedPhase, phase
from supervisor.sensor.jobs import JobRecord
from supervisor.sensor.nodes import NodeRecord
from supervisor.sensor.views import NodeViews

#: The probe ring (`probe_targets`) is this old at most.
RING_REFRESH_S = 5.0


class SensorReads(SensorClock):
    # What `Sensor` sets up.
    settings: SensingSettings
    _nodes: dict[str, NodeRecord]
    _jobs: dict[str, JobRecord]
    _node_views: NodeViews
    _ring_built: tuple[float, list[str], dict[str, int]] | None = None

    def has_node(self, name: str) -> bool:
        return name in self._nodes

    def has_job(self, name: str) -> bool:
        return name in self._jobs

    def node_names(self) -> list[str]:
        """Every node the sensor knows (alive or not), sorted."""
        return sorted(self._nodes)

    def job_names(self) -> list[str]:
        """Every job the sensor knows, sorted."""
        return sorted(self._jobs)

    def node_address(self, name: str) -> str | None:
        """Where the node's host monitor listens, as its last heartbeat said."""
        node = self._nodes.get(name)
        return node.address if node is not None else None

    def probe_targets(self, name: str, each_side: int) -> list[tuple[str, str]]:
        """(name, address) of `name`'s neighbours, `each_side` on each side, on the ring of
        the live nodes with an address, in name order (peer_cuts.py): each node probes as
        many and is probed by as many, whatever the cluster's size."""
        ring, index = self._ring()
        at = index.get(name)
        if at is None or len(ring) < 2:
            return []
        peers = dict.fromkeys(
            ring[(at + step) % len(ring)]
            for offset in range(1, each_side + 1)
            for step in (offset, -offset)
        )
        peers.pop(name, None)
        return [(peer, address) for peer in peers if (address := self._nodes[peer].address)]

    def _ring(self) -> tuple[list[str], dict[str, int]]:
        """The live nodes with an address, sorted, and each one's place: built again at
        most every RING_REFRESH_S (every node asks for its targets now and then; sorting
        10,000 names for each would cost more than its heartbeats)."""
        now = self._deadlines.time()
        if self._ring_built is None or now - self._ring_built[0] >= RING_REFRESH_S:
            ring = sorted(n.name for n in self._nodes.values() if n.alive and n.address)
            self._ring_built = (now, ring, {name: i for i, name in enumerate(ring)})
        return self._ring_built[1], self._ring_built[2]

    def healthy_nodes(self) -> list[tuple[str, NodeState, bool]]:
        """(name, state, cordoned) of each node alive and not flapping: those that may
        serve as spares. Read from the records, without building every node's view."""
        return [
            (node.name, node.state, node.cordoned)
            for node in self._nodes.values()
            if node.alive and not node.flapping
        ]

    def running_jobs(self) -> set[str]:
        """The jobs of which some node reports running."""
        running = NodeState.RUNNING
        nodes = self._nodes
        return {
            name
            for name, job in self._jobs.items()
            if any((node := nodes.get(n)) is not None and node.state is running for n in job.nodes)
        }

    def job_steps(self) -> list[tuple[str, int, float]]:
        """(job, newest step, Unix time the sensor first saw it) for each job with a step."""
        loop_now = self._clock()
        wall_now = wall_time()
        return [
            (name, job.progress.max_step, wall_now - (loop_now - job.progress.last_progress))
            for name, job in self._jobs.items()
            if job.progress.max_step >= 0
        ]

    def node_view(self, name: str) -> NodeView | None:
        node = self._nodes.get(name)
        return node.view(self._wall_offset()) if node else None

    def job_view(self, name: str) -> JobView | None:
        job = self._jobs.get(name)
        return job.view() if job else None

    def snapshot(self) -> tuple[dict[str, NodeView], dict[str, JobView]]:
        """Every node's and job's view, in dicts of the caller's own. Only the nodes that
        changed since the last snapshot are visited (views.py)."""
        return (
            self._node_views.current(self._nodes, self._wall_offset()),
            {
                name: replace(j.view(), phase=self.job_phase(name) or "running")
                for name, j in self._jobs.items()
            },
        )

    def heartbeat_age_s(self, name: str) -> float | None:
        node = self._nodes.get(name)
        if node is None:
            return None
        return max(0.0, wall_time() - node.last_heartbeat(self._wall_offset()))

    def flapping_clears_in_s(self, name: str) -> float | None:
        """Seconds until a flapping node that is up loses the mark: it is cleared by the
        first heartbeat after `flap_window_s` of steady heartbeats. None: not flapping,
        or lost (the steady time starts when it is heard again)."""
        node = self._nodes.get(name)
        if node is None or not node.flapping or not node.alive:
            return None
        return max(0.0, node.up_since + self.settings.flap_window_s - self._clock())

    def job_phase(self, job_name: str) -> SensedPhase | None:
        """running, finishing or finished (supervisor/sensor/finishing.py); None: unknown."""
        job = self._jobs.get(job_name)
        if job is None:
            return None
        known = self._nodes
        # The workers' views, kept until the workers change: not decoded again on each
        # read. A job at work is known as such from its first alive node with a worker at
        # work: the common case stops there rather than gathering every node's workers (a
        # snapshot reads every job's phase).
        for node in map(known.get, job.nodes):
            if (
                node is not None
                and node.alive
                and any(w.state in AT_WORK for w in node.worker_views())
            ):
                return "running" if job.finishing_since is None else "finishing"
        nodes = [n for n in map(known.get, job.nodes) if n is not None]
        workers = [w for n in nodes if n.alive for w in n.worker_views()]
        if not any(n.alive for n in nodes):
            # Every node gone (the hosts of a job that ended exit, pods are deleted): what
            # they said last, but a node taken out of service (one a hot-swap replaced)
            # speaks for no rank any more. Workers last seen at work count as at work.
            workers = [w for n in nodes if not n.cordoned for w in n.worker_views()]
        return phase(job.finishing_since, workers)

    def hang_timeout_s(self, job_name: str) -> float | None:
        job = self._jobs.get(job_name)
        return job.progress.timeout_s if job and job.progress.watching else None

    def ecc_count(self, node_name: str, gpu: int | None = None) -> int:
        """The node's last cumulative ECC count for `gpu` (0: none reported)."""
        node = self._nodes.get(node_name)
        return (node.ecc_counts or {}).get(gpu, 0) if node else 0

    def _require(self, name: str) -> NodeRecord:
        node = self._nodes.get(name)
        if node is None:
            raise KeyError(name)
        return node
