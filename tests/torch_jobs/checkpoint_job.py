"""A small DDP job (gloo, CPU) that trains with the checkpoint tiers, for the tests.

One process per rank, started by the test with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. Deterministic in the step: the model starts from seed 0, each step's batch
is drawn from a generator seeded by (step, rank), and dropout draws from torch's global
RNG (saved and restored with the checkpoint), so a resumed run ends with bit-identical
weights. Env:
- JOB_STEPS: train until this step; JOB_STOP_AT: stop after this step (saves flushed).
- JOB_KILL_IN_SAVE_AT: SIGKILL this process while the save of that step is being written
  (after torch.distributed.checkpoint wrote the files, before the commit).
- JOB_BREAK_DURABLE_AT: after this step, the durable directory becomes a file (a mount
  gone bad): every later durable save fails.
- JOB_RESULT: where to write {"restored", "tier", "final_step", "weights_sha256"}.
- CHECKPOINT_*: the tiers' settings; HOST_MONITOR_*: the node's host monitor.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resiliency_protocol.checkpoint_manifest import Manifest
from training.checkpoint import Checkpointer, CheckpointSettings
from training.checkpoint import format as fmt
from training.worker_client import WorkerClient


class DataPosition:
    """The data loader's position: what a real job keeps so that it does not replay data."""

    def __init__(self) -> None:
        self.samples_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_seen = int(state["samples_seen"])


def weights_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    width = int(os.environ.get("JOB_WIDTH", "64"))
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(width, 1),
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    position = DataPosition()
    client = WorkerClient.from_env()
    client.register(world_size=world)
    kill_at = int(os.environ.get("JOB_KILL_IN_SAVE_AT", "0"))
    if kill_at:
        build = fmt.build_manifest

        def build_then_die(directory: Path, **kw: Any) -> Manifest:
            if kw["step"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return build(directory, **kw)

        fmt.build_manifest = build_then_die  # type: ignore[assignment]
    ckpt = Checkpointer(
        ddp,
        optimizer,
        lr_scheduler=scheduler,
        extra={"data": position},
        settings=CheckpointSettings.from_env(),
        client=client if client.online else None,
        job=os.environ.get("HOST_MONITOR_JOB") or "test",
    )
    start = ckpt.restore()
    restored = ckpt.last_restore
    steps = int(os.environ["JOB_STEPS"])
    stop_at = int(os.environ.get("JOB_STOP_AT", "0")) or steps
    step = start
    break_at = int(os.environ.get("JOB_BREAK_DURABLE_AT", "0"))
    while step < min(steps, stop_at):
        step += 1
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 16, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        position.samples_seen += 32
        if step == break_at and ckpt.durable_root is not None:
            ckpt.wait()
            shutil.rmtree(ckpt.durable_root)
            ckpt.durable_root.write_text("not a directory any more")
        ckpt.step_done(step)
    ckpt.close()
    result = {
        "restored": start,
        "tier": restored.tier if restored else None,
        "final_step": step,
        "samples_seen": position.samples_seen,
        "weights_sha256": weights_sha256(model),
        "saves": [[r.step, r.tier, r.error] for r in ckpt.save_results],
    }
    Path(os.environ["JOB_RESULT"]).write_text(json.dumps(result))
    client.close()
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # torch 2.13's DDP on gloo aborts in its C++ destructors at exit in about one run in
    # ten: leave without running them (everything is written and flushed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
