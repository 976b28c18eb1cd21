"""Emergency checkpoints: the last completed step saved on the host monitor's request.

A part of `Checkpointer` (a base class of it): `emergency_save` runs in the worker
client's thread while the main thread trains, waits in a collective, or after that
collective raised, and needs no collective (see checkpointer.py for the step gate it
waits on). When the step is already in the RAM tier it is copied to the durable tier
(a directory or a bucket) if that lacks it; otherwise it is written from the live
tensors to every tier.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import format as fmt
from training.checkpoint.durable import DurableStore
from training.checkpoint.saver import SaveJob, Saver
from training.checkpoint.settings import CheckpointSettings
from training.checkpoint.state import Snapshot, StagingBuffers, TrainingState
from training.errors import TrainingError
from training.worker_client import WorkerClient

log = logging.getLogger("training.checkpoint.checkpointer")


#: Beyond `emergency_checkpoint_timeout_s`, what a process that is ending waits for a save
#: in flight to be acked to its host monitor.
ACK_MARGIN_S = 10.0


class EmergencyCheckpointError(TrainingError, RuntimeError):
    """An emergency save could not be made (the message says why)."""


class EmergencySaves:
    # Set by Checkpointer.__init__.
    settings: CheckpointSettings
    rank: int
    state: TrainingState
    client: WorkerClient | None
    emergency: bool
    ram_root: Path | None
    durable: DurableStore | None
    _saver: Saver
    _gate: threading.Condition
    _mid_step: bool
    _holder: int | None
    _completed: Snapshot | None
    #: The process is ending (its training loop raised): a step in flight never completes.
    _loop_ended = False

    def training_ended(self) -> None:
        """The training loop will take no more steps (the process is ending): a request
        waiting for the step in flight's `step_done` fails now instead of at its timeout."""
        with self._gate:
            self._loop_ended = True
            self._gate.notify_all()

    def emergency_save(self) -> int:
        """Save the last completed step now, to RAM and durable storage; returns the step.

        Callable from any thread, while the main thread trains, waits in a collective, or
        after that collective raised; needs no collective. Raises EmergencyCheckpointError
        when no step is complete yet, or when the step in flight does not reach its
        `step_done` within `emergency_checkpoint_timeout_s`.
        """
        if not self.emergency:
            raise EmergencyCheckpointError("emergency checkpoints are off for this Checkpointer")
        started = time.monotonic()
        deadline = started + self.settings.emergency_checkpoint_timeout_s
        with self._gate:
            if not self._gate.wait_for(
                lambda: self._holder is None and (self._loop_ended or not self._mid_step),
                timeout=max(0.0, deadline - time.monotonic()),
            ):
                raise EmergencyCheckpointError(
                    "the step in flight did not finish its optimizer step within "
                    f"{self.settings.emergency_checkpoint_timeout_s:g}s: not saving half a step"
                )
            if self._mid_step:  # woken by the loop's end
                raise EmergencyCheckpointError(
                    "the training loop ended between an optimizer.step() and its "
                    "step_done: not saving half a step"
                )
            snapshot = self._completed
            if snapshot is None:
                raise EmergencyCheckpointError("no completed step yet (restore has not finished)")
            self._holder = threading.get_ident()
        try:
            self._write_emergency(snapshot, started, deadline)
        finally:
            with self._gate:
                self._holder = None
                self._gate.notify_all()
        log.warning(
            "checkpoint: emergency checkpoint of step %d saved in %.3fs",
            snapshot.step,
            time.monotonic() - started,
        )
        return snapshot.step

    def _write_emergency(self, snapshot: Snapshot, started: float, deadline: float) -> None:
        step = snapshot.step
        # A periodic save being written holds the staging buffers, and may be this step's.
        if not self._saver.wait(max(0.0, deadline - time.monotonic())):
            raise EmergencyCheckpointError("a periodic save still being written took too long")
        ram, durable = self.ram_root, self.durable
        if ram is None and durable is None:
            raise EmergencyCheckpointError("no tier to save to (RAM and durable are both off)")
        if ram is not None and step in fmt.committed_steps(ram, self.rank):
            source = fmt.rank_dir(ram, step, self.rank)
            if durable is not None and step not in durable.committed_steps(self.rank):
                manifest = fmt.read_manifest(source, step=step, rank=self.rank)
                error = self._saver.copy_emergency(step, source, manifest)
                if error is not None:
                    raise EmergencyCheckpointError(f"durable copy of step {step}: {error}")
            self._report_emergency(step, fmt.read_manifest(source).total_bytes, started)
            return
        if durable is not None and step in durable.committed_steps(self.rank):
            self._report_emergency(step, durable.manifest(step, self.rank).total_bytes, started)
            return
        # Straight from the live tensors: nothing changes them while this thread holds the
        # gate, and the staging buffers may belong to the save that just finished.
        try:
            state = self.state.state_at(snapshot)
        except ValueError as exc:
            raise EmergencyCheckpointError(f"step {step}: {exc}") from None
        if snapshot.ready is not None:
            # A GPU state goes to host memory first, on a stream of its own: the writer
            # would copy on the training stream, which a stuck collective blocks.
            state = StagingBuffers().stage(state, after=snapshot.ready)
        job = SaveJob(
            step, state, ram is not None, durable is not None, 0.0, started, emergency=True
        )
        self._saver.submit(job, background=False)
        failed = [r for r in self._saver.results[-2:] if r.step == step and r.error]
        if failed:
            raise EmergencyCheckpointError(f"writing step {step} failed: {failed[-1].error}")

    def _report_emergency(self, step: int, size: int, started: float) -> None:
        if self.client is not None:
            seconds = time.monotonic() - started
            self.client.report_checkpoint_saved(
                step, seconds, Tier.EMERGENCY, size_bytes=size, total_s=seconds
            )
