"""A node's record in the sensor: what its heartbeats said, and what it went through.

The record holds its workers once (`_workers`): as the reports of the heartbeat that
brought them, or, for a steady heartbeat, as that heartbeat's bytes, decoded when read.
What the sensor needs of them is derived from that one list, by the record itself:

- `ranks`, `states`, `all_running`: the shape the steady path of `Sensor.ingest`
  compares each heartbeat with, set with the workers by `heard`;
- `workers`: the reports, parsed from the bytes when they are held as bytes;
- the workers' views (`worker_views`), built when read, and kept (as a cache) until the
  workers change, and the node's view (`view`), kept until any field it shows changes: a
  policy's snapshot of thousands of nodes decodes and rebuilds only those heard from, or
  changed, since the last one (a burst of losses takes one snapshot each).

Reading never changes what the record holds.
"""

from __future__ import annotations

import operator
from datetime import UTC, datetime

from resiliency_protocol.heartbeat import WorkerReport, parse_heartbeat
from supervisor.domain import NodeState, NodeView, WorkerState, WorkerView, wall_time

NODE = "node"
DeadlineKey = tuple[str, str]

# Worker fields read with map() in C on every heartbeat. WorkerState is a StrEnum, so the
# states join into one plain str.
rank_of = operator.attrgetter("rank")
state_of = operator.attrgetter("state")
step_of = operator.attrgetter("step")
# What a node's view is built from, read in one C call: the view is built again only when
# one of these (or the wall offset) differs from what it was built from.
_view_inputs = operator.attrgetter(
    "_workers", "state", "job", "alive", "last_seen", "restored_wall", "cordoned", "flapping"
)


def ranks_of(workers: list[WorkerReport]) -> tuple[int, ...]:
    return tuple(map(rank_of, workers))


def states_of(workers: list[WorkerReport]) -> str:
    """The workers' states joined into one str (`ingest`'s steady path builds it inline)."""
    return ",".join(map(state_of, workers))


def _all_running(workers: list[WorkerReport]) -> bool:
    return all(w.state is WorkerState.RUNNING for w in workers)


