"""A training process of one world for the fencing tests (tests/test_checkpoint_fencing.py):
restores, trains to `--until` saving through `step_done`, and prints what it did as one
JSON line. Its world is WORKLOAD_ATTEMPT, as a launched worker's.

`--hold-at STEP --signals DIR`: the save of STEP passes its fence check (no newer world
yet) and then waits before its durable commit, until DIR/go-check exists (it writes
DIR/held-check when it waits): the writer cut off by a partition, whose commit races a
newer world's start. After the commit it waits again, before retention, for
DIR/go-retain (DIR/held-retain): a writer that stops there leaves its commit in place.

    python -m tests.fencing_writer --ram DIR (--durable-dir DIR | --durable-url URL) ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from training.checkpoint import Checkpointer, CheckpointSettings
from training.checkpoint.checkpointer import CheckpointSavesFailing
from training.checkpoint.peer import PeerTier
from training.checkpoint.world_fence import WorldFence


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ram", type=Path, required=True)
    parser.add_argument("--durable-dir", type=Path)
    parser.add_argument("--durable-url")
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--hold-at", type=int)
    parser.add_argument("--signals", type=Path)
    args = parser.parse_args()
    settings = CheckpointSettings(
        in_memory_checkpointing_freq=2,
        s3_checkpointing_freq=2,
        ram_dir=args.ram,
        durable_dir=args.durable_dir,
        durable_url=args.durable_url,
        topk_ckpt=2,
        sync_files=False,
        enable_async_ckpt=False,
        enable_peer_ckpt=False,
        enable_ckpt_load_replication=False,
        max_consecutive_save_failures=2,
        durable_timeout_s=10.0,
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(
        model,
        optimizer,
        settings=settings,
        rank=0,
        world_size=1,
        peer=PeerTier(None, None, 0, fetch_timeout_s=5),
    )
    current = {"step": 0}
    if args.hold_at is not None:
        check, drop = WorldFence.check, WorldFence.drop_shadowed

        def hold(point: str, tier: str) -> None:
            if tier == "durable" and current["step"] == args.hold_at:
                (args.signals / f"held-{point}").write_text("held\n")
                while not (args.signals / f"go-{point}").exists():
                    time.sleep(0.05)

        def held_check(fence: WorldFence, tier: str) -> None:
            check(fence, tier)
            hold("check", tier)

        def held_drop(fence: WorldFence, tier: str, rank: int) -> list[int]:
            hold("retain", tier)
            return drop(fence, tier, rank)

        WorldFence.check = held_check  # type: ignore[method-assign,assignment]
        WorldFence.drop_shadowed = held_drop  # type: ignore[method-assign,assignment]
    start = ckpt.restore()
    restored = ckpt.last_restore
    out: dict[str, Any] = {
        "world": ckpt._fence.world,
        "restored": start,
        "tier": restored.tier if restored is not None else None,
        "weights": [round(float(x), 6) for x in model.weight.detach().flatten()[:4]],
    }
    try:
        for step in range(start + 1, args.until + 1):
            current["step"] = step
            torch.manual_seed(step)
            optimizer.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            ckpt.step_done(step)
        out["stopped"] = None
    except CheckpointSavesFailing as exc:
        out["stopped"] = str(exc)
    ckpt.close()
    out["saves"] = [[r.step, r.tier, r.error] for r in ckpt.save_results]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
