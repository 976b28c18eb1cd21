"""DDP's gradient buckets carried across a resume, so that a resumed run sums its
gradients in the same order as a run that never stopped.

DDP reduces gradients bucket by bucket. Its first iteration puts every parameter in one
bucket, in the order the model declares them; from the second on, it uses buckets rebuilt
in the order the backward made the gradients ready (usually the reverse). An all-reduce
over more than two ranks sums each element in an order set by its position in the bucket
(a ring starts each chunk at another rank), and a floating-point sum changes with its
order. So a run resumed from step N, whose fresh DDP wrapper reduces step N+1 in the
first-iteration layout, differs in the last bits from a run that reduced step N+1 in the
rebuilt layout, and training then amplifies that: same data, other weights.

The fix: a checkpoint records the rebuilt layout (which parameters, in which order, in
which bucket, for which world size); a restore into a DDP model that has not rebuilt its
buckets yet registers a communication hook that reduces its first iteration in that
layout, one all-reduce per recorded bucket, and every later iteration exactly as DDP's
built-in all-reduce does (scaled by 1/world size, then summed). Weights are then
bit-identical to an uninterrupted run. Nothing is registered for a run that loaded
nothing, for a model with its own communication hook (one per model: the user's stays),
nor where the world size or the parameters changed (nothing can be bit-exact there).
"""

# No `from __future__ import annotations`: DDP checks the hook's `bucket` annotation
# against dist.GradBucket itself, not a string.
import json
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # not re-exported in its stubs
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

#: The state dict's key for the layout (a JSON string: DCP stores it as one object).
KEY = "ddp_buckets"


def _params(model: DistributedDataParallel) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def recorded_layout(model: torch.nn.Module) -> str | None:
    """The rebuilt bucket layout of a DDP model, as JSON; None before DDP rebuilt its
    buckets (the first iteration), or for another model. Read once, then kept on the
    model: DDP rebuilds its buckets only once per process group."""
    if not isinstance(model, DistributedDataParallel):
        return None
    if not getattr(model, "_has_rebuilt_buckets", False):
        return None
    cached: str | None = getattr(model, "_resiliency_bucket_layout", None)
    if cached is not None:
        return cached
    index = {id(p): i for i, p in enumerate(_params(model))}
    buckets = [
        [index[id(p)] for p in bucket.parameters()]
        for bucket in model.reducer._get_zeros_like_grad_buckets()
    ]
    shapes = [list(p.shape) for p in _params(model)]
    world = dist.get_world_size(model.process_group)
    layout = json.dumps({"world": world, "buckets": buckets, "shapes": shapes})
    model._resiliency_bucket_layout = layout  # type: ignore[assignment]
    return layout


def replay_layout(model: torch.nn.Module, layout: object) -> bool:
    """Reduce the first iteration of a freshly wrapped DDP model in `layout` (see the
    module's docstring); True if the hook is registered."""
    # "": saved before DDP rebuilt its buckets (a step-1 checkpoint): no order to replay.
    if not isinstance(model, DistributedDataParallel) or not isinstance(layout, str) or not layout:
        return False
    if getattr(model, "_has_rebuilt_buckets", True) or getattr(model, "_resiliency_hooked", False):
        return False
    if model._comm_hooks or getattr(model, "mixed_precision", None) is not None:
        log.info(
            "checkpoint: this DDP model has its own communication hook: the first step "
            "after the resume may round its gradient sum differently from a run that "
            "never stopped"
        )
        return False
    saved = json.loads(layout)
    params = _params(model)
    world = dist.get_world_size(model.process_group)
    if saved["world"] != world or saved["shapes"] != [list(p.shape) for p in params]:
        return False  # another world or model: no order to keep
    state = _ReplayState(saved["buckets"], params, model.process_group or dist.group.WORLD)
    try:
        model.register_comm_hook(state, _reduce)
    except (RuntimeError, ValueError) as exc:  # the resume stands; only its order is lost
        log.warning("checkpoint: DDP's gradient order not kept across the resume: %s", exc)
        return False
    model._resiliency_hooked = True  # type: ignore[assignment]
    return True


class _ReplayState:
    def __init__(
        self, buckets: list[list[int]], params: list[torch.nn.Parameter], group: Any
    ) -> None:
        self.buckets = buckets
        self.params = params
        self.group = group
        self.replayed = False


def _reduce(state: _ReplayState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = state.group
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    first = not state.replayed
    state.replayed = True
    # The first iteration's buckets hold every parameter in one (DDP's default): cut it
    # into the recorded buckets. Any other first layout (per-bucket caps, unused
    # parameters searched) is reduced as DDP would.
    if not first or len(bucket.parameters()) != len(state.params):
        # DDP's built-in all-reduce: each gradient times 1/world (not divided: the
        # rounding differs), then summed.
        buffer.mul_(1.0 / world)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        assert work is not None
        reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(
            lambda fut: fut.value()[0]
        )
        return reduced
    # Each recorded bucket reduced by an all-reduce of its own, in the recorded order.
    views: dict[int, torch.Tensor] = {}
    offset = 0
    index = {id(p): i for i, p in enumerate(state.params)}
    for param in bucket.parameters():
        views[index[id(param)]] = buffer[offset : offset + param.numel()]
        offset += param.numel()
    flats = [torch.cat([views[i] for i in indices]).mul_(1.0 / world) for indices in state.buckets]
    for flat in flats:
        dist.all_reduce(flat, group=group)
    for indices, flat in zip(state.buckets, flats, strict=True):
        start = 0
        for i in indices:
            views[i].copy_(flat[start : start + views[i].numel()])
            start += views[i].numel()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done
