"""Sharded checkpoints: an FSDP2 job of 4 ranks (gloo, one process each) saving through the
tiers, and its state restored resharded onto 2 ranks.

Each rank runs bench/sharded_worker.py. Figures, each beside its baseline from the same
run: the blocking time of an asynchronous save against a synchronous collective
`torch.distributed.checkpoint.save` of the same sharded state; save and load rates per
tier summed over the ranks (bytes of every rank over the slowest rank's seconds); a
restore resharded from 4 ranks to 2 against a restore in the same layout (4 ranks), both
by new processes from the same durable directory.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resiliency_protocol.checkpoint_reports import Tier

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ShardedConfig:
    layers: int = 26
    width: int = 2048  # 26 x 2048 x 2048: 109M parameters, 1.3 GB with Adam's state
    world: int = 4
    resharded_world: int = 2
    saves: int = 3
    threads: int = 2
    ram_root: Path = Path("/dev/shm")
    disk_root: Path | None = None  # default: a temporary directory under var/


@dataclass(frozen=True)
class ShardedResult:
    params: int
    state_bytes: int
    blocking_s: list[float]  # per save, the slowest rank's
    sync_dcp_save_s: float
    save_mib_s: dict[str, float]  # tier -> summed over ranks, median over saves
    ram_load_mib_s: float
    durable_load_mib_s: float
    same_layout_restore_s: float
    resharded_restore_s: float
    resharded_tier: str | None
    step_s: float  # a training step without checkpoints (slowest rank)
    step_with_ram_save_s: float  # with a RAM save every step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run(world: int, mode: str, cfg: ShardedConfig, work: Path, ram: Path) -> list[dict[str, Any]]:
    out = work / f"out-{mode}-{world}"
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))},
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "LAYERS": str(cfg.layers),
            "WIDTH": str(cfg.width),
            "SAVES": str(cfg.saves),
            "THREADS": str(cfg.threads),
            "BENCH_MODE": mode,
            "BENCH_DIR": str(work),
            "BENCH_RAM": str(ram / f"{mode}-{world}"),
            "BENCH_OUT": str(out),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.sharded_worker"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            for other in procs:
                other.kill()
            raise RuntimeError(f"rank {rank} of the {mode} run exited {proc.returncode}:\n{output}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def run(cfg: ShardedConfig) -> ShardedResult:
    base = cfg.disk_root or ROOT / "var"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=base))
    ram = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=cfg.ram_root))
    try:
        saved = _run(cfg.world, "save", cfg, work, ram)
        # Both restores in new processes, from durable: a fresh optimizer's state is made
        # first (DCP's helper steps it once), in either layout.
        same = _run(cfg.world, "restore", cfg, work, ram)
        resharded = _run(cfg.resharded_world, "restore", cfg, work, ram)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
    saves = len(saved[0]["blocking_s"])
    blocking = [max(r["blocking_s"][i] for r in saved) for i in range(saves)]
    rates: dict[str, float] = {}
    for tier in (Tier.RAM, Tier.DURABLE):
        per_save = []
        for i in range(saves):
            results = [[s for s in r["saves"] if s["tier"] == tier][i] for r in saved]
            total = sum(s["size"] for s in results)
            per_save.append(total / MiB / max(s["write_s"] for s in results))
        rates[tier] = statistics.median(per_save)
    state_bytes = sum(r["restored_bytes"] for r in saved)
    params = cfg.layers * cfg.width * cfg.width
    return ShardedResult(
        params=params,
        state_bytes=state_bytes,
        blocking_s=blocking,
        sync_dcp_save_s=max(r["sync_dcp_save_s"] for r in saved),
        save_mib_s=rates,
        ram_load_mib_s=state_bytes / MiB / saved[0]["ram_restore_s"],
        durable_load_mib_s=state_bytes / MiB / saved[0]["durable_restore_s"],
        same_layout_restore_s=same[0]["resharded_restore_s"],
        resharded_restore_s=resharded[0]["resharded_restore_s"],
        resharded_tier=resharded[0]["resharded_restore_tier"],
        step_s=max(r["step_s"] for r in saved),
        step_with_ram_save_s=max(r["step_with_ram_save_s"] for r in saved),
    )
