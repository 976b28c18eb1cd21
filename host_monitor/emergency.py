"""Emergency checkpoint rounds: SIGUSR1 to the workers, then collect their acks.

Only a worker that said it takes emergency checkpoints (at registration, or since:
`WorkerEmergencyCheckpoints`) is signalled: SIGUSR1's default action ends a process, so a
worker that installed no handler (one that uses the worker client without the
Checkpointer, or no client) would die of it. The others are named in the result
(`declined`, `unregistered`), so the supervisor can tell a job that takes none.

A round is identified by the actuator's `request_id`. Asking again with the same id joins
the round (or returns its result once finished), so a retried HTTP call never signals
the workers twice. A round ends when every signalled worker acked or died, or at its
deadline; its result is then frozen.

SIGUSR1 carries no data, so a signalled worker learns the round's `request_id` in one
of three ways: workers we launched find it in the file named by their env
`HOST_MONITOR_REQUEST_FILE` (written before the signal, as worker_client.py reads it);
any worker can ask `GET /v1/workers/{rank}/emergency` (see `pending`); and an ack with
an id we do not know (worker_client.py sends "signal" when it has none) counts for the
open round that signalled that worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from host_monitor.errors import HostMonitorError
from host_monitor.workers import Worker, WorkerConflict, WorkerNotFound, WorkerRegistry
from resiliency_protocol.emergency import (
    EmergencyAck,
    EmergencyCheckpointRequest,
    EmergencyCheckpointResult,
)
from resiliency_protocol.worker_wire import WorkerEmergencyCheckpoints

log = logging.getLogger(__name__)

KEEP_ROUNDS = 64  # finished rounds remembered for idempotency
CHECK_PERIOD_S = 0.05  # how often a round looks for workers that died without acking


class UnknownRound(HostMonitorError, KeyError):
    """No round with this request_id (HTTP 404)."""


@dataclass(slots=True)
class Round:
    request_id: str
    started: float
    deadline: float
    targets: dict[int, int]  # rank -> host pid signalled
    declined: list[int] = field(default_factory=list)  # registered, taking none
    unregistered: list[int] = field(default_factory=list)
    acked: dict[int, EmergencyAck] = field(default_factory=dict)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: EmergencyCheckpointResult | None = None


class EmergencyRounds:
    def __init__(self, registry: WorkerRegistry, keep: int = KEEP_ROUNDS) -> None:
        self._registry = registry
        self._keep = keep
        self._rounds: OrderedDict[str, Round] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Told each round's seconds once it ended (the agent's metrics).
        self.on_round_done: Callable[[float], None] | None = None

    async def run(self, req: EmergencyCheckpointRequest) -> EmergencyCheckpointResult:
        round_ = self._rounds.get(req.request_id)
        if round_ is None:
            round_ = self._begin(req)
        else:
            log.info("emergency checkpoint %s asked again: joining it", req.request_id)
        await round_.done.wait()
        assert round_.result is not None
        return round_.result

    def set_taking(self, rank: int, update: WorkerEmergencyCheckpoints) -> Worker:
        """Whether `rank` takes emergency checkpoints from now on (its handler was installed
        or put back after it registered). WorkerConflict for another process's update."""
        worker = self._registry.get(rank)
        self._registry.check_same_process(rank, worker, update.pid, update.pid_namespace)
        if worker.emergency_checkpoints != update.emergency_checkpoints:
            worker.emergency_checkpoints = update.emergency_checkpoints
            log.info(
                "rank %d %s emergency checkpoints",
                rank,
                "takes" if update.emergency_checkpoints else "no longer takes",
            )
        return worker

    def pending(self, rank: int) -> tuple[str, float] | None:
        """The newest open round waiting for `rank`'s ack: (request_id, seconds left)."""
        round_ = self._open_round(rank)
        if round_ is None:
            return None
        return round_.request_id, max(0.0, round_.deadline - time.monotonic())

    def _open_round(self, rank: int) -> Round | None:
        for round_ in reversed(self._rounds.values()):
            if not round_.done.is_set() and rank in round_.targets and rank not in round_.acked:
                return round_
        return None

    def ack(self, rank: int, ack: EmergencyAck) -> tuple[str, bool]:
        """Record `rank`'s answer: (the round's request_id, whether it counted).

        It does not count when the round already ended (too late).
        """
        round_ = self._rounds.get(ack.request_id)
        if round_ is None or rank not in round_.targets:
            # A worker that could not learn the id: the open round that signalled it.
            pending = self._open_round(rank)
            if pending is None:
                if round_ is None:
                    raise UnknownRound(ack.request_id)
                raise WorkerConflict(f"rank {rank} was not signalled in round {ack.request_id!r}")
            round_ = pending
            ack = ack.model_copy(update={"request_id": round_.request_id})
        if round_.done.is_set():
            log.warning("rank %d acked %s after the round ended", rank, ack.request_id)
            return round_.request_id, False
        round_.acked[rank] = ack
        round_.wakeup.set()
        log.info(
            "rank %d acked emergency checkpoint %s: ok=%s step=%s",
            rank,
            ack.request_id,
            ack.ok,
            ack.step,
        )
        return round_.request_id, True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- internals ----------------------------------------------------------------------

    def _begin(self, req: EmergencyCheckpointRequest) -> Round:
        now = time.monotonic()
        round_ = Round(req.request_id, now, now + req.timeout_s, {})
        for worker in self._registry.live():
            # Only registered workers: one still starting may not handle SIGUSR1 yet (its
            # default action kills the process) and has nothing to save anyway.
            if not worker.registered or worker.host_pid is None:
                round_.unregistered.append(worker.rank)
                continue
            # Nor one that said it installed no handler: the signal would kill it.
            if not worker.emergency_checkpoints:
                round_.declined.append(worker.rank)
                continue
            if worker.request_file is not None:
                _write_atomically(worker.request_file, req.request_id)
            # Only the registered pid, not the group: its children (data loaders) do not
            # handle it.
            if worker.signal(signal.SIGUSR1, group=False):
                round_.targets[worker.rank] = worker.host_pid
        self._rounds[req.request_id] = round_
        while len(self._rounds) > self._keep:
            oldest = next(iter(self._rounds.values()))
            if not oldest.done.is_set():
                break  # never forget a round somebody may still be waiting on
            self._rounds.popitem(last=False)
        log.info(
            "emergency checkpoint %s: signalled ranks %s, waiting up to %.1fs (not: ranks "
            "%s taking none, %s not registered)",
            req.request_id,
            sorted(round_.targets),
            req.timeout_s,
            round_.declined,
            round_.unregistered,
        )
        task = asyncio.create_task(self._drive(round_))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return round_

    async def _drive(self, round_: Round) -> None:
        try:
            while not self._settled(round_):
                left = round_.deadline - time.monotonic()
                if left <= 0:
                    break
                round_.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(round_.wakeup.wait(), min(left, CHECK_PERIOD_S))
        finally:
            missing = sorted(r for r in round_.targets if r not in round_.acked)
            round_.result = EmergencyCheckpointResult(
                request_id=round_.request_id,
                acked=dict(sorted(round_.acked.items())),
                missing=missing,
                elapsed_s=round(time.monotonic() - round_.started, 6),
                declined=round_.declined,
                unregistered=round_.unregistered,
            )
            round_.done.set()
            if self.on_round_done is not None:
                self.on_round_done(round_.result.elapsed_s)
            log.info(
                "emergency checkpoint %s done in %.3fs: acked %s, missing %s",
                round_.request_id,
                round_.result.elapsed_s,
                sorted(round_.acked),
                missing,
            )

    def _settled(self, round_: Round) -> bool:
        """Every signalled worker answered, or is gone (a dead worker will never answer)."""
        for rank in round_.targets:
            if rank in round_.acked:
                continue
            try:
                worker = self._registry.get(rank)
            except WorkerNotFound:
                continue
            if worker.alive and worker.host_pid == round_.targets[rank]:
                return False
        return True


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` so that a reader sees the old content or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write the emergency request id to %s: %s", path, exc)
