"""The simulated cluster: nodes, spares, repairs, and one training job with its
checkpoint tiers. The backend through which the supervisor acts on it is backend.py.

What the model assumes (ray's autoscaler states its provider's assumptions; so do we):
- The job runs `num_dp_replicas` replicas of `num_nodes_per_dp` nodes; each node one
  worker per GPU. It steps at a fixed rate; checkpoint tiers are saved every `every_s`
  of training, blocking it for `save_s`.
- Any fault on a node of the job stalls the whole job (a collective waits for it).
- A node that goes down (`node_down`) loses its host memory: checkpoints kept only there
  (`survives: process`) are gone; `survives: node` survives one such loss between two
  restarts (copies on a peer), `all` survives everything. A `network` fault keeps the
  node unreachable for a while; its memory survives.
- A failed node (down, or taken out of service by a hot swap or a scale down) is back,
  uncordoned, as a spare `repair_s` later.
- A restart loads the newest checkpoint still whole; a restart in place takes
  `in_place_restart_s`, any other restart `startup_s`, both plus the tier's `restore_s`.
- A restart of the workload replaces nodes that are down with spares, as the scheduler
  would; with none, the job waits (pending) until a node is back.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from resiliency_protocol.faults import SimulatedFault
from supervisor.actuator import ActionError, BackendHooks
from supervisor.domain import (
    ActionRequest,
    ActionType,
)
from supervisor.goodput.model import (
    EMERGENCY_TIER,
    CheckpointLoaded,
    CheckpointSaved,
    JobStarted,
    ReplicaChange,
    StepReported,
)
from supervisor.sensor import GpuReport, HostHeartbeat
from supervisor.simulate.fault_acts import SIMULATED_ACTS
from supervisor.simulate.fault_sources import Fault
from supervisor.simulate.hosts import SimNode, heartbeat
from supervisor.simulate.scenario import Scenario, Survives, TierModel
from supervisor.simulate.sensor import SimulatedSensor

log = logging.getLogger(__name__)

RUNNING, STALLED, STARTING, PENDING = "running", "stalled", "starting", "pending"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    time: float
    tier: str
    survives: Survives
    restore_s: float


@dataclass
class Counters:
    """What a run did, beyond the goodput."""

    spares_used: int = 0
    spares_returned: int = 0
    repairs: int = 0
    steps_lost: int = 0
    reduced_s: float = 0.0
    no_spare_s: float = 0.0
    faults_applied: int = 0
    faults_skipped: int = 0
    pending_s: float = 0.0


class SimulatedCluster:
    def __init__(self, scenario: Scenario, faults: Sequence[Fault]) -> None:
        self.scenario = scenario
        self.model = scenario.cluster
        self.job = scenario.job
        k, r = self.model.num_nodes_per_dp, self.model.num_dp_replicas
        width = len(str(self.model.nodes))
        self.nodes: dict[str, SimNode] = {}
        for i in range(self.model.nodes):
            name = f"node-{i:0{max(5, width)}d}"
            self.nodes[name] = SimNode(name, slot=i if i < r * k else None)
        self.slots: list[str | None] = [n.name for n in list(self.nodes.values())[: r * k]]
        self.replicas = r
        self.max_replicas = r
        self.faults = list(faults)
        self.records: list[Any] = []
        self.counters = Counters()
        self.state = STARTING
        self._base_step = 0
        self._attempt_start = 0.0  # loop time the current attempt's training began
        self._compute_s = 0.0  # training seconds of the current attempt, saves excluded
        self._segment_start: float | None = None  # loop time compute resumed, if running
        self._stalled_step = 0
        self._next_save: dict[str, float] = {}  # tier -> compute seconds of its next save
        self.checkpoints: list[Checkpoint] = []
        self._lost_since_restart = 0
        self._train: asyncio.Task[None] | None = None
        self._resume: asyncio.TimerHandle | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._reported: dict[str, tuple[Any, ...]] = {}
        self._hooks: BackendHooks | None = None
        self._sensor: SimulatedSensor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_tick = 0.0
        self._ingest: Any = None
        self.end = scenario.duration_s

    # --- wiring ---------------------------------------------------------------------------

    async def start(
        self, sensor: SimulatedSensor, hooks: BackendHooks, ingest: Any, register: Any
    ) -> None:
        """Register every node with the sensor, schedule the faults, start the job."""
        self._sensor, self._hooks, self._ingest = sensor, hooks, ingest
        self._loop = asyncio.get_running_loop()
        await register([self._heartbeat(node) for node in self.nodes.values()])
        for fault in self.faults:
            self._timers.append(self._loop.call_at(fault.time, self._fault_now, fault))
        self.records.append(ReplicaChange(0.0, self.replicas, self.max_replicas))
        self.begin_attempt(startup_s=self.job.startup_s)

    def close(self, now: float) -> None:
        self._tick(now)
        if self.state == RUNNING:
            self._account_compute(now)
            self.records.append(StepReported(self.step, now))
        for timer in self._timers:
            timer.cancel()
        if self._resume is not None:
            self._resume.cancel()
        if self._train is not None:
            self._train.cancel()

    # --- what the sensor asks -------------------------------------------------------------

    def heartbeating(self, node: str) -> bool:
        sim = self.nodes.get(node)
        return sim is not None and sim.up

    def progressing(self, job: str) -> int | None:
        return self.step if job == self.job.name and self.state == RUNNING else None

    @property
    def step(self) -> int:
        compute = self._compute_s
        if self.state == RUNNING and self._segment_start is not None and self._loop:
            compute += self._loop.time() - self._segment_start
        return self._base_step + int(compute // self.job.step_s)

    # --- the job ----------------------------------------------------------------------------

    def now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def begin_attempt(self, *, startup_s: float) -> None:
        """Start the job's workers now; training resumes once started and restored."""
        now = self.now()
        self._tick(now)
        if not self._fill_slots():
            self.state = PENDING
            return
        self.records.append(JobStarted(now))
        checkpoint = self._newest_whole()
        restore = checkpoint.restore_s if checkpoint else 0.0
        step = checkpoint.step if checkpoint else 0
        if step < self._stalled_step:
            self.counters.steps_lost += self._stalled_step - step
        self._stalled_step = step
        self.state = STARTING
        self._lost_since_restart = 0
        for node in self.job_nodes():
            node.exited = False
            node.memory_lost = False
        ready = now + startup_s + restore
        if checkpoint is not None:
            self.records.append(CheckpointLoaded(checkpoint.step, ready, restore, checkpoint.tier))
        if self._resume is not None:
            self._resume.cancel()
        self._resume = self._loop_call_at(ready, self._resume_training, step)
        self._spawn_reports()

    def _loop_call_at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        assert self._loop is not None
        return self._loop.call_at(when, callback, *args)

    def _resume_training(self, step: int) -> None:
        self._resume = None
        now = self.now()
        self._tick(now)
        self.state = RUNNING
        self._base_step = step
        self._compute_s = 0.0
        self._segment_start = now
        self._next_save = {t.name: t.every_s for t in self.job.tiers}
        assert self._sensor is not None
        self._sensor.progressed(self.job.name, step, now)
        self._train = asyncio.get_running_loop().create_task(self._training(), name="sim-train")

    def _account_compute(self, now: float) -> None:
        if self._segment_start is not None:
            self._compute_s += now - self._segment_start
            self._segment_start = now

    async def _training(self) -> None:
        tiers = {t.name: t for t in self.job.tiers}
        while True:
            due = min(self._next_save.values(), default=math.inf)
            if math.isinf(due):
                await asyncio.sleep(self.end * 2)
                continue
            await asyncio.sleep(max(0.0, due - self._compute_s - self._elapsed()))
            self._account_compute(self.now())
            self._segment_start = None  # blocked while saving
            step = self.step
            for name in sorted(self._next_save, key=lambda n: tiers[n].save_s):
                if self._next_save[name] > self._compute_s + 1e-9:
                    continue
                tier = tiers[name]
                self._next_save[name] += tier.every_s
                await self._save(tier, step)
            self._segment_start = self.now()

    def _elapsed(self) -> float:
        return self.now() - self._segment_start if self._segment_start is not None else 0.0

    async def _save(self, tier: TierModel, step: int) -> None:
        if tier.save_s:
            await asyncio.sleep(tier.save_s)
        now = self.now()
        self.records.append(StepReported(step, now - tier.save_s))
        self.records.append(CheckpointSaved(step, now, tier.save_s, tier.name))
        self.checkpoints.append(Checkpoint(step, now, tier.name, tier.survives, tier.restore_s))
        self._prune_checkpoints()

    async def emergency_save(self) -> int:
        """Save an emergency checkpoint now (training blocks for `emergency_checkpoint_s`);
        its step. ActionError when there is nothing to save."""
        if self.state == PENDING or (self.state == STARTING and self._resume is not None):
            raise ActionError(f"the job is not running ({self.state}): nothing to save")
        was_running = self.state == RUNNING
        if was_running:
            self._account_compute(self.now())
            self._segment_start = None
            if self._train is not None:
                self._train.cancel()
                self._train = None
        step = self.step if was_running else self._stalled_step
        cost, survives = self.job.emergency_checkpoint_s, self.job.emergency_checkpoint_survives
        if cost:
            await asyncio.sleep(cost)
        now = self.now()
        self.records.append(CheckpointSaved(step, now, cost, EMERGENCY_TIER))
        # Kept in host memory (and on peers or storage, as `survives` says): it restores
        # as fast as the fastest tier.
        restore_s = min((t.restore_s for t in self.job.tiers), default=0.0)
        self.checkpoints.append(Checkpoint(step, now, EMERGENCY_TIER, survives, restore_s))
        self._prune_checkpoints()
        if was_running and self.state == RUNNING:
            self._segment_start = now
            self._train = asyncio.get_running_loop().create_task(self._training())
        return step

    def _prune_checkpoints(self) -> None:
        """Keep the newest checkpoint of each tier (older ones are never loaded)."""
        newest: dict[str, Checkpoint] = {}
        for c in self.checkpoints:
            newest[c.tier] = c
        self.checkpoints = list(newest.values())

    def _newest_whole(self) -> Checkpoint | None:
        whole = [c for c in self.checkpoints if c.survives != "process" or not self._any_lost]
        whole = [c for c in whole if c.survives != "node" or self._lost_since_restart < 2]
        return max(whole, key=lambda c: (c.step, c.time), default=None)

    @property
    def _any_lost(self) -> bool:
        return self._lost_since_restart > 0

    def stall(self, why: str) -> None:
        """Training stops now (a fault on a node of the job)."""
        now = self.now()
        if self.state == RUNNING:
            self._account_compute(now)
            self._segment_start = None
            self._stalled_step = self.step
            self.records.append(StepReported(self._stalled_step, now))
            assert self._sensor is not None
            self._sensor.progressed(self.job.name, self._stalled_step, now)
        if self._train is not None:
            self._train.cancel()
            self._train = None
        if self._resume is not None:  # a fault while starting: the start fails
            self._resume.cancel()
            self._resume = None
        if self.state in (RUNNING, STARTING):
            self._tick(now)
            self.state = STALLED
        log.debug("job stalled at %.0f: %s", now, why)

    # --- nodes ---------------------------------------------------------------------------

    def job_nodes(self) -> list[SimNode]:
        return [
            self.nodes[n]
            for n in self.slots[: self.replicas * self.model.num_nodes_per_dp]
            if n is not None
        ]

    def free(self) -> list[SimNode]:
        """Nodes a job may take: up, not in the job, not cordoned, not in repair."""
        return [
            n
            for n in self.nodes.values()
            if n.slot is None and n.up and not n.cordoned and not n.in_repair
        ]

    def _fill_slots(self) -> bool:
        """Give every empty slot of the running replicas a free node (as the scheduler
        would); False when some stay empty."""
        k = self.model.num_nodes_per_dp
        wanted = range(self.replicas * k)
        free = self.free()
        for slot in wanted:
            if self.slots[slot] is None:
                if not free:
                    return False
                node = free.pop(0)
                node.slot = slot
                self.slots[slot] = node.name
                self.counters.spares_used += 1
        return True

    def vacate(self, node: SimNode) -> None:
        if node.slot is not None:
            self.slots[node.slot] = None
            node.slot = None

    def to_repair(self, node: SimNode) -> None:
        """Out of service until repaired, then back (uncordoned) as a spare."""
        if node.in_repair:
            return
        node.in_repair = True
        self.counters.repairs += 1
        self._timers.append(
            self._loop_call_at(self.now() + self.model.repair_s, self._repaired, node)
        )

    def _repaired(self, node: SimNode) -> None:
        asyncio.get_running_loop().create_task(self._back(node), name=f"repaired:{node.name}")

    async def _back(self, node: SimNode) -> None:
        self._tick(self.now())
        node.in_repair = False
        node.up = True
        node.exited = False
        if node.slot is not None and self.state not in (RUNNING, STARTING):
            self.vacate(node)  # its workers are gone: the job's next start places them
        await self.report(node)
        if node.cordoned and self._hooks is not None:
            request = ActionRequest(ActionType.UNCORDON, node=node.name, reason="repaired")
            await self._hooks.request_action(request, f"sim-repaired-{node.name}-{self.now()}")
        self.counters.spares_returned += 1
        if self.state == PENDING:
            self.begin_attempt(startup_s=self.job.startup_s)

    # --- faults ---------------------------------------------------------------------------

    def _fault_now(self, fault: Fault) -> None:
        asyncio.get_running_loop().create_task(self._fault(fault), name=f"fault:{fault.kind}")

    async def _fault(self, fault: Fault) -> None:
        node = self.nodes.get(fault.node)
        if node is None or not node.up or node.in_repair:
            self.counters.faults_skipped += 1  # already down: nothing more to break
            return
        self.counters.faults_applied += 1
        now = self.now()
        self._tick(now)
        in_job = node.slot is not None and self.state in (RUNNING, STARTING, STALLED)
        await SIMULATED_ACTS[SimulatedFault(fault.kind)](self, node, fault, now, in_job)

    def go_down(self, node: SimNode, now: float) -> None:
        """The node dies: silent, its host memory lost, in repair until back as a spare."""
        node.up = False
        node.memory_lost = True
        if node.slot is not None:
            self._lost_since_restart += 1
        assert self._sensor is not None
        self._sensor.silence(node.name, now)
        self.to_repair(node)

    def cut_off(self, node: SimNode, now: float, duration_s: float) -> None:
        """The node is unreachable for `duration_s`, its memory kept, then back."""
        node.up = False
        assert self._sensor is not None
        self._sensor.silence(node.name, now)
        self._timers.append(self._loop_call_at(now + duration_s, self._reachable, node))

    def _reachable(self, node: SimNode) -> None:
        if node.in_repair or node.up:
            return
        node.up = True
        asyncio.get_running_loop().create_task(self.report(node), name=f"back:{node.name}")

    # --- what the host monitors would report -------------------------------------------------

    def _spawn_reports(self) -> None:
        asyncio.get_running_loop().create_task(self._report_all(), name="sim-reports")

    async def _report_all(self) -> None:
        for node in self.nodes.values():
            if node.up:
                await self.report(node)

    async def report(
        self,
        node: SimNode,
        *,
        gpu_reports: list[GpuReport] | None = None,
        exit_code: int | None = None,
    ) -> None:
        """Send the node's heartbeat when what it says changed (or it carries a report)."""
        key = self._key(node, exit_code)
        if key == self._reported.get(node.name) and not gpu_reports and node.up:
            return
        await self._ingest(self._heartbeat(node, gpu_reports=gpu_reports, exit_code=exit_code))

    async def report_left(self) -> None:
        """Nodes that left the job say so (their host monitors would)."""
        for node in list(self.nodes.values()):
            said = self._reported.get(node.name)
            if node.slot is None and node.up and said is not None and said[0] == "job":
                await self.report(node)

    def _key(self, node: SimNode, exit_code: int | None = None) -> tuple[Any, ...]:
        if node.slot is None:
            return ("spare",)
        state = "exited" if node.exited else ("running" if self.state != PENDING else "stopped")
        return ("job", node.slot, state, exit_code)

    def _heartbeat(
        self,
        node: SimNode,
        *,
        gpu_reports: list[GpuReport] | None = None,
        exit_code: int | None = None,
    ) -> HostHeartbeat:
        """What the node's host monitor says now (noted as said)."""
        self._reported[node.name] = self._key(node, exit_code)
        return heartbeat(
            node,
            job=self.job.name,
            gpus=self.model.gpus_per_node,
            stopped=self.state == PENDING,
            step=self._stalled_step,
            gpu_reports=gpu_reports or [],
            exit_code=exit_code,
        )

    # --- accounting -------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        """Time with fewer replicas than the job's maximum, with no spare, and pending."""
        span = now - self._last_tick
        if span > 0:
            if self.replicas < self.max_replicas:
                self.counters.reduced_s += span
            if not self.free():
                self.counters.no_spare_s += span
            if self.state == PENDING:
                self.counters.pending_s += span
        self._last_tick = now
