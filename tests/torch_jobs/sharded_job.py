"""A small sharded job (FSDP2 or HSDP on gloo, CPU) that trains with the checkpoint tiers.

Written as a user of FSDP2 writes one: `fully_shard` on each `Linear` and on the model,
AdamW, the `Checkpointer` as docs/training.md shows it. One process per rank, started by
the test with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Deterministic in the step
and the layout: each step's batch is drawn from a generator seeded by (step, rank), and
dropout draws from torch's global RNG (saved and restored with the checkpoint). Env:
- JOB_PARALLELISM: `fsdp` (1-D mesh over every rank), `hsdp` (JOB_REPLICAS x the rest),
  `tp` (tensor parallel: the first Linear column-wise, the last row-wise), `fsdp1`
  (FullyShardedDataParallel, each Linear a unit) or `fsdp1-mesh` (the same on a mesh).
- JOB_STEPS: train until this step; JOB_STOP_AT: stop after this step (saves flushed);
  JOB_EMERGENCY_AT: take an emergency checkpoint after this step (its step, or its error,
  goes in the result's "emergency").
- JOB_RESULT: where rank r writes {"restored", "tier", "sources", "final_step",
  "full_sha256" (of the full, unsharded model and optimizer state at the end),
  "restored_sha256" (the same, right after the restore), "saves"}.
- CHECKPOINT_*: the tiers' settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from training.checkpoint import Checkpointer, CheckpointSettings
from training.checkpoint.emergency import EmergencyCheckpointError
from training.worker_client import WorkerClient


class DataPosition:
    def __init__(self) -> None:
        self.samples_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_seen = int(state["samples_seen"])


def full_sha256(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The hash of the full (unsharded) model and optimizer state: a collective."""
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    digest = hashlib.sha256()

    def feed(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(prefix.encode())
            digest.update(
                value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
            )
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                feed(f"{prefix}.{key}", value[key])
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                feed(f"{prefix}.{i}", item)
        else:
            digest.update(f"{prefix}={value!r}".encode())

    feed("model", model_sd)
    feed("optim", optim_sd.get("state", {}))
    return digest.hexdigest()


def main() -> int:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if os.environ.get("JOB_PARALLELISM", "fsdp") == "hsdp":
        replicas = int(os.environ.get("JOB_REPLICAS", "2"))
        mesh = init_device_mesh(
            "cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    width = int(os.environ.get("JOB_WIDTH", "64"))
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(width, 8),
    )
    parallelism = os.environ.get("JOB_PARALLELISM", "fsdp")
    if parallelism == "tp":
        plan = {"0": ColwiseParallel(), "3": RowwiseParallel()}
        parallelize_module(model, mesh, plan)
    elif parallelism in ("fsdp1", "fsdp1-mesh"):
        # FSDP1 as its users wrap it: each Linear a unit of its own, the original
        # parameters kept; on the CPU, `device_id` says so. With a mesh its sharded
        # state dict holds DTensors, without one ShardedTensors.
        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
            device_mesh=mesh if parallelism == "fsdp1-mesh" else None,
        )
    else:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    position = DataPosition()
    client = WorkerClient.from_env()  # offline without HOST_MONITOR_URL
    client.register(world_size=world)
    ckpt = Checkpointer(
        model,
        optimizer,
        extra={"data": position},
        settings=CheckpointSettings.from_env(),
        client=client if client.online else None,
        job=os.environ.get("HOST_MONITOR_JOB") or "sharded-test",
        # Served for the host monitor when online; taken by the job itself when asked to.
        emergency=client.online or bool(os.environ.get("JOB_EMERGENCY_AT")),
    )
    start = ckpt.restore()
    restored = ckpt.last_restore
    restored_sha = full_sha256(model, optimizer) if start else None
    steps = int(os.environ["JOB_STEPS"])
    stop_at = int(os.environ.get("JOB_STOP_AT", "0")) or steps
    step = start
    emergency_at = int(os.environ.get("JOB_EMERGENCY_AT", "0"))
    emergency = None
    while step < min(steps, stop_at):
        step += 1
        # Tensor parallel ranks work on the same batch; data-parallel ones on their own.
        data_rank = 0 if os.environ.get("JOB_PARALLELISM") == "tp" else rank
        generator = torch.Generator().manual_seed(1000 * step + data_rank)
        x = torch.randn(8, 16, generator=generator)
        y = x[:, :8].sin()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        position.samples_seen += 8
        ckpt.step_done(step)
        if step == emergency_at:
            try:
                emergency: int | str = ckpt.emergency_save()
            except EmergencyCheckpointError as exc:
                emergency = str(exc)
    ckpt.close()
    result = {
        "restored": start,
        "tier": restored.tier if restored else None,
        "sources": {str(k): v for k, v in (restored.sources if restored else {}).items()},
        "final_step": step,
        "samples_seen": position.samples_seen,
        "full_sha256": full_sha256(model, optimizer),
        "restored_sha256": restored_sha,
        "saves": [[r.step, r.tier, r.error] for r in ckpt.save_results],
        "emergency": emergency,
    }
    Path(os.environ["JOB_RESULT"]).write_text(json.dumps(result))
    client.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
