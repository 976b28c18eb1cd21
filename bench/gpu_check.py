"""Checks that need an NVIDIA GPU, as one script for a machine that has one.

    PYTHONPATH=. python3 bench/gpu_check.py [--params-m 100] [--spin-s 12] [--cpu]

Imports only the training side and the host monitor's NVML watchdog (torch, pydantic,
msgspec, crc32c, nvidia-ml-py), so that it runs in a GPU image with a few wheels added.

1. NVML against the real driver: the host monitor's NVML watchdog opens, reads a round of
   every counter (those this GPU does not support are listed), and registers for XID
   events.
2. A sharded state (FSDP2 over NCCL; one rank: the state is DTensors all the same) saved
   from GPU memory through the RAM and durable tiers asynchronously: blocking per save
   against a synchronous `dcp.save` of the same state, a restore into a fresh model
   compared bit for bit, and the durable step read back by plain `dcp.load`.
3. An emergency save while the training stream is blocked by a kernel that spins (as a
   collective that never ends blocks it): it must finish long before the kernel does, and
   hold the state of the last completed step. Beside it, the hazard it avoids: a plain
   `.cpu()` copy from another thread waits for the kernel.

Prints one JSON object per check and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.heartbeat import GPU_ECC


def emit(name: str, ok: bool, **figures: Any) -> bool:
    print(json.dumps({"check": name, "ok": ok, **figures}, default=str), flush=True)
    return ok


def check_nvml() -> bool:
    import asyncio

    from host_monitor.watchdogs import GpuReporter
    from host_monitor.watchdogs.nvml import NvmlWatchdog

    delivered: list[Any] = []
    reporter = GpuReporter(cooldown_s=0.0, deliver=delivered.append)
    watchdog, line = NvmlWatchdog.open(reporter, period_s=1.0)
    if watchdog is None:
        return emit("nvml", False, line=line)
    loop = asyncio.new_event_loop()
    try:
        first = watchdog.read()
        second = watchdog.read()  # nothing changed: nothing to report
        events = watchdog.start_events(loop)
        time.sleep(1.5)  # one wait for XID events, which should time out quietly
        unsupported = {gpu: sorted(seen.unsupported) for gpu, seen in watchdog._seen.items()}
        seen = {
            gpu: {GPU_ECC: s.ecc, "remap": s.remap, "nvlink": s.nvlink, "throttle": s.throttle}
            for gpu, s in watchdog._seen.items()
        }
    finally:
        watchdog.close()
        loop.close()
    nvlink_unsupported = {
        gpu: sum(1 for u in names if u.startswith("nvlink")) for gpu, names in unsupported.items()
    }
    return emit(
        "nvml",
        not second,
        line=line,
        first_round=[msgspec.to_builtins(r) for r in first],
        second_round=len(second),
        xid_events_registered=events,
        counters=seen,
        unsupported={
            gpu: [u for u in names if not u.startswith("nvlink")]
            for gpu, names in unsupported.items()
        },
        nvlink_counters_unsupported=nvlink_unsupported,
    )


DEVICE = "cuda"
STEP_PAD_S = 0.5


def build(params_m: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(layers)
        ]
    ).to(DEVICE)
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(step)
    x = torch.randn(64, 2048, device=DEVICE, generator=g)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_sha(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    digest = hashlib.sha256()

    def feed(prefix: str, value: Any) -> None:
        if hasattr(value, "to_local"):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            digest.update(prefix.encode())
            digest.update(
                value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
            )
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                feed(f"{prefix}.{key}", value[key])

    feed("model", model_sd)
    feed("optim", optim_sd.get("state", {}))
    return digest.hexdigest()


def check_sharded_gpu_save(tmp: Path, params_m: int) -> bool:
    from training.checkpoint import Checkpointer, CheckpointSettings
    from training.checkpoint import format as fmt

    settings = CheckpointSettings(
        in_memory_checkpointing_freq=4,
        s3_checkpointing_freq=20,
        ram_dir=tmp / Tier.RAM,
        durable_dir=tmp / Tier.DURABLE,
        enable_peer_ckpt=False,
        ram_topk_ckpt=2,
    )
    model, optimizer = build(params_m, seed=1)
    nparams = sum(p.numel() for p in model.parameters())
    ckpt = Checkpointer(model, optimizer, settings=settings, job="gpu-check", emergency=True)
    assert ckpt.restore() == 0
    hashes: dict[int, str] = {}
    for step in range(1, 21):
        train_step(model, optimizer, step)
        ckpt.step_done(step)
        if step == 20:
            ckpt.wait()
            hashes[step] = state_sha(model, optimizer)
        # Stands for the rest of a step of a model that fills the GPU: the copy of the
        # parameters to host memory overlaps it, as it would overlap a real step.
        time.sleep(STEP_PAD_S)
    ckpt.wait()
    failed = [r for r in ckpt.save_results if r.error]
    blocking = list(ckpt.blocking)
    # A synchronous dcp.save of the same sharded state, from GPU memory.
    sync_s = []
    for i in range(3):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / f"sync-{i}"))
        sync_s.append(time.perf_counter() - started)
        shutil.rmtree(tmp / f"sync-{i}")
    size = fmt.read_manifest(fmt.rank_dir(ckpt.durable_root or tmp, 20, 0)).total_bytes
    ckpt.close()

    # A fresh model restores step 20 (RAM first), bit for bit.
    fresh, fresh_opt = build(params_m, seed=2)
    again = Checkpointer(fresh, fresh_opt, settings=settings, job="gpu-check", emergency=False)
    restored = again.restore()
    restored_sha = state_sha(fresh, fresh_opt)
    again.close()

    # Plain DCP reads the durable step (global metadata), without this package's reader.
    plain, plain_opt = build(params_m, seed=3)
    train_step(plain, plain_opt, 0)  # an optimizer state to load into
    model_sd, optim_sd = get_state_dict(plain, plain_opt)
    target = {"model": model_sd, "optim": optim_sd}
    durable_step = fmt.step_dir(tmp / Tier.DURABLE, 20)
    plain_error = None
    try:
        dcp_load(target, checkpoint_id=str(durable_step))
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(plain, plain_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        plain_sha = state_sha(plain, plain_opt)
    except Exception as exc:  # reported, not raised: the other checks still run
        plain_sha, plain_error = "", repr(exc)
    mean_sync = sum(sync_s) / len(sync_s)
    # The first save allocates the staging buffers (page faults): the steady state after.
    worst_blocking = max(blocking[1:])
    return emit(
        "sharded_gpu_save",
        not failed
        and restored == 20
        and restored_sha == hashes[20]
        and plain_sha == hashes[20]
        and worst_blocking <= 0.10 * mean_sync,
        params=nparams,
        state_bytes=size,
        saves=len(ckpt.save_results),
        failed=[f"{r.step}/{r.tier}: {r.error}" for r in failed],
        blocking_s=[round(b, 4) for b in blocking],
        sync_dcp_save_s=[round(s, 3) for s in sync_s],
        worst_blocking_pct_of_sync=round(100 * worst_blocking / mean_sync, 2),
        restored_step=restored,
        restore_bit_identical=restored_sha == hashes[20],
        plain_dcp_load_bit_identical=plain_sha == hashes[20],
        plain_dcp_load_error=plain_error,
    )


def spin_cycles_per_s() -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(  # type: ignore[no-untyped-call]
        200_000_000
    )
    torch.cuda.synchronize()
    return 200_000_000 / (time.perf_counter() - started)


def check_emergency_with_blocked_stream(tmp: Path, params_m: int, spin_s: float) -> bool:
    from training.checkpoint import Checkpointer, CheckpointSettings
    from training.checkpoint import format as fmt

    settings = CheckpointSettings(
        in_memory_checkpointing_freq=5,
        s3_checkpointing_freq=0,
        ram_dir=tmp / "ram-e",
        enable_peer_ckpt=False,
        emergency_checkpoint_timeout_s=4 * spin_s,
    )
    model, optimizer = build(params_m, seed=1)
    ckpt = Checkpointer(model, optimizer, settings=settings, job="gpu-emergency", emergency=True)
    ckpt.restore()
    for step in range(1, 7):  # a periodic save at 5; step 6 is in no tier
        train_step(model, optimizer, step)
        ckpt.step_done(step)
    ckpt.wait()
    torch.cuda.synchronize()
    expected = state_sha(model, optimizer)
    rate = spin_cycles_per_s()

    # The hazard: a copy from another thread on the default stream waits for the kernel.
    probe = next(model.parameters()).to_local()  # type: ignore[attr-defined]
    torch.cuda._sleep(  # type: ignore[no-untyped-call]
        int(rate * spin_s / 3)
    )
    plain: dict[str, float] = {}

    def plain_copy() -> None:
        started = time.perf_counter()
        probe.cpu()
        plain["s"] = time.perf_counter() - started

    thread = threading.Thread(target=plain_copy)
    thread.start()
    thread.join()
    torch.cuda.synchronize()

    # The training stream blocked for spin_s, step 7's forward and backward queued behind.
    torch.cuda._sleep(  # type: ignore[no-untyped-call]
        int(rate * spin_s)
    )
    g = torch.Generator(device="cuda").manual_seed(7)
    model(torch.randn(64, 2048, device="cuda", generator=g)).square().mean().backward()
    outcome: dict[str, Any] = {}

    def rescue() -> None:
        started = time.perf_counter()
        try:
            outcome["step"] = ckpt.emergency_save()
        except Exception as exc:
            outcome["error"] = repr(exc)
        outcome["s"] = time.perf_counter() - started

    thread = threading.Thread(target=rescue)
    thread.start()
    thread.join(timeout=4 * spin_s)
    torch.cuda.synchronize()  # the spin ends
    thread.join()
    optimizer.zero_grad(set_to_none=True)

    fresh, fresh_opt = build(params_m, seed=2)
    again = Checkpointer(fresh, fresh_opt, settings=settings, job="gpu-emergency", emergency=False)
    restored = again.restore()
    restored_sha = state_sha(fresh, fresh_opt)
    again.close()
    ckpt.close()
    committed = fmt.committed_steps(tmp / "ram-e", 0)
    return emit(
        "emergency_with_blocked_stream",
        outcome.get("step") == 6
        and outcome["s"] < spin_s / 2
        and restored == 6
        and restored_sha == expected,
        spin_s=spin_s,
        plain_cpu_copy_from_other_thread_s=round(plain["s"], 3),
        emergency_save_s=round(outcome.get("s", -1), 3),
        emergency=outcome,
        committed_ram_steps=committed,
        restored_step=restored,
        bit_identical=restored_sha == expected,
    )


def main() -> int:
    global DEVICE, STEP_PAD_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=int, default=100)
    parser.add_argument("--spin-s", type=float, default=12.0)
    parser.add_argument(
        "--step-pad-s",
        type=float,
        default=STEP_PAD_S,
        help="seconds added to each step of check 2, for the compute of a bigger model",
    )
    parser.add_argument("--tmp", default=None, help="scratch directory (default: a temp one)")
    parser.add_argument(
        "--cpu", action="store_true", help="a dry run of check 2 on CPU (gloo), no GPU needed"
    )
    args = parser.parse_args()
    STEP_PAD_S = args.step_pad_s
    ok = True
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="gpu-check-"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.cpu:
        DEVICE = "cpu"
        dist.init_process_group("gloo", rank=0, world_size=1)
        checks: list[Callable[[], bool]] = [lambda: check_sharded_gpu_save(tmp, args.params_m)]
    else:
        if not torch.cuda.is_available():
            print("no CUDA device here (--cpu for a dry run)", file=sys.stderr)
            return 2
        print(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0),
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
                }
            ),
            flush=True,
        )
        try:
            ok &= check_nvml()
        except Exception as exc:
            ok &= emit("nvml", False, error=repr(exc))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
        checks = [
            lambda: check_sharded_gpu_save(tmp, args.params_m),
            lambda: check_emergency_with_blocked_stream(tmp, args.params_m, args.spin_s),
        ]
    try:
        for check in checks:
            try:
                ok &= check()
            except Exception as exc:
                import traceback

                traceback.print_exc()
                ok &= emit("error", False, error=repr(exc))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
