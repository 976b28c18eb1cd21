"""`Checkpointer`: checkpoint tiers for a plain PyTorch loop in a few lines.

    ckpt = Checkpointer(model, optimizer, lr_scheduler=scheduler, extra={"data": sampler})
    start = ckpt.restore()                 # after init_process_group, before the loop
    for step in range(start + 1, total_steps + 1):
        train_one_step(step)
        ckpt.step_done(step)               # saves when a tier is due; returns at once
    ckpt.close()                           # waits for the save in flight

Tiers, fastest first (tiers.py): RAM (a tmpfs directory on the node, every
`in_memory_checkpointing_freq` steps), peer (the partner node's host monitor holds a copy
of this node's newest RAM checkpoint), durable (every `s3_checkpointing_freq` steps).
The Checkpointer is a façade over its collaborators: the `Saver` (saver.py), the
`Restorer` and the ranks' `RestoreAgreement` (restorer.py, agreement.py), the
`EmergencySaver` and its `StepGate` (emergency.py), and the `WorldFence` (world_fence.py).
It takes a few objects: the settings, the tiers (`Tiers.open(settings, ...)` by default),
the worker client, and `CheckpointerOptions` (or the same options one keyword each).

`restore()` makes the ranks agree on the newest step for which every rank can load its
shard from some tier, then each rank loads from the fastest source that has it (own RAM,
then the partner's copy fetched into RAM, then durable), verifying checksums first; a
source that fails verification is skipped, and a step some rank cannot load at all is
dropped and the agreement runs again. Each save and load is reported to the node's host
monitor (step, tier, bytes, seconds blocking, seconds in all) when one is configured.

Emergency checkpoints: given an online worker client, the Checkpointer serves the host
monitor's requests from the client's own thread, and saves the state at the end of the
last completed step without a collective (emergency.py says how).

Replicated state (DDP: every rank holds the same model, optimizer and RNG): any rank's
checkpoint restores any rank. Periodic durable saves are then written by rank 0 only,
and a rank that has no checkpoint of its own at a step (a replacement node, a rank that
crashed before the survivors' emergency checkpoint, a rank torchrun moved to another node)
loads another rank's copy, durable or in this node's RAM.

In-process restarts: `restore(in_memory=True)` after joining a new process group lets a
rank that still holds its last completed step keep it (tier `memory`: RNG, scheduler,
the user's objects and buffers are rewound to that step's `step_done` snapshot) when the
ranks agree on that step.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import Unpack

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint.agreement import MAX_RESTORE_ROUNDS, RestoreAgreement, Restored
from training.checkpoint.durable import DurableStore
from training.checkpoint.emergency import (
    ACK_MARGIN_S,
    EmergencyCheckpointError,
    EmergencySaver,
    StepGate,
)
from training.checkpoint.options import CheckpointerOptions, OptionKeywords, from_keywords
from training.checkpoint.peer import PeerTier
from training.checkpoint.restorer import Restorer
from training.checkpoint.saver import SaveJob, Saver, SaveResult
from training.checkpoint.schedule import SaveSchedule
from training.checkpoint.settings import CheckpointSettings
from training.checkpoint.state import StagingBuffers, Stateful, TrainingState, local_data_ptr
from training.checkpoint.tiers import DurableTier, Tiers
from training.checkpoint.world_fence import WorldFence
from training.errors import TrainingError
from training.worker_client import WorkerClient

log = logging.getLogger(__name__)

__all__ = [
    "MAX_RESTORE_ROUNDS",
    "CheckpointSavesFailing",
    "Checkpointer",
    "CheckpointerOptions",
    "EmergencyCheckpointError",
    "Restored",
]


class CheckpointSavesFailing(TrainingError, RuntimeError):
    """`max_consecutive_save_failures` saves in a row failed: the job is no longer
    protected by its checkpoints (the message names the last failure)."""


class Checkpointer:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lr_scheduler: Any | None = None,
        extra: Mapping[str, Stateful] | None = None,
        settings: CheckpointSettings | None = None,
        tiers: Tiers | None = None,
        client: WorkerClient | None = None,
        options: CheckpointerOptions | None = None,
        **keywords: Unpack[OptionKeywords],
    ) -> None:
        """Saves and restores `model`, `optimizer`, `lr_scheduler` and the user's `extra`
        objects. `settings`: default `CheckpointSettings.from_env()`; `tiers`: default
        those the settings turn on (`Tiers.open`); `client`: the worker client reports go
        through; `options` (CheckpointerOptions), or the same one keyword each
        (`rank=`, `job=`, `replicated=`, `emergency=`, `hook_optimizer=`...)."""
        options, peer = from_keywords(options, keywords)
        self.settings = s = settings if settings is not None else CheckpointSettings.from_env()
        placed = options.resolve(model, client)
        self.rank, self.world_size, self.job = placed.rank, placed.world_size, placed.job
        self.replicated, self.emergency = placed.replicated, placed.emergency
        self.client = client
        self.state = TrainingState(model, optimizer, lr_scheduler=lr_scheduler, extra=extra)
        if tiers is not None and peer is not None:
            raise TypeError("Checkpointer(): `peer` is a part of `tiers`: give one of them")
        if tiers is None:
            tiers = Tiers.open(s, rank=self.rank, job=self.job, peer=peer)
        self.tiers = tiers
        # One copy of a replicated model is enough in the durable tier: rank 0's.
        self._schedule = SaveSchedule(s, writes_durable=not (self.replicated and self.rank != 0))
        self._buffers = StagingBuffers()
        attempt = (lambda: client.attempt) if client is not None else None
        self._fence = WorldFence(rank=self.rank, tiers=self.tiers, attempt=attempt)
        self._saver = Saver(
            fence=self._fence,
            rank=self.rank,
            world_size=self.world_size,
            job=self.job,
            tiers=self.tiers,
            threads=s.ckpt_threads_per_rank,
            sync_files=s.sync_files,
            on_committed=self._on_committed,
            on_failed=self._on_failed,
            replicated=self.replicated,
            lease=client.check_lease if client is not None else None,
        )
        #: Saves failed per tier since that tier's last commit, and the newest failure.
        self._failures: dict[Tier, int] = {}
        self.last_failure: SaveResult | None = None
        self._restorer = Restorer(
            self.state,
            s,
            rank=self.rank,
            replicated=self.replicated,
            tiers=self.tiers,
            on_state_changing=self._loading,
        )
        self._agreement = RestoreAgreement(
            rank=self.rank,
            world_size=self.world_size,
            state=self.state,
            restorer=self._restorer,
            fence=self._fence,
            client=client,
            on_step_completed=self._step_completed,
        )
        #: Seconds the loop was blocked by each save, in order (for benchmarks and tests).
        self.blocking: list[float] = []
        # Staging during the next step: set once the deferred copy is done.
        self._staged = threading.Event()
        self._staged.set()
        self._staging_job: SaveJob | None = None
        self._wait_started: float | None = None  # the loop waits for the copy since then
        self._staging_lock = threading.Lock()
        self._stage_in_next_step = (
            optimizer is not None and s.stage_during_next_step and s.enable_async_ckpt
        )
        # Emergency saves: the step gate between `optimizer.step()` and `step_done`.
        if self.emergency and optimizer is None:
            raise ValueError("emergency checkpoints need the optimizer (its steps are gated)")
        self._gate = StepGate()
        self._emergency = EmergencySaver(
            settings=s,
            rank=self.rank,
            state=self.state,
            tiers=self.tiers,
            saver=self._saver,
            gate=self._gate,
            client=client,
            enabled=self.emergency,
        )
        self._hook: Any = None
        self._hook_optimizer = options.hook_optimizer
        self._hook_into(optimizer)
        for tier in self.tiers.stored:
            tier.prepare(self.rank)
        if self.emergency and client is not None:
            wait_s = s.emergency_checkpoint_timeout_s + ACK_MARGIN_S
            client.serve_emergency_checkpoints(
                self.emergency_save, on_exit=self.training_ended, exit_wait_s=wait_s
            )

    # --- the tiers, by their former names ----------------------------------------------

    @property
    def ram_root(self) -> Path | None:
        """The RAM tier's directory; None when it is off."""
        ram = self.tiers.stored_of(Tier.RAM)
        return ram.root if ram is not None else None

    @property
    def durable(self) -> DurableStore | None:
        """The durable tier's store (durable.py); None when it is off."""
        tier = self.tiers.get(Tier.DURABLE)
        return tier.store if isinstance(tier, DurableTier) else None

    @property
    def durable_root(self) -> Path | None:
        """The durable tier's directory; None for a bucket, or when it is off."""
        return self.durable.root if self.durable is not None else None

    @property
    def peer(self) -> PeerTier | None:
        """The host monitor's client for the partner's copy."""
        return self.tiers.peer

    @property
    def last_restore(self) -> Restored | None:
        """What the last `restore()` did on this rank."""
        return self._agreement.last_restore

    def _hook_into(self, optimizer: torch.optim.Optimizer | None) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        marked = self._stage_in_next_step or self.emergency
        if self._hook_optimizer and optimizer is not None and marked:
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._marks_updates = self._hook is not None or not self._hook_optimizer

    def rebind(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lr_scheduler: Any | None = None,
    ) -> None:
        """Save and restore these objects from now on, in place of those given before:
        a sharded model is built and wrapped again for each new world (an in-process
        restart: its DTensors belong to the old world's mesh). Then call `restore()`,
        which loads the agreed step into them (this process's RAM tier holds the step
        its emergency checkpoint saved). Waits for the save in flight first."""
        self._saver.wait()
        self._gate.reset()  # the old objects' step: nothing to rewind to
        self.state = TrainingState(
            model, optimizer, lr_scheduler=lr_scheduler, extra=self.state.extra
        )
        self._restorer.state = self._agreement.state = self._emergency.state = self.state
        self._buffers = StagingBuffers()
        self._hook_into(optimizer)

    # --- saving -----------------------------------------------------------------------

    def due(self, step: int) -> tuple[bool, bool]:
        """(RAM due, durable due) at `step`."""
        return self._schedule.due(step)

    def step_done(self, step: int) -> bool:
        """Call after each completed step (optimizer stepped); saves when a tier is due.

        Raises CheckpointSavesFailing once `max_consecutive_save_failures` saves in a row
        have failed (each was reported when it failed): training on would go on with
        nothing to resume from."""
        self._check_failures()
        to_ram, to_durable = self.due(step)
        due = to_ram or to_durable
        if due:
            self.save(step, to_ram=to_ram, to_durable=to_durable)
        self._step_completed(step)
        return due

    @property
    def consecutive_failures(self) -> int:
        """The most saves failed in a row in one tier (RAM or durable)."""
        return max(self._failures.values(), default=0)

    def _check_failures(self) -> None:
        limit = self.settings.max_consecutive_save_failures
        failed = self.last_failure
        if limit and self.consecutive_failures >= limit and failed is not None:
            if self.client is not None:
                self.client.flush()  # the failures' reports reach the supervisor first
            raise CheckpointSavesFailing(
                f"{self.consecutive_failures} checkpoint saves in a row to the "
                f"{failed.tier} tier failed "
                f"(max_consecutive_save_failures={limit}); the last, of step {failed.step}: "
                f"{failed.error}"
            )

    def _step_completed(self, step: int) -> None:
        if not self.emergency:
            return
        self._gate.step_completed(self.state.snapshot(step))

    def save(self, step: int, *, to_ram: bool = True, to_durable: bool = False) -> float:
        """Save the current state as `step`; returns the seconds the caller was blocked.

        Asynchronous unless `enable_async_ckpt` is off: this returns once the state is
        copied to host memory, and the write goes on in the background.
        """
        wanted = {Tier.RAM: to_ram, Tier.DURABLE: to_durable}
        kinds = tuple(tier.kind for tier in self.tiers.stored if wanted.get(tier.kind))
        if not kinds:
            return 0.0
        started = time.monotonic()
        if self._saver.busy:
            log.info("checkpoint: step %d waits for the previous save to be written", step)
            self._saver.wait_for_save()  # not for its durable copy (saver.py)
        state = self.state.state_dict(step)
        background = self.settings.enable_async_ckpt
        finish: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        if background and self._marks_updates and self._stage_in_next_step:
            # Parameters and optimizer state change only in optimizer.step(): they are
            # copied in the save's thread while the next step's forward and backward run,
            # and the next optimizer.step() waits for that copy (`_before_optimizer_step`).
            # Everything else (buffers, RNG, scheduler, data position) is copied now.
            params = {local_data_ptr(p) for p in self.state.model.parameters()}

            def deferred(path: str, tensor: torch.Tensor) -> bool:
                return path.startswith("/optim/") or local_data_ptr(tensor) in params

            staged = self._buffers.stage(state, defer=deferred)
            self._staged.clear()
            # The save's thread copies them once this step's update has run on the GPU.
            finish = functools.partial(self._finish_staging, ready=self.state.gpu_ready_event())
        else:
            staged = self._buffers.stage(state)
        blocking = time.monotonic() - started
        job = SaveJob(step, staged, kinds, blocking, started, finish)
        with self._staging_lock:
            self._staging_job = job if finish is not None else None
        self.blocking.append(blocking)
        self._saver.submit(job, background=background)
        if not background:
            blocking = time.monotonic() - started
            self.blocking[-1] = blocking
        return blocking

    def _finish_staging(
        self, state: dict[str, Any], ready: torch.cuda.Event | None
    ) -> dict[str, Any]:
        try:
            return self._buffers.stage(state, after=ready)
        finally:
            self._count_wait()  # before this save's thread reports it (the loop wakes later)
            self._staged.set()

    def _count_wait(self) -> None:  # the loop's wait for the copy, once, as the save's
        with self._staging_lock:
            started, self._wait_started = self._wait_started, None
            if started is not None and (job := self._staging_job) is not None:
                waited = time.monotonic() - started
                job.blocking_s += waited
                self.blocking[-1] += waited

    def optimizer_step_starts(self) -> None:
        """The parameters and optimizer state are about to change (see `hook_optimizer`):
        waits while an emergency save reads them, and for the previous save's copy of
        them to host memory."""
        self._before_optimizer_step()

    def _before_optimizer_step(self, *_: Any) -> None:
        if self.emergency:
            if self._gate.held_here():
                return  # the emergency save's own state_dict (DCP's lazy optimizer init)
            self._gate.update_starts()
        if self._staged.is_set():
            return
        with self._staging_lock:
            self._wait_started = time.monotonic()
        self._staged.wait()
        self._count_wait()  # mostly counted already, where the copy ended

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the save in flight is committed (or failed); False on timeout."""
        return self._saver.wait(timeout_s)

    @property
    def save_results(self) -> list[SaveResult]:
        return self._saver.results

    def _on_failed(self, result: SaveResult) -> None:
        if not result.skipped:  # a durable copy skipped behind a slow upload failed nothing
            self._failures[result.tier] = self._failures.get(result.tier, 0) + 1
            self.last_failure = result
        if self.client is not None:
            self.client.report_checkpoint_failed(
                result.step,
                Tier.EMERGENCY if result.emergency else result.tier,
                result.error or "unknown error",
                total_s=result.total_s,
            )

    def _on_committed(self, result: SaveResult) -> None:
        self._failures.pop(result.tier, None)
        if self.client is not None:
            emergency = result.emergency and result.first
            self.client.report_checkpoint_saved(
                result.step,
                result.total_s if emergency else result.blocking_s,
                Tier.EMERGENCY if emergency else result.tier,
                size_bytes=result.size,
                total_s=result.total_s,
            )

    # --- emergency saves --------------------------------------------------------------

    def emergency_save(self) -> int:
        """Save the last completed step now, to every tier; returns the step.

        Callable from any thread, while the main thread trains, waits in a collective, or
        after that collective raised; needs no collective. Raises EmergencyCheckpointError
        when no step is complete yet, or when the step in flight does not reach its
        `step_done` within `emergency_checkpoint_timeout_s`.
        """
        return self._emergency.save()

    def training_ended(self) -> None:
        """The training loop will take no more steps (the process is ending): a request
        waiting for the step in flight's `step_done` fails now instead of at its timeout."""
        self._gate.training_ended()

    # --- restoring --------------------------------------------------------------------

    def restore(self, *, in_memory: bool = False) -> int:
        """Load the newest step every rank can load; the step to continue after (0: none).

        Collective when torch.distributed is initialized: every rank must call it.
        `in_memory`: this process still holds the state of its last completed step (it
        stays after its process group failed, an in-process restart): that step needs no
        load here, if the ranks agree on it (tier `memory`).
        """
        started = time.monotonic()
        if dist.is_available() and dist.is_initialized():
            if dist.get_rank() != self.rank:
                raise RuntimeError(
                    f"this Checkpointer is rank {self.rank}'s; the process group says "
                    f"rank {dist.get_rank()}"
                )
            self.world_size = dist.get_world_size()
            self._saver.world_size = self._agreement.world_size = self.world_size
        # Reading a state dict makes a fresh optimizer's state (DCP's helper steps it
        # with no gradient), and listing a sharded state's candidates reads one: if
        # nothing is loaded after all, it must be fresh again (Adam's step count).
        optimizer = self.state.optimizer
        self._agreement.fresh_optimizer = optimizer is not None and not optimizer.state
        self._fence.entered()
        self._restorer.starts = self._agreement.agreed_starts()
        self._fence.adopt(self._restorer.starts)
        self._fence.fence(self.rank, self.world_size)  # before anything is listed
        self._restorer.begin()
        candidates = self._restorer.candidates()
        # Not when the failure came inside an optimizer step: half of it may be applied.
        # Nor for a gathered state (FSDP1), whose load every rank applies together.
        held = self._gate.completed if in_memory and not self._gate.mid_step else None
        if self.state.gathered:
            held = None
        try:
            step = self._agreement.agree_and_load(candidates, held, started)
            self._fence.record(step)  # before any commit of this world
            return step
        except RuntimeError:
            # A collective failed (another fault): what this rank holds may now be a
            # loaded step rather than its last completed one, so a later in-memory
            # restore must not offer the latter.
            if self._agreement.state_loaded:
                self._gate.completed = None
            raise
        finally:
            self._restorer.end()
            for tier in self.tiers.stored:
                tier.clear_staged()  # what a bucket's restore downloaded

    def _loading(self) -> None:
        self._agreement.loading()

    # --- shutdown ---------------------------------------------------------------------

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight, then release the tiers' clients and the optimizer
        hook."""
        if self.client is not None:
            self.client.finishing()
        self._saver.wait(timeout_s)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.tiers.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
