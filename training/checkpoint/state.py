"""A PyTorch training state as one state dict, and its copy to host memory (staging).

The state: model and optimizer (through `torch.distributed.checkpoint.state_dict`, so DDP
and FSDP models give the same keys), the LR scheduler, the RNG states (torch CPU and CUDA,
Python's `random`), the user's own stateful objects (data position, ...) and the step.

A sharded model (FSDP2, HSDP, tensor parallel: parameters and optimizer state held as
DTensors) gives a state dict of DTensors, each rank holding its local shards; staging
copies each DTensor's local shard to host memory and keeps its sharding (mesh, placements,
global shape), so that DCP writes it with its global offsets and a later load can reshard.

FSDP1 (`FullyShardedDataParallel`) is `gathered`: its sharded state dict is made by a
collective (it all-gathers the flat parameters, then cuts them again) and holds copies,
as DTensors when it was given a device mesh, else as ShardedTensors (staged alike, their
local shards copied with their metadata). Its state is read on every rank together
(periodic saves, restores), never from ranks that may be stuck in a collective: an
emergency save of such a model stands on the newest periodic save.
"""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from training.checkpoint import ddp_order


def is_sharded(state: Any) -> bool:
    """Whether a state dict holds a DTensor whose shards differ between ranks (a
    placement other than Replicate), or a ShardedTensor: its ranks' checkpoints are
    pieces of one whole."""
    if isinstance(state, DTensor):
        return any(not p.is_replicate() for p in state.placements)
    if isinstance(state, ShardedTensor):
        return True
    if isinstance(state, Mapping):
        return any(is_sharded(v) for v in state.values())
    if isinstance(state, list | tuple):
        return any(is_sharded(v) for v in state)
    return False


def local_data_ptr(tensor: torch.Tensor) -> int:
    """The address of a tensor's (a DTensor's: its local shard's) data; 0 for a
    ShardedTensor (always a copy: see `TrainingState.gathered`)."""
    if isinstance(tensor, ShardedTensor):
        return 0
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).data_ptr()


def local_numel(tensor: torch.Tensor) -> int:
    """The elements this rank holds of a tensor (a DTensor's or ShardedTensor's shards)."""
    if isinstance(tensor, DTensor):
        return tensor.to_local().numel()
    if isinstance(tensor, ShardedTensor):
        return sum(shard.tensor.numel() for shard in tensor.local_shards())
    return tensor.numel()


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Snapshot:
    """The part of a training state a forward and backward can change, at one step."""

    step: int
    small: dict[str, Any]  # lr_scheduler, rng, extra
    buffers: dict[int, torch.Tensor]  # the model's buffers by data_ptr, copied
    #: The model's and optimizer's state dict at that step, by reference (not copied),
    #: for sharded models: an emergency save cannot take it later, while the main thread
    #: may hold unsharded parameters in a forward or backward stuck in a collective.
    weights: dict[str, Any] | None = None
    #: Recorded on the training stream at that step (a GPU state): copies of its tensors
    #: wait for it, not for the stream, which a collective that never ends can block.
    ready: torch.cuda.Event | None = None


