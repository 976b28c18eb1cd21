"""How the torch workload lays its model over the ranks: `PARALLELISM` ddp, fsdp or hsdp.

- `ddp`: every rank holds the whole model; DistributedDataParallel all-reduces gradients.
- `fsdp`: FSDP2 (`fully_shard` on each transformer block and on the model) over a 1-D
  mesh of every rank: each rank holds a shard of every parameter and of its optimizer
  state.
- `hsdp`: FSDP2 on a 2-D mesh (replicate, shard) of `DP_REPLICATE` replica groups, each
  sharding the model over the rest: a shard exists once per replica group.

A sharded model belongs to the mesh of the world it was built in, so each new world (an
in-process restart) builds it again and the Checkpointer loads the agreed step into it;
a DDP model is only wrapped again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout as set_group_timeout
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from training.tensor_bytes import tensor_bytes
from training.torch_workload.config import TorchWorkloadConfig
from training.torch_workload.model import DecoderLM


@dataclass
class Built:
    """The model, optimizer and LR schedule of one world."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    @property
    def sharded(self) -> bool:
        return any(isinstance(p, torch.distributed.tensor.DTensor) for p in self.model.parameters())


def mesh_of(cfg: TorchWorkloadConfig) -> DeviceMesh:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.parallelism == "hsdp":
        # A world scaled to a size the replica groups do not divide shards over all.
        replicas = cfg.dp_replicate if cfg.world_size % cfg.dp_replicate == 0 else 1
        mesh = init_device_mesh(
            device, (replicas, cfg.world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device, (cfg.world_size,), mesh_dim_names=("shard",))
    # The mesh's groups take torch's default timeout (30 min on gloo), not the world's: a
    # rank whose peer in one group left after a failure in another (HSDP) would wait that
    # long rather than fail and hold its step for the supervisor. (gloo has no abort that
    # wakes a waiting collective; NCCL's would.)
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    for dim in range(mesh.ndim):
        set_group_timeout(timeout, mesh.get_group(dim))
    return mesh


def build(cfg: TorchWorkloadConfig) -> Built:
    """The model (sharded over this world's ranks for fsdp and hsdp), its optimizer and
    schedule, initialised from SEED: the same on every rank and in every world."""
    torch.manual_seed(cfg.seed)
    model = DecoderLM(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len)
    if cfg.parallelism != "ddp":
        mesh = mesh_of(cfg)
        for block in model.blocks.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # foreach: one call per step for all parameters. On the CPU torch would take its
    # per-tensor loop, a dispatch per parameter and operation: with DTensors, a quarter
    # of a sharded step's time here.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, foreach=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.total_steps)
    return Built(model, optimizer, scheduler)


def data_parallel(model: torch.nn.Module) -> DistributedDataParallel:
    """`model` under DDP, with each gradient's average summed in rank order.

    DDP's all-reduce sums each element of a gradient in an order set by where it lies in
    its bucket, and DDP lays its buckets out again after its first iteration (in the order
    the gradients became ready): the first step after each wrapping (a resume, a new world)
    would sum in another order than a run without a fault. Over more than two ranks a
    floating-point sum changes with its order, and the weights would no longer be
    bit-identical to that run's. Gathering each bucket and adding rank 0's first makes every
    sum independent of the layout, for an all-gather (world size x the bucket) instead of
    an all-reduce: a price this workload, a small model made to be checked bit for bit,
    pays gladly.
    """
    # Its one buffer (the causal mask) is the same constant on every rank: no broadcast of
    # it in each forward pass, which then holds no collective.
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    ddp.register_comm_hook(None, _rank_ordered_mean)
    return ddp


def _rank_ordered_mean(_state: None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    world = dist.get_world_size()
    gathered = [torch.empty_like(buffer) for _ in range(world)]
    work = dist.all_gather(gathered, buffer, async_op=True)
    assert work is not None  # async_op=True

    def mean(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        done.value()  # raises the gather's failure (a lost rank): the step fails with it
        total = gathered[0].clone()
        for part in gathered[1:]:
            total.add_(part)
        return total.div_(world)

    averaged: torch.futures.Future[torch.Tensor] = work.get_future().then(mean)
    return averaged


# DDP checks a hook's annotations as objects; this module's are strings (postponed).
_rank_ordered_mean.__annotations__.update(
    {"bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


def weights_sha256(model: torch.nn.Module) -> str | None:
    """A hash of every full (unsharded) weight and buffer, by name: equal hashes,
    bit-identical models. For a sharded model a collective (every rank calls it); the hash
    on rank 0, None elsewhere."""
    sharded = any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    if sharded:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state: dict[str, Any] = get_model_state_dict(model, options=options)
        if dist.get_rank() != 0:
            return None
    else:
        state = model.state_dict()
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()
