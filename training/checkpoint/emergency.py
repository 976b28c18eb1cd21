"""Emergency checkpoints: the last completed step saved on the host monitor's request.

`StepGate` is the step gate between `optimizer.step()` and its `step_done` (see
checkpointer.py); `EmergencySaver`, the Checkpointer's collaborator that saves:
`emergency_save` runs in the worker client's thread while the main thread trains, waits
in a collective, or after that collective raised, and needs no collective. When the step
is already committed in the first tier, the later tiers that lack it get a copy (a
directory or a bucket); otherwise it is written from the live tensors to every tier.

The worker client serves the host monitor's requests from its own thread
(`WorkerClient.serve_emergency_checkpoints`), so a rank saves while its main thread is
blocked in a collective whose peer is gone or frozen, and after that collective raised.
The parameters and optimizer state are read live (only `optimizer.step()` changes them,
and it waits while the save reads them), the rest (RNG, scheduler, the user's objects,
model buffers) comes from a copy taken at that step's `step_done`. A request that
arrives between an `optimizer.step()` and its `step_done` waits for the `step_done`, and
fails after `emergency_checkpoint_timeout_s` rather than save half a step.
"""

from __future__ import annotations

import logging
import threading
import time

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import format as fmt
from training.checkpoint.saver import SaveJob, Saver
from training.checkpoint.settings import CheckpointSettings
from training.checkpoint.state import Snapshot, StagingBuffers, TrainingState
from training.checkpoint.tiers import Tiers
from training.errors import TrainingError
from training.worker_client import WorkerClient

log = logging.getLogger("training.checkpoint.checkpointer")


#: Beyond `emergency_checkpoint_timeout_s`, what a process that is ending waits for a save
#: in flight to be acked to its host monitor.
ACK_MARGIN_S = 10.0


class EmergencyCheckpointError(TrainingError, RuntimeError):
    """An emergency save could not be made (the message says why)."""


class StepGate:
    """Between an `optimizer.step()` and its `step_done` the state is half a step: an
    emergency save waits for the step to complete, and the next update waits while an
    emergency save reads the live parameters."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.mid_step = False  # an optimizer.step() ran and its step_done has not
        self.holder: int | None = None  # the thread of the emergency save reading the state
        self.completed: Snapshot | None = None  # the last completed step
        #: The process is ending (its training loop raised): a step in flight never ends.
        self._loop_ended = False

    def held_here(self) -> bool:
        """This thread is the emergency save's (DCP's lazy optimizer init steps it)."""
        return self.holder == threading.get_ident()

    def update_starts(self) -> None:
        """The parameters are about to change: wait while an emergency save reads them."""
        with self._cond:
            self._cond.wait_for(lambda: self.holder is None)
            self.mid_step = True

    def step_completed(self, snapshot: Snapshot) -> None:
        with self._cond:
            self.completed = snapshot
            self.mid_step = False
            self._cond.notify_all()

    def reset(self) -> None:
        """New objects are saved from now on: nothing to rewind to (`Checkpointer.rebind`)."""
        with self._cond:
            self._cond.wait_for(lambda: self.holder is None)
            self.completed = None
            self.mid_step = False

    def training_ended(self) -> None:
        with self._cond:
            self._loop_ended = True
            self._cond.notify_all()

    def hold(self, timeout_s: float, limit_s: float) -> Snapshot:
        """Wait for the step in flight to complete and hold the state for a save; the
        last completed step. `limit_s`: the setting the timeout came from (its error)."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self.holder is None and (self._loop_ended or not self.mid_step),
                timeout=max(0.0, timeout_s),
            ):
                raise EmergencyCheckpointError(
                    "the step in flight did not finish its optimizer step within "
                    f"{limit_s:g}s: not saving half a step"
                )
            if self.mid_step:  # woken by the loop's end
                raise EmergencyCheckpointError(
                    "the training loop ended between an optimizer.step() and its "
                    "step_done: not saving half a step"
                )
            snapshot = self.completed
            if snapshot is None:
                raise EmergencyCheckpointError("no completed step yet (restore has not finished)")
            self.holder = threading.get_ident()
            return snapshot

    def release(self) -> None:
        with self._cond:
            self.holder = None
            self._cond.notify_all()


class EmergencySaver:
    """Saves the last completed step on the host monitor's request."""

    def __init__(
        self,
        *,
        settings: CheckpointSettings,
        rank: int,
        state: TrainingState,
        tiers: Tiers,
        saver: Saver,
        gate: StepGate,
        client: WorkerClient | None,
        enabled: bool,
    ) -> None:
        """`state`: what is saved (`Checkpointer.rebind` replaces it)."""
        self.settings = settings
        self.rank = rank
        self.state = state
        self.tiers = tiers
        self.saver = saver
        self.gate = gate
        self.client = client
        self.enabled = enabled

    def save(self) -> int:
        """Save the last completed step now, to every tier; returns the step (see
        `Checkpointer.emergency_save`)."""
        if not self.enabled:
            raise EmergencyCheckpointError("emergency checkpoints are off for this Checkpointer")
        started = time.monotonic()
        limit = self.settings.emergency_checkpoint_timeout_s
        deadline = started + limit
        snapshot = self.gate.hold(deadline - time.monotonic(), limit)
        try:
            self._write(snapshot, started, deadline)
        finally:
            self.gate.release()
        log.warning(
            "checkpoint: emergency checkpoint of step %d saved in %.3fs",
            snapshot.step,
            time.monotonic() - started,
        )
        return snapshot.step

    def _write(self, snapshot: Snapshot, started: float, deadline: float) -> None:
        step = snapshot.step
        # A periodic save being written holds the staging buffers, and may be this step's.
        if not self.saver.wait(max(0.0, deadline - time.monotonic())):
            raise EmergencyCheckpointError("a periodic save still being written took too long")
        tiers = self.tiers.stored
        if not tiers:
            raise EmergencyCheckpointError("no tier to save to (RAM and durable are both off)")
        holding = [tier for tier in tiers if step in tier.steps(self.rank)]
        if holding:
            # Committed already: the first tier that holds it is the source of the copies
            # to the later tiers that lack it (a local one only: a bucket's is not copied).
            source_tier = holding[0]
            manifest = source_tier.manifest(step, self.rank)
            if source_tier.root is not None:
                source = fmt.rank_dir(source_tier.root, step, self.rank)
                for tier in tiers[tiers.index(source_tier) + 1 :]:
                    if tier not in holding:
                        error = self.saver.copy_emergency(tier, step, source, manifest)
                        if error is not None:
                            raise EmergencyCheckpointError(
                                f"{tier.kind} copy of step {step}: {error}"
                            )
            self._report(step, manifest.total_bytes, started)
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
        kinds = tuple(tier.kind for tier in tiers)
        job = SaveJob(step, state, kinds, 0.0, started, emergency=True)
        self.saver.submit(job, background=False)
        failed = [r for r in self.saver.results[-len(kinds) :] if r.step == step and r.error]
        if failed:
            raise EmergencyCheckpointError(f"writing step {step} failed: {failed[-1].error}")

    def _report(self, step: int, size: int, started: float) -> None:
        if self.client is not None:
            seconds = time.monotonic() - started
            self.client.report_checkpoint_saved(
                step, seconds, Tier.EMERGENCY, size_bytes=size, total_s=seconds
            )
