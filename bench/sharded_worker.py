"""One rank of the sharded checkpoint benchmark (started by bench/sharded_checkpoint.py).

A model of LAYERS x Linear(WIDTH, WIDTH) sharded with FSDP2 over every rank (gloo), AdamW
with its state. BENCH_MODE:
- `save`: a synchronous collective `torch.distributed.checkpoint.save` of the sharded
  state (the baseline), then SAVES steps each followed by an asynchronous save to the RAM
  and durable tiers (the blocking time of each), then a restore from RAM and one from
  durable (RAM emptied) in the same layout;
- `restore`: a restore, by new processes, from the durable tier a `save` run wrote (in
  another world size: resharded).
Writes its figures as JSON to BENCH_OUT/rank-<rank>.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import Checkpointer, CheckpointSettings
from training.checkpoint.reader import DirectReader


def build(layers: int, width: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()


def timed_collectively(action: Any) -> float:
    """Seconds from every rank starting to the last one finishing."""
    dist.barrier()
    started = time.monotonic()
    action()
    dist.barrier()
    return time.monotonic() - started


def step_cost(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    width: int,
    settings: CheckpointSettings,
    steps: int = 4,
) -> dict[str, float]:
    """Seconds per training step without checkpoints and with a RAM save every step (what
    FSDP without replicas needs to lose at most one step when a node dies)."""

    def plain() -> None:
        for _ in range(steps):
            train_step(model, optimizer, width)

    every = Checkpointer(
        model,
        optimizer,
        settings=replace(
            settings, s3_checkpointing_freq=0, ram_dir=Path(settings.ram_dir or "") / "every"
        ),
        job="bench",
    )
    done = [0]

    def saving() -> None:
        for _ in range(steps):
            train_step(model, optimizer, width)
            done[0] += 1
            every.step_done(done[0])

    saving()  # the staging buffers allocated once
    with_saves = timed_collectively(saving) / steps
    every.wait()
    every.close()
    return {"step_s": timed_collectively(plain) / steps, "step_with_ram_save_s": with_saves}


def main() -> int:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    layers, width = int(os.environ["LAYERS"]), int(os.environ["WIDTH"])
    root, out = Path(os.environ["BENCH_DIR"]), Path(os.environ["BENCH_OUT"])
    model, optimizer = build(layers, width, world)
    settings = CheckpointSettings(
        in_memory_checkpointing_freq=1,
        s3_checkpointing_freq=1,
        ram_dir=Path(os.environ["BENCH_RAM"]) / f"rank-{rank}",
        durable_dir=root / Tier.DURABLE,
        ram_topk_ckpt=1,
        topk_ckpt=1,
        ckpt_threads_per_rank=int(os.environ.get("THREADS", "2")),
        enable_peer_ckpt=False,
        enable_ckpt_load_replication=False,
    )
    result: dict[str, Any] = {}
    if os.environ["BENCH_MODE"] == "save":
        train_step(model, optimizer, width)
        result.update(step_cost(model, optimizer, width, settings))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        result["sync_dcp_save_s"] = timed_collectively(
            lambda: dcp_save(state, checkpoint_id=str(root / "sync"))
        )
        ckpt = Checkpointer(model, optimizer, settings=settings, job="bench")
        for step in range(1, int(os.environ["SAVES"]) + 1):
            train_step(model, optimizer, width)
            ckpt.step_done(step)
        train_step(model, optimizer, width)  # the last save's deferred copy waits in it
        ckpt.wait()
        result["blocking_s"] = ckpt.blocking
        result["saves"] = [
            {"tier": r.tier, "size": r.size, "write_s": r.write_s, "error": r.error}
            for r in ckpt.save_results
        ]
        result["ram_restore_s"] = timed_collectively(ckpt.restore)
        result["ram_restore_tier"] = ckpt.last_restore.tier if ckpt.last_restore else None
        shutil.rmtree(settings.ram_root("bench"), ignore_errors=True)
        again = Checkpointer(model, optimizer, settings=settings, job="bench")
        result["durable_restore_s"] = timed_collectively(again.restore)
        restored = again.last_restore
        result["durable_restore_tier"] = restored.tier if restored else None
        result["restored_bytes"] = restored.size if restored else 0
        ckpt.close()
        again.close()
    else:
        ckpt = Checkpointer(model, optimizer, settings=settings, job="bench")
        result["resharded_restore_s"] = timed_collectively(ckpt.restore)
        result["items_read_direct"] = DirectReader.direct
        result["items_read_by_dcp"] = DirectReader.fallback
        restored = ckpt.last_restore
        result["resharded_restore_tier"] = restored.tier if restored else None
        result["restored_step"] = restored.step if restored else 0
        result["restored_bytes"] = restored.size if restored else 0
        ckpt.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
