"""`TieredCheckpointing`: the checkpoint tiers as a PyTorch Lightning callback (extra
`lightning`, the `lightning` package; the base install and `training.checkpoint` never
import Lightning).

    trainer = Trainer(max_steps=10_000, callbacks=[TieredCheckpointing()])
    trainer.fit(model, datamodule)   # restores the newest step, then saves as tiers fall due

It drives a `Checkpointer` with the module, its (single) optimizer and LR scheduler, and
the fit loop's progress (epoch, batch, global step; a stateful dataloader's position where
the loader has one), keyed by `trainer.global_step`:
- `on_fit_start` (every rank, once the strategy has set up the model and the process
  group): `Checkpointer.restore()`, then the fit loop continues after the restored step,
  as `trainer.fit(ckpt_path=...)` would;
- after each optimizer step: `Checkpointer.step_done(global_step)`: RAM every
  `in_memory_checkpointing_freq` steps, durable every `s3_checkpointing_freq`,
  asynchronously;
- `on_fit_end` and on an exception: waits for the save in flight.

Emergency checkpoints work as with a plain loop (a host monitor's request is served from
the worker client's thread, also while a rank is stuck in a collective). Lightning runs
forward and backward inside `optimizer.step()` (a closure), so the callback marks the
parameter update in `on_before_optimizer_step`, after the backward, rather than with an
optimizer hook that would hold emergency saves for the whole step.

A dataloader without state restarts its epoch from the beginning when the restored step
is not at an epoch's end (Lightning's own behaviour when resuming mid-epoch); for an exact
mid-epoch resume use a stateful loader (torchdata's `StatefulDataLoader`).

Settings come from the environment (`CheckpointSettings.from_env()`: the same names as the
plain `Checkpointer`) unless given.
"""

from __future__ import annotations

import logging
import pickle
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from training.checkpoint.checkpointer import Checkpointer, Restored
from training.checkpoint.settings import CheckpointSettings
from training.worker_client import WorkerClient

if TYPE_CHECKING:
    from collections.abc import Mapping

    from training.checkpoint.state import Stateful

log = logging.getLogger(__name__)


class _FitLoopState:
    """The fit loop's progress as one opaque item: its layout varies with the Lightning
    version and the dataloaders, and a restore needs every key the save had."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"fit_loop": pickle.dumps(self.trainer.fit_loop.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(pickle.loads(state_dict["fit_loop"]))


class TieredCheckpointing(Callback):
    def __init__(
        self,
        *,
        settings: CheckpointSettings | None = None,
        client: WorkerClient | None = None,
        extra: Mapping[str, Stateful] | None = None,
        replicated: bool | None = None,
        emergency: bool | None = None,
    ) -> None:
        """`client`: the worker client (default: from the environment, registered here
        when HOST_MONITOR_URL is set); `extra`: more of your objects to save (each with
        `state_dict` and `load_state_dict`); `replicated`: every rank holds the same
        state (default: the DDP or single-device strategies); `emergency`: serve
        emergency checkpoints (default: when the client is online)."""
        super().__init__()
        self.settings = settings
        self.client = client
        self.extra = dict(extra or {})
        self.replicated = replicated
        self.emergency = emergency
        self.checkpointer: Checkpointer | None = None
        self._client: WorkerClient | None = None  # the one in use during `fit`
        self._owns_client = False
        self._last_step = 0
        #: What the restore at the start of `fit` did on this rank.
        self.last_restore: Restored | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"TieredCheckpointing saves one optimizer; the module configures"
                f" {len(trainer.optimizers)}"
            )
        schedulers = trainer.lr_scheduler_configs
        if len(schedulers) > 1:
            raise ValueError(
                f"TieredCheckpointing saves one LR scheduler; the module configures"
                f" {len(schedulers)}"
            )
        client = self.client
        if client is None:
            client = WorkerClient.from_env()
            client.register(world_size=trainer.world_size)
            self._owns_client = True
        self._client = client
        replicated = self.replicated
        if replicated is None:
            replicated = isinstance(trainer.strategy, (DDPStrategy, SingleDeviceStrategy))
        self.checkpointer = Checkpointer(
            pl_module,
            trainer.optimizers[0],
            lr_scheduler=schedulers[0].scheduler if schedulers else None,
            extra={**self.extra, "lightning": _FitLoopState(trainer)},
            settings=self.settings,
            client=client if client.online else None,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            replicated=replicated,
            emergency=self.emergency,
            hook_optimizer=False,
        )
        step = self.checkpointer.restore()
        restored = self.last_restore = self.checkpointer.last_restore
        if restored is not None and restored.step:
            log.warning(
                "TieredCheckpointing: resumed at global step %d from tier %s in %.2fs",
                step,
                restored.tier,
                restored.seconds,
            )
        self._last_step = trainer.global_step
        if self._last_step != step:
            raise RuntimeError(
                f"the restored fit loop is at global step {self._last_step}, the checkpoint"
                f" at step {step}"
            )
        client.report_step(step)

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.checkpointer is not None:
            self.checkpointer.optimizer_step_starts()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        step = trainer.global_step
        if self.checkpointer is None or step == self._last_step:
            return  # gradient accumulation: no optimizer step in this batch
        self._last_step = step
        if self._client is not None:
            self._client.report_step(step)
        self.checkpointer.step_done(step)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._owns_client and self._client is not None:
            self._client.finished()  # the exit that follows is no failure
        self._close()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def _close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        if self._owns_client and self._client is not None:
            self._client.close()  # flushes its reports
        self._client, self._owns_client = None, False
