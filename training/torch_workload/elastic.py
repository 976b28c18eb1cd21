"""A data-parallel step whose result does not depend on the world's size.

A step of the `ddp` job trains on DATA_REPLICAS batches: batch r is drawn from (seed,
step, r), and so is its dropout. Its gradient is the mean of the batches' gradients,
summed in the order of r: what DDP computes with the workload's hook (parallel.py) in a
world of DATA_REPLICAS ranks, one batch each. A world of another size (the job scaled
down with no spare left, or up past it) takes the same step here: rank i computes the
gradients of batches i, i + W, i + 2W, ... one by one, the ranks gather them all, and
each sums them in the order of r. The step is the full world's, bit for bit, and the
job's weights stay those of a run that never lost a node, at the price of the missing
ranks' compute on the ranks left.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from training.torch_workload.config import TorchWorkloadConfig
from training.torch_workload.model import batch


def takes_elastic_steps(cfg: TorchWorkloadConfig, sharded: bool) -> bool:
    """Whether this world's steps are taken here rather than by DDP and its hook: a
    replicated model in a world of another size than the step's batches."""
    return not sharded and cfg.batches_per_step != cfg.world_size


def seed_dropout(seed: int, step: int, replica: int) -> None:
    """Dropout's random numbers for `replica`'s batch of `step`: the same in every world."""
    torch.manual_seed(seed * 1_000_003 + step * 1_009 + replica + 7)


def batch_loss(
    cfg: TorchWorkloadConfig, model: torch.nn.Module, step: int, replica: int
) -> torch.Tensor:
    """The loss of `replica`'s batch of `step` (its forward pass)."""
    seed_dropout(cfg.seed, step, replica)
    inputs, targets = batch(
        cfg.seed,
        step,
        replica,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size,
    )
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)
    )


def elastic_step_gradients(
    cfg: TorchWorkloadConfig, model: torch.nn.Module, step: int
) -> tuple[torch.Tensor, float]:
    """Set every parameter's gradient to the mean over the step's batches, as a world of
    `batches_per_step` ranks would: (the loss of this rank's first batch, or 0 when it
    has none; the seconds its forward passes took). Raises RuntimeError when the gather
    fails (a lost peer): no parameter changed then."""
    world, rank, replicas = cfg.world_size, cfg.rank, cfg.batches_per_step
    params = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() for p in params)
    slots = -(-replicas // world)  # batches per rank, at most
    mine = torch.zeros(slots, size)
    first_loss = torch.zeros(())
    compute_s = 0.0
    for slot, replica in enumerate(range(rank, replicas, world)):
        for p in params:
            p.grad = None
        computing = time.monotonic()
        loss = batch_loss(cfg, model, step, replica)
        compute_s += time.monotonic() - computing
        loss.backward()  # type: ignore[no-untyped-call]
        mine[slot] = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        if slot == 0:
            first_loss = loss.detach()
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    # Batch r was computed by rank r % world, in its slot r // world.
    total = gathered[0][0].clone()
    for replica in range(1, replicas):
        total.add_(gathered[replica % world][replica // world])
    total.div_(replicas)
    offset = 0
    for p in params:
        p.grad = total[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return first_loss, compute_s
