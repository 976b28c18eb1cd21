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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from training.checkpoint import format as fmt
from training.checkpoint.peer import PeerTier
from training.checkpoint.reader import DirectReader
from training.checkpoint.saver import SaveJob, Saver, SaveResult
from training.checkpoint.settings import CheckpointSettings
from training.checkpoint.state import StagingBuffers, Stateful, TrainingState
from training.worker_client import WorkerClient

log = logging.getLogger(__name__)

Source = Literal["ram", "peer", "durable"]

#: Restore rounds before giving up on agreeing (each drops steps some rank cannot load).
MAX_RESTORE_ROUNDS = 16


@dataclass(frozen=True)
class Restored:
    """What `restore()` did on this rank."""

    step: int  # 0: nothing to restore, start fresh
    tier: Source | None  # "ram", "peer" or "durable"; None when starting fresh
    size: int
    seconds: float


class Checkpointer:
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
    ) -> None:
        self.settings = settings if settings is not None else CheckpointSettings.from_env()
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = (
            world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        )
        self.job = job if job is not None else (client.job if client is not None else None)
        self.client = client
        self.state = TrainingState(model, optimizer, lr_scheduler=lr_scheduler, extra=extra)
        s = self.settings
        self.ram_root: Path | None = (
            s.ram_root(self.job) if s.in_memory_checkpointing_freq else None
        )
        self.durable_root: Path | None = s.durable_root() if s.s3_checkpointing_freq else None
        if peer is None:
            peer = PeerTier.from_env(self.rank)
        self.peer = peer
        self._buffers = StagingBuffers()
        self._saver = Saver(
            rank=self.rank,
            world_size=self.world_size,
            job=self.job,
            ram_root=self.ram_root,
            durable_root=self.durable_root,
            threads=s.ckpt_threads_per_rank,
            ram_keep=s.ram_topk_ckpt,
            durable_keep=s.topk_ckpt,
            sync_files=s.sync_files,
            on_committed=self._on_committed,
        )
        self.last_restore: Restored | None = None
        #: Seconds the loop was blocked by each save, in order (for benchmarks and tests).
        self.blocking: list[float] = []
        # Staging during the next step: set once the deferred copy is done.
        self._staged = threading.Event()
        self._staged.set()
        self._staging_job: SaveJob | None = None
        self._staging_lock = threading.Lock()
        self._hook: Any = None
        if optimizer is not None and s.stage_during_next_step and s.enable_async_ckpt:
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        for root in (self.ram_root, self.durable_root):
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
                fmt.remove_temporaries(root, self.rank)

    # --- saving -----------------------------------------------------------------------

    def due(self, step: int) -> tuple[bool, bool]:
        """(RAM due, durable due) at `step`."""
        ram, durable = (
            self.settings.in_memory_checkpointing_freq,
            self.settings.s3_checkpointing_freq,
        )
        return (bool(ram) and step % ram == 0, bool(durable) and step % durable == 0)

    def step_done(self, step: int) -> bool:
        """Call after each completed step (optimizer stepped); saves when a tier is due."""
        to_ram, to_durable = self.due(step)
        if not (to_ram or to_durable):
            return False
        self.save(step, to_ram=to_ram, to_durable=to_durable)
        return True

    def save(self, step: int, *, to_ram: bool = True, to_durable: bool = False) -> float:
        """Save the current state as `step`; returns the seconds the caller was blocked.

        Asynchronous unless `enable_async_ckpt` is off: this returns once the state is
        copied to host memory, and the write goes on in the background.
        """
        to_ram = to_ram and self.ram_root is not None
        to_durable = to_durable and self.durable_root is not None
        if not (to_ram or to_durable):
            return 0.0
        started = time.monotonic()
        if self._saver.busy:
            log.info("checkpoint: step %d waits for the previous save to be written", step)
            self._saver.wait()
        state = self.state.state_dict(step)
        background = self.settings.enable_async_ckpt
        finish = None
        if background and self._hook is not None:
            # Parameters and optimizer state change only in optimizer.step(): they are
            # copied in the save's thread while the next step's forward and backward run,
            # and the next optimizer.step() waits for that copy (`_before_optimizer_step`).
            # Everything else (buffers, RNG, scheduler, data position) is copied now.
            params = {p.data_ptr() for p in self.state.model.parameters()}

            def deferred(path: str, tensor: torch.Tensor) -> bool:
                return path.startswith("/optim/") or tensor.data_ptr() in params

            staged = self._buffers.stage(state, defer=deferred)
            self._staged.clear()
            finish = self._finish_staging
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

    def _finish_staging(self, state: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._buffers.stage(state)
        finally:
            self._staged.set()

    def _before_optimizer_step(self, *_: Any) -> None:
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

    def _on_committed(self, result: SaveResult) -> None:
        if result.tier == "ram" and result.path is not None and self.settings.enable_peer_ckpt:
            self.peer.replicate(result.step, result.path)
        if self.client is not None:
            self.client.report_checkpoint_saved(
                result.step,
                result.blocking_s,
                "ram" if result.tier == "ram" else "durable",
                size_bytes=result.size,
                total_s=result.total_s,
            )

    # --- restoring --------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest step every rank can load; the step to continue after (0: none).

        Collective when torch.distributed is initialized: every rank must call it.
        """
        started = time.monotonic()
        candidates = self._candidates()
        dropped: set[int] = set()
        loaded_before = False  # this rank's tensors hold a step the ranks then dropped
        for _ in range(MAX_RESTORE_ROUNDS):
            mine = sorted(set(candidates) - dropped)
            everyone = self._all_gather(
                {"steps": mine, "world_size": self.world_size, "loaded": loaded_before}
            )
            for rank, theirs in enumerate(everyone):
                if theirs["world_size"] != self.world_size:
                    raise RuntimeError(
                        f"rank {rank} restores with world_size={theirs['world_size']}, "
                        f"this rank with {self.world_size}"
                    )
            common = set(mine)
            for theirs in everyone:
                common &= set(theirs["steps"])
            if not common and any(theirs["loaded"] for theirs in everyone):
                # Starting from step 0 would keep the weights some rank already loaded.
                raise RuntimeError(
                    "no step is left that every rank can load, and some ranks hold a step "
                    "the others could not load: start the job again (it starts fresh)"
                )
            if not common:
                self.last_restore = Restored(0, None, 0, time.monotonic() - started)
                log.info("checkpoint: no step every rank can load; starting from step 0")
                return 0
            step = max(common)
            loaded = self._load(step, candidates[step])
            oks = self._all_gather(loaded is not None)
            if all(oks):
                assert loaded is not None
                tier, size = loaded
                seconds = time.monotonic() - started
                self.last_restore = Restored(step, tier, size, seconds)
                if self.client is not None:
                    self.client.report_checkpoint_loaded(
                        step,
                        seconds,
                        tier,
                        size_bytes=size,
                        total_s=seconds,
                    )
                log.info("checkpoint: restored step %d from %s (%d bytes)", step, tier, size)
                return step
            if loaded is None:
                dropped.add(step)
            else:
                loaded_before = True
        raise RuntimeError(f"no checkpoint could be loaded after {MAX_RESTORE_ROUNDS} rounds")

    def _candidates(self) -> dict[int, list[Source]]:
        """Steps this rank can load, with their sources fastest first (no file read)."""
        out: dict[int, list[Source]] = {}
        tiers: tuple[tuple[Source, Path | None], ...] = (
            ("ram", self.ram_root),
            ("durable", self.durable_root),
        )
        for tier, root in tiers:
            if root is None:
                continue
            for step in fmt.committed_steps(root, self.rank):
                try:
                    fmt.read_manifest(
                        fmt.rank_dir(root, step, self.rank), step=step, rank=self.rank
                    )
                except fmt.CheckpointCorrupt as exc:
                    log.warning("checkpoint: skipping %s", exc)
                    continue
                out.setdefault(step, []).append(tier)
        if self.settings.enable_ckpt_load_replication and self.ram_root is not None:
            peer_step = self.peer.newest()
            if peer_step is not None:
                sources = out.setdefault(peer_step, [])
                sources.insert(1 if sources[:1] == ["ram"] else 0, "peer")
        return out

    def _load(self, step: int, sources: list[Source]) -> tuple[Source, int] | None:
        """Load `step` from the first source that verifies; (tier, bytes) or None."""
        for tier in sources:
            verified = False
            if tier == "peer":
                assert self.ram_root is not None
                fetched = self.peer.fetch(step, self.ram_root)
                if fetched is None:
                    continue
                # The host monitor checked sizes and crc32s as it downloaded: no second
                # pass over the files.
                directory, verified = fetched
            else:
                root = self.ram_root if tier == "ram" else self.durable_root
                assert root is not None
                directory = fmt.rank_dir(root, step, self.rank)
            try:
                manifest = fmt.read_manifest(directory, step=step, rank=self.rank)
                if not verified:
                    fmt.verify(directory, manifest, threads=self.settings.ckpt_threads_per_rank)
                target = self.state.state_dict(step)
                reader = DirectReader(directory, thread_count=self.settings.ckpt_threads_per_rank)
                dcp_load(target, storage_reader=reader, no_dist=True)
                if self.state.apply(target) != step:
                    raise fmt.CheckpointCorrupt(f"{directory}: holds another step")
            except (fmt.CheckpointCorrupt, OSError, RuntimeError, KeyError, ValueError) as exc:
                log.warning("checkpoint: step %d from %s not loadable: %s", step, tier, exc)
                if tier in ("ram", "peer"):
                    fmt.remove_step(self.ram_root or Path(), step, self.rank)
                continue
            return tier, manifest.size
        return None

    def _all_gather(self, mine: Any) -> list[Any]:
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return [mine]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, mine)
        return out

    # --- shutdown ---------------------------------------------------------------------

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight, then release the peer client and the optimizer
        hook."""
        self._saver.wait(timeout_s)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.peer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
