"""`Checkpointer`: checkpoint tiers for a plain PyTorch loop in a few lines.

    ckpt = Checkpointer(model, optimizer, lr_scheduler=scheduler, extra={"data": sampler})
    start = ckpt.restore()                 # after init_process_group, before the loop
    for step in range(start + 1, total_steps + 1):
        train_one_step(step)
        ckpt.step_done(step)               # saves when a tier is due; returns at once
    ckpt.close()                           # waits for the save in flight

Tiers, fastest first: RAM (a tmpfs directory on the node, every
`in_memory_checkpointing_freq` steps), peer (the partner node's host monitor holds a copy
of this node's newest RAM checkpoint), durable (every `s3_checkpointing_freq` steps).

`restore()` makes the ranks agree on the newest step for which every rank can load its
shard from some tier, then each rank loads from the fastest source that has it (own RAM,
then the partner's copy fetched into RAM, then durable), verifying checksums first; a
source that fails verification is skipped, and a step some rank cannot load at all is
dropped and the agreement runs again. Each save and load is reported to the node's host
monitor (step, tier, bytes, seconds blocking, seconds in all) when one is configured.

Emergency checkpoints: given an online worker client, the Checkpointer serves the host
monitor's requests from the client's own thread (`WorkerClient.serve_emergency_
checkpoints`), so a rank saves while its main thread is blocked in a collective whose
peer is gone or frozen, and after that collective raised. `emergency_save` writes the
state at the end of the last completed step and needs no collective: the parameters and
optimizer state are read live (only `optimizer.step()` changes them, and it waits while
the save reads them), the rest (RNG, scheduler, the user's objects, model buffers) comes
from a copy taken at that step's `step_done`. A request that arrives between an
`optimizer.step()` and its `step_done` waits for the `step_done`, and fails after
`emergency_checkpoint_timeout_s` rather than save half a step.

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
from torch.nn.parallel import DistributedDataParallel

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import durable as durable_tier
from training.checkpoint import format as fmt
from training.checkpoint.agreement import MAX_RESTORE_ROUNDS, RestoreAgreement, Restored
from training.checkpoint.emergency import ACK_MARGIN_S, EmergencyCheckpointError, EmergencySaves
from training.checkpoint.peer import PeerTier
from training.checkpoint.restorer import Restorer
from training.checkpoint.saver import SaveJob, Saver, SaveResult
from training.checkpoint.schedule import SaveSchedule
from training.checkpoint.settings import CheckpointSettings
from training.checkpoint.state import (
    Snapshot,
    StagingBuffers,
    Stateful,
    TrainingState,
    local_data_ptr,
)
from training.checkpoint.world_fence import WorldFence
from training.errors import TrainingError
from training.worker_client import WorkerClient

log = logging.getLogger(__name__)

__all__ = [
    "MAX_RESTORE_ROUNDS",
    "CheckpointSavesFailing",
    "Checkpointer",
    "EmergencyCheckpointError",
    "Restored",
]


class CheckpointSavesFailing(TrainingError, RuntimeError):
    """`max_consecutive_save_failures` saves in a row failed: the job is no longer
    protected by its checkpoints (the message names the last failure)."""


class Checkpointer(EmergencySaves, RestoreAgreement):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lr_scheduler: Any | None = None,
        extra: Mapping[str, Stateful] | None = None,
        settings: CheckpointSettings | None = None,
        client: WorkerClient | None = None,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        peer: PeerTier | None = None,
        replicated: bool | None = None,
        emergency: bool | None = None,
        hook_optimizer: bool = True,
    ) -> None:
        """`replicated`: every rank holds the same state (default: the model is a DDP
        model); `emergency`: serve the host monitor's emergency checkpoint requests
        (default: when `client` is online; needs the optimizer, and the call from the
        main thread, after `client.register()`); `hook_optimizer`: mark the start of each
        parameter update with a pre-hook on `optimizer.step()`. Pass False where
        `optimizer.step()` runs the forward and backward itself, in a closure (Lightning's
        automatic optimization), and call `optimizer_step_starts()` right before the
        update instead: the pre-hook would hold emergency saves during the backward."""
        self.settings = settings if settings is not None else CheckpointSettings.from_env()
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = (
            world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        )
        self.job = job if job is not None else (client.job if client is not None else None)
        self.client = client
        self.state = TrainingState(model, optimizer, lr_scheduler=lr_scheduler, extra=extra)
        self.replicated = (
            replicated if replicated is not None else isinstance(model, DistributedDataParallel)
        )
        s = self.settings
        self.ram_root: Path | None = (
            s.ram_root(self.job) if s.in_memory_checkpointing_freq else None
        )
        #: The durable tier (a directory or a bucket: durable.py); its directory, if one.
        self.durable: durable_tier.DurableStore | None = (
            durable_tier.open_store(s, scratch=self._scratch())
            if s.s3_checkpointing_freq or s.multi_tier_checkpointing_backup_interval_minutes
            else None
        )
        # One copy of a replicated model is enough in the durable tier: rank 0's.
        self._schedule = SaveSchedule(s, writes_durable=not (self.replicated and self.rank != 0))
        self.durable_root: Path | None = self.durable.root if self.durable else None
        if peer is None:
            peer = PeerTier.from_env(self.rank)
        self.peer = peer
        self._buffers = StagingBuffers()
        attempt = (lambda: client.attempt) if client is not None else None
        self._fence = WorldFence(
            rank=self.rank, ram_root=self.ram_root, durable=self.durable, attempt=attempt
        )
        self._saver = Saver(
            fence=self._fence,
            rank=self.rank,
            world_size=self.world_size,
            job=self.job,
            ram_root=self.ram_root,
            durable=self.durable,
            threads=s.ckpt_threads_per_rank,
            ram_keep=s.ram_topk_ckpt,
            durable_keep=s.topk_ckpt,
            sync_files=s.sync_files,
            on_committed=self._on_committed,
            on_failed=self._on_failed,
            replicated=self.replicated,
            lease=client.check_lease if client is not None else None,
        )
        #: Saves failed per tier since that tier's last commit, and the newest failure.
        self._failures: dict[str, int] = {}
        self.last_failure: SaveResult | None = None
        self._restorer = Restorer(
            self.state,
            s,
            rank=self.rank,
            replicated=self.replicated,
            ram_root=self.ram_root,
            durable=self.durable,
            peer=self.peer,
            on_state_changing=self._loading,
        )
        self.last_restore: Restored | None = None
        self._fresh_optimizer = False
        self._state_loaded = False  # the restore under way has loaded a step into the state
        #: Seconds the loop was blocked by each save, in order (for benchmarks and tests).
        self.blocking: list[float] = []
        # Staging during the next step: set once the deferred copy is done.
        self._staged = threading.Event()
        self._staged.set()
        self._staging_job: SaveJob | None = None
        self._staging_lock = threading.Lock()
        self._stage_in_next_step = (
            optimizer is not None and s.stage_during_next_step and s.enable_async_ckpt
        )
        # Emergency saves: the step gate between `optimizer.step()` and `step_done`.
        self.emergency = (
            emergency if emergency is not None else (client is not None and client.online)
        )
        if self.emergency and optimizer is None:
            raise ValueError("emergency checkpoints need the optimizer (its steps are gated)")
        self._gate = threading.Condition()
        self._mid_step = False  # an optimizer.step() ran and its step_done has not
        self._holder: int | None = None  # the thread of the emergency save reading the state
        self._completed: Snapshot | None = None  # the last completed step
        self._hook: Any = None
        self._hook_optimizer = hook_optimizer
        self._hook_into(optimizer)
        if self.ram_root is not None:
            self.ram_root.mkdir(parents=True, exist_ok=True)
            fmt.remove_temporaries(self.ram_root, self.rank)
        if self.durable is not None:
            try:
                self.durable.remove_temporaries(self.rank)
            except OSError as exc:  # a durable tier that is down fails its saves, reported
                log.warning("checkpoint: durable tier %s: %r", self.durable.url, exc)
        if self.emergency and client is not None:
            wait_s = s.emergency_checkpoint_timeout_s + ACK_MARGIN_S
            client.serve_emergency_checkpoints(
                self.emergency_save, on_exit=self.training_ended, exit_wait_s=wait_s
            )

    def _scratch(self) -> Path | None:
        """Local space for a bucket's saves without a RAM tier and for restores from it:
        beside the RAM tier when there is one (tmpfs), else the system's temporary one."""
        return self.ram_root.parent / f".durable-{self.ram_root.name}" if self.ram_root else None

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
        with self._gate:
            self._gate.wait_for(lambda: self._holder is None)
            self.state = TrainingState(
                model, optimizer, lr_scheduler=lr_scheduler, extra=self.state.extra
            )
            self._restorer.state = self.state
            self._completed = None  # the old objects' step: nothing to rewind to
            self._mid_step = False
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
        snapshot = self.state.snapshot(step)
        with self._gate:
            self._completed = snapshot
            self._mid_step = False
            self._gate.notify_all()

    def save(self, step: int, *, to_ram: bool = True, to_durable: bool = False) -> float:
        """Save the current state as `step`; returns the seconds the caller was blocked.

        Asynchronous unless `enable_async_ckpt` is off: this returns once the state is
        copied to host memory, and the write goes on in the background.
        """
        to_ram = to_ram and self.ram_root is not None
        to_durable = to_durable and self.durable is not None
        if not (to_ram or to_durable):
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
        job = SaveJob(step, staged, to_ram, to_durable, blocking, started, finish)
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
            self._staged.set()

    def optimizer_step_starts(self) -> None:
        """The parameters and optimizer state are about to change (see `hook_optimizer`):
        waits while an emergency save reads them, and for the previous save's copy of
        them to host memory."""
        self._before_optimizer_step()

    def _before_optimizer_step(self, *_: Any) -> None:
        if self.emergency:
            if self._holder == threading.get_ident():
                return  # the emergency save's own state_dict (DCP's lazy optimizer init)
            with self._gate:
                self._gate.wait_for(lambda: self._holder is None)
                self._mid_step = True
        if self._staged.is_set():
            return
        started = time.monotonic()
        self._staged.wait()
        waited = time.monotonic() - started
        with self._staging_lock:
            job = self._staging_job
            if job is not None:
                job.blocking_s += waited
                self.blocking[-1] += waited

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
            tier = (
                Tier.EMERGENCY
                if result.emergency
                else Tier.RAM
                if result.tier == Tier.RAM
                else Tier.DURABLE
            )
            self.client.report_checkpoint_failed(
                result.step,
                tier,
                result.error or "unknown error",
                total_s=result.total_s,
            )

    def _on_committed(self, result: SaveResult) -> None:
        self._failures.pop(result.tier, None)
        if result.tier == Tier.RAM and result.path is not None and self.settings.enable_peer_ckpt:
            self.peer.replicate(result.step, result.path)
        if self.client is not None:
            first = result.tier == Tier.RAM or self.ram_root is None
            emergency = result.emergency and first
            self.client.report_checkpoint_saved(
                result.step,
                result.total_s if emergency else result.blocking_s,
                Tier.EMERGENCY
                if emergency
                else (Tier.RAM if result.tier == Tier.RAM else Tier.DURABLE),
                size_bytes=result.size,
                total_s=result.total_s,
            )

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
            self.world_size = self._saver.world_size = dist.get_world_size()
        # Reading a state dict makes a fresh optimizer's state (DCP's helper steps it
        # with no gradient), and listing a sharded state's candidates reads one: if
        # nothing is loaded after all, it must be fresh again (Adam's step count).
        optimizer = self.state.optimizer
        self._fresh_optimizer = optimizer is not None and not optimizer.state
        self._fence.entered()
        self._restorer.starts = self._agreed_starts()
        self._fence.adopt(self._restorer.starts)
        self._fence.fence(self.rank, self.world_size)  # before anything is listed
        self._restorer.begin()
        candidates = self._restorer.candidates()
        # Not when the failure came inside an optimizer step: half of it may be applied.
        # Nor for a gathered state (FSDP1), whose load every rank applies together.
        held = self._completed if in_memory and not self._mid_step else None
        if self.state.gathered:
            held = None
        try:
            step = self._agree_and_load(candidates, held, started)
            self._fence.record(step)  # before any commit of this world
            return step
        except RuntimeError:
            # A collective failed (another fault): what this rank holds may now be a
            # loaded step rather than its last completed one, so a later in-memory
            # restore must not offer the latter.
            if self._state_loaded:
                self._completed = None
            raise
        finally:
            self._restorer.end()
            if self.durable is not None:
                self.durable.clear_staged()  # what a bucket's restore downloaded

    def _loading(self) -> None:
        self._state_loaded = True  # from here the live tensors may change

    # --- shutdown ---------------------------------------------------------------------

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight, then release the peer client and the optimizer
        hook."""
        if self.client is not None:
            self.client.finishing()
        self._saver.wait(timeout_s)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.peer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