class NodeRecord:
    # The fields a steady heartbeat reads and writes come first: slots are laid out in
    # this order, so they share two cache lines (at 10,000 nodes a node's record is
    # rarely still in cache when its next heartbeat comes).
    __slots__ = (  # noqa: RUF023 (the order is the layout, see above)
        "name",
        "state",
        "job",
        "last_seen",
        "alive",
        "flapping",
        "ranks",
        "states",
        "all_running",
        "unreachable",
        "_workers",
        "address",
        "topology",
        "restored_wall",
        "cordoned",
        "up_since",
        "losses",
        "ecc_counts",
        "gpu_seen",
        "deadline_key",
        "cut_off",
        "cut_since",
        "loss_recheck",
        "_views",
        "_views_of",
        "_view",
        "_view_of",
        "_view_offset",
    )

    def __init__(
        self,
        name: str,
        state: NodeState,
        job: str | None,
        last_seen: float,
        workers: list[WorkerReport],
        *,
        address: str | None = None,
        topology: dict[str, str] | None = None,
        up_since: float = 0.0,
        from_heartbeat: bool = True,
    ) -> None:
        """A node first heard from at `last_seen` (event-loop time) reporting `workers`;
        else a record taken back from the store (see `restored`)."""
        self.name = name
        self.state = state
        self.job = job
        # Event-loop time of the last heartbeat (of the last restart, for a restored node
        # that has not reported since): the node's loss is due `heartbeat_timeout_s` after it.
        self.last_seen = last_seen
        self.alive = True
        self.flapping = False
        # The shape of `_workers` as a heartbeat reported it (see `heard`); None: no
        # heartbeat since the record was restored. A str and a tuple of ints: objects
        # the cyclic GC skips.
        self.ranks: tuple[int, ...] | None = None
        self.states = ""
        self.all_running = False  # every worker is running
        # The peers it last said it cannot reach (peer_cuts.py), sorted; and whether it
        # was judged cut off from them, once reported until it reaches them again.
        self.unreachable: tuple[str, ...] = ()
        self.cut_off = False
        self.cut_since: float | None = None  # judged cut off since, not yet reported
        # The workers as last reported: their reports, or the heartbeat's bytes. Bytes
        # are one object kept per node instead of its ~33 parsed ones (8 reports and
        # their ints), which were freed cold in the CPU's caches at the node's next
        # heartbeat; that freeing cost 2.9 us of the server's ~31 us per heartbeat
        # (bench/README.md).
        self._workers: list[WorkerReport] | bytes = workers
        self.address = address
        self.topology = topology if topology is not None else {}
        # Unix time of the last heartbeat while `last_seen` cannot tell it (restored node).
        self.restored_wall: float | None = None
        self.cordoned = False
        self.up_since = up_since
        self.losses: list[float] = []
        self.ecc_counts: dict[int | None, int] | None = None
        self.gpu_seen: dict[tuple[str, int | None, int | None], float] | None = None
        self.deadline_key: DeadlineKey = (NODE, name)  # built once
        # When its loss is checked again, after a deadline that passed while the
        # supervisor ran behind (expiries.py); None: no check pending.
        self.loss_recheck: float | None = None
        # The workers' views, and what they were built from (a cache, see the module).
        self._views: tuple[WorkerView, ...] = ()
        self._views_of: list[WorkerReport] | bytes | None = None
        # The node's view, and what it was built from (`_view_inputs`, the wall offset).
        self._view: NodeView | None = None
        self._view_of: tuple[object, ...] = ()
        self._view_offset = 0.0
        if from_heartbeat:
            self.ranks, self.states = ranks_of(workers), states_of(workers)
            self.all_running = _all_running(workers)

    @classmethod
    def restored(cls, view: NodeView, now: float) -> NodeRecord:
        """The record persisted as `view`, taken back at `now` (event-loop time). Its
        first heartbeat takes the full path of `ingest` (no shape is known to be heard)."""
        record = cls(
            view.name,
            view.state,
            view.job,
            now,
            [
                WorkerReport(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    state=w.state,
                    pid=w.pid,
                    step=w.step,
                    exit_code=w.exit_code,
                )
                for w in view.workers
            ],
            up_since=now,
            from_heartbeat=False,
        )
        record.restored_wall = (
            view.last_heartbeat.timestamp() if view.last_heartbeat else wall_time()
        )
        record.alive = view.alive
        record.cordoned = view.cordoned
        record.flapping = view.flapping
        return record

    # --- the workers ----------------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerReport]:
        """The workers as last reported."""
        held = self._workers
        if isinstance(held, bytes):  # validated when it came in: it decodes
            return parse_heartbeat(held).workers
        return held

    @property
    def body(self) -> bytes | None:
        """The bytes of the heartbeat the workers are held as; None: held as reports."""
        held = self._workers
        return held if isinstance(held, bytes) else None

    def heard(self, workers: list[WorkerReport]) -> bool:
        """A heartbeat reported these workers. Whether their ranks or states differ from
        those held before."""
        ranks, states = ranks_of(workers), states_of(workers)
        restored = self.ranks is None
        if restored:  # compared with the workers it was restored with
            before = self.workers
            changed = ranks != ranks_of(before) or states != states_of(before)
        else:
            changed = ranks != self.ranks or states != self.states
        self._workers = workers
        self.ranks, self.states = ranks, states
        if changed or restored:
            self.all_running = _all_running(workers)
        return changed

    def heard_again(self, workers: list[WorkerReport], body: bytes | None = None) -> None:
        """A steady heartbeat: the same ranks in the same states as held (the caller
        compared them), only steps and such moving. Kept as `body`, the bytes `workers`
        were parsed from, when given."""
        self._workers = workers if body is None else body

    # --- reads ----------------------------------------------------------------------------

    def last_heartbeat(self, wall_offset: float) -> float:
        """Unix time of the last heartbeat; `wall_offset`: Unix time minus loop time."""
        if self.restored_wall is not None:
            return self.restored_wall
        return self.last_seen + wall_offset

    def view(self, wall_offset: float) -> NodeView:
        """The node's view (cached until what it shows changes; views are immutable)."""
        inputs = _view_inputs(self)
        view = self._view
        if view is not None and inputs == self._view_of and wall_offset == self._view_offset:
            return view
        view = NodeView(
            name=self.name,
            state=self.state,
            job=self.job,
            alive=self.alive,
            last_heartbeat=datetime.fromtimestamp(self.last_heartbeat(wall_offset), UTC),
            workers=self.worker_views(),
            cordoned=self.cordoned,
            flapping=self.flapping,
        )
        self._view, self._view_of, self._view_offset = view, inputs, wall_offset
        return view

    def worker_views(self) -> tuple[WorkerView, ...]:
        """The workers' views (cached until the workers change)."""
        held = self._workers
        if held is not self._views_of:
            self._views = tuple(
                WorkerView(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=w.pid,
                    state=w.state,
                    step=w.step,
                    exit_code=w.exit_code,
                    compute_s=w.compute_s,
                )
                for w in self.workers
            )
            self._views_of = held
        return self._views


def node_views(records: dict[str, NodeRecord], wall_offset: float) -> dict[str, NodeView]:
    """Each record's view (`NodeRecord.view`), its cache checked inline: what a snapshot
    does when the wall offset moved (views.py; else it visits only the changed nodes)."""
    views = {}
    for name, record in records.items():
        view = record._view
        if (
            view is None
            or record._view_offset != wall_offset
            or _view_inputs(record) != record._view_of
        ):
            view = record.view(wall_offset)
        views[name] = view
    return views
