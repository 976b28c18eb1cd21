"""What a sensor step produced: events to raise, and node and job records to persist."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from supervisor.domain import Event, JobView, NodeView


@dataclass(slots=True)
class Changes:
    """What a sensor step produced: events to raise and records to persist."""

    events: list[Event] = field(default_factory=list)
    nodes: list[NodeView] = field(default_factory=list)
    jobs: list[JobView] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.nodes or self.jobs)

    @staticmethod
    def merged(batch: Iterable[Changes]) -> Changes:
        """Several steps' changes as one, in order: every event, and each node's and job's
        latest record."""
        out = Changes()
        nodes: dict[str, NodeView] = {}
        jobs: dict[str, JobView] = {}
        for changes in batch:
            out.events.extend(changes.events)
            for node in changes.nodes:
                nodes.pop(node.name, None)  # re-insert: the order of the latest records
                nodes[node.name] = node
            for job in changes.jobs:
                jobs.pop(job.name, None)
                jobs[job.name] = job
        out.nodes, out.jobs = list(nodes.values()), list(jobs.values())
        return out


#: What `Sensor.ingest` returns for a heartbeat that changed nothing. Shared: never add to it.
UNCHANGED = Changes()