class TrainingState:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lr_scheduler: Any | None = None,
        extra: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.extra = dict(extra or {})
        self._sharded: bool | None = None
        self._weights_refs: dict[str, Any] | None = None
        #: Whether reading the model's state is a collective that returns copies (FSDP1).
        self.gathered = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())

    @property
    def sharded(self) -> bool:
        """Whether the model's state is sharded across ranks (see `is_sharded`)."""
        if self._sharded is None:
            # FSDP1's state dict is a collective: not read here, on one rank's whim.
            self._sharded = self.gathered or is_sharded(self.model.state_dict())
        return self._sharded

    def state_dict(self, step: int) -> dict[str, Any]:
        """The live state: its tensors are the model's and optimizer's own (not copies)."""
        return {**self._weights(), **self._small(), "step": step}

    def _weights(self) -> dict[str, Any]:
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        else:
            model_sd, optim_sd = self.model.state_dict(), {}
        return {"model": model_sd, "optim": optim_sd}

    def _small(self) -> dict[str, Any]:
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": pickle.dumps(random.getstate()),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        small = {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else {},
            "rng": rng,
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
        }
        if isinstance(self.model, DistributedDataParallel):
            # The order DDP sums gradients in (ddp_order.py); "" before it is known.
            small[ddp_order.KEY] = ddp_order.recorded_layout(self.model) or ""
        return small

    def snapshot(self, step: int) -> Snapshot:
        """What changes outside `optimizer.step()` (RNG, scheduler, the user's objects,
        model buffers), copied now: with the parameters and optimizer state, which only
        `optimizer.step()` changes, it is the state at the end of `step` until the next
        `optimizer.step()`, whatever the forward and backward in between do."""
        buffers = {
            local_data_ptr(buffer): buffer.detach().clone()
            for module in self.model.modules()
            for name, buffer in module._buffers.items()
            # Non-persistent buffers (masks, rotary caches) are not in the state dict.
            if buffer is not None and name not in module._non_persistent_buffers_set
        }
        weights = None
        # Only once the optimizer holds state: before its first step, DCP's state dict
        # helper would make some (a step with no gradient), changing what training does.
        # FSDP1 gives copies: not references that later steps update (see `gathered`).
        live = self.sharded and not self.gathered
        if live and self.optimizer is not None and self.optimizer.state:
            # The same tensors from step to step (updated in place by optimizer.step()):
            # taken once, then reused.
            if self._weights_refs is None or not self._weights_refs["optim"].get("state"):
                self._weights_refs = self._weights()
            refs = self._weights_refs
            # Hyperparameters are copied into a state dict, not referenced: this step's
            # (the LR schedule moves them every step), under the names DCP gave them.
            groups = [
                {**saved, **{k: copy.deepcopy(v) for k, v in live.items() if k != "params"}}
                for saved, live in zip(
                    refs["optim"].get("param_groups", []),
                    self.optimizer.param_groups,
                    strict=True,
                )
            ]
            weights = {
                "model": refs["model"],
                "optim": {**refs["optim"], "param_groups": groups},
            }
        return Snapshot(
            step, copy.deepcopy(self._small()), buffers, weights, self.gpu_ready_event()
        )

    def gpu_ready_event(self) -> torch.cuda.Event | None:
        """An event on the current CUDA stream, when the model lives on a GPU: it
        completes once the work queued so far (this step's update) has run."""
        first = next(self.model.parameters(), None)
        if first is None or not first.is_cuda:
            return None
        event: torch.cuda.Event = torch.cuda.current_stream(first.device).record_event()
        return event

    def rewind(self, snapshot: Snapshot) -> None:
        """Put back what a forward and backward since `snapshot` changed (RNG, scheduler,
        the user's objects, buffers) and drop gradients: with the live parameters and
        optimizer state (no `optimizer.step()` since), the state at its step again."""
        small = copy.deepcopy(snapshot.small)
        ddp_order.replay_layout(self.model, small.get(ddp_order.KEY))
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(small["lr_scheduler"])
        self._set_rng(small["rng"])
        for name, obj in self.extra.items():
            obj.load_state_dict(small["extra"][name])
        with torch.no_grad():
            for buffer in self.model.buffers():
                saved = snapshot.buffers.get(local_data_ptr(buffer))
                if saved is not None:
                    buffer.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def _set_rng(rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"])
        random.setstate(pickle.loads(rng["python"]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(rng["cuda"]))

    def state_at(self, snapshot: Snapshot) -> dict[str, Any]:
        """The state of `snapshot`'s step: live parameters and optimizer state (unchanged
        since, as long as no `optimizer.step()` ran), the rest from the snapshot."""
        if snapshot.weights is None and self.gathered:
            raise ValueError(
                "FSDP1 makes its state dict with a collective, which ranks stuck in one"
                " cannot join: the newest periodic save stands (with"
                " in_memory_checkpointing_freq=1 it is the last completed step)"
            )
        if snapshot.weights is None and self.sharded:
            # Read now, its parameters may be a forward's unsharded ones: not a state.
            raise ValueError("no sharded state was taken at that step (no update yet)")
        weights = snapshot.weights if snapshot.weights is not None else self._weights()
        model_sd = {
            key: snapshot.buffers.get(local_data_ptr(value), value)
            if isinstance(value, torch.Tensor)
            else value
            for key, value in weights["model"].items()
        }
        return {
            "model": model_sd,
            "optim": weights["optim"],
            **snapshot.small,
            "step": snapshot.step,
        }

    def apply(self, loaded: dict[str, Any]) -> int:
        """Put a state dict that `dcp.load` filled back into the objects; its step."""
        if self.optimizer is not None:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=loaded["model"],
                optim_state_dict=loaded["optim"],
            )
        else:
            self.model.load_state_dict(loaded["model"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
        self._set_rng(loaded["rng"])
        for name, obj in self.extra.items():
            obj.load_state_dict(loaded["extra"][name])
        ddp_order.replay_layout(self.model, loaded.get(ddp_order.KEY))
        return int(loaded["step"])


class StagingBuffers:
    """Host-memory copies of the state's tensors, kept from one save to the next.

    Allocating 1 GB of fresh memory per save costs more than the copy (page faults on
    first touch), so buffers are reused while the state's shapes do not change. Pinned
    when CUDA is there, so that a GPU state copies without a bounce buffer.

    GPU tensors are copied on a stream of their own, after an event (`after`, or one
    recorded now on the caller's stream): never on the training stream, and never with a
    device-wide synchronize. A rank stuck in a collective has that collective's kernel,
    or a wait for it, queued on its training stream forever; a copy queued behind it, or
    a synchronize, would hang the emergency save that is meant to rescue the step.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.nbytes = 0
        self._on_gpu = False
        self._stream: torch.cuda.Stream | None = None
        self._after: torch.cuda.Event | None = None
        self._waited = False

    def stage(
        self,
        state: dict[str, Any],
        *,
        defer: Callable[[str, torch.Tensor], bool] | None = None,
        after: torch.cuda.Event | None = None,
    ) -> dict[str, Any]:
        """A copy of `state` whose tensors live in the buffers (blocking until copied).

        Tensors for which `defer(path, tensor)` is true are left as they are (the live
        tensors): a second `stage` of the result, without `defer`, copies them later.
        GPU tensors are read once `after` has completed (default: once the work queued
        on the caller's current stream so far has run); a thread other than the one
        that trains passes an event the training thread recorded.
        """
        seen: set[str] = set()
        self._on_gpu = False
        self._after, self._waited = after, False
        staged = self._copy(state, "", seen, defer)
        if defer is None:
            for key in set(self._buffers) - seen:
                del self._buffers[key]
        self.nbytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        if self._on_gpu and self._stream is not None:
            self._stream.synchronize()  # the copies were issued non-blocking, on it alone
        result: dict[str, Any] = staged
        return result

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        if not self._waited:
            ready = self._after
            if ready is None:
                ready = torch.cuda.current_stream(device).record_event()
            self._stream.wait_event(ready)
            self._waited = True
        return self._stream

    def _copy(
        self,
        value: Any,
        path: str,
        seen: set[str],
        defer: Callable[[str, torch.Tensor], bool] | None,
    ) -> Any:
        if isinstance(value, DTensor):
            if defer is not None and defer(path, value):
                seen.add(path)
                return value
            local = self._copy(value.to_local(), path, seen, None)
            # The local shard in host memory with the DTensor's sharding (the constructor
            # keeps the tensor where it is; `from_local` would move it to the mesh's device).
            return DTensor(local, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        if isinstance(value, ShardedTensor):
            shards = [
                Shard(self._copy(shard.tensor, f"{path}/shard-{i}", seen, None), shard.metadata)
                for i, shard in enumerate(value.local_shards())
            ]
            # Built from this rank's shards and the global metadata it holds: no collective.
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, value.metadata(), process_group=value._process_group
            )
        if isinstance(value, torch.Tensor):
            seen.add(path)
            if defer is not None and defer(path, value):
                return value
            buffer = self._buffers.get(path)
            if buffer is value:
                return buffer  # staged already (the first of two stages)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                pin = value.is_cuda
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
                self._buffers[path] = buffer
            if value.is_cuda:
                with torch.cuda.stream(self._copy_stream(value.device)):
                    buffer.copy_(value.detach(), non_blocking=True)
                self._on_gpu = True
            else:
                buffer.copy_(value.detach())
            return buffer
        if isinstance(value, Mapping):
            return {k: self._copy(v, f"{path}/{k}", seen, defer) for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, f"{path}/{i}", seen, defer) for i, v in enumerate(value)]
        return copy.deepcopy(value)
