"""Checkpoint tiers: save and load throughput in MiB/s, and what a save blocks the loop.

One process, a model of `layers` x Linear(width, width) with Adam state (three copies of
the parameters: weights, exp_avg, exp_avg_sq; 26 x 2048 x 2048 is 109M parameters, 1.3 GB
of state). Each figure is set beside a baseline measured in the same run on the same
medium:
- RAM tier (tmpfs, /dev/shm) and durable tier (a directory on disk) against the raw rate
  of writing the same number of bytes in the same number of files (fsynced; as many at a
  time as the tier has writer threads) and reading them back: the medium's physical limit
  here. Durable reads start with the files evicted
  from the page cache (POSIX_FADV_DONTNEED), for the tier and for its baseline alike. A
  tier's save rate is its write (the raw rate's counterpart: bytes already in host
  memory to the medium); the RAM save with the copy to host memory before it is printed
  too.
- the blocking time of an asynchronous save (the time `save` takes plus what the next
  training step's `optimizer.step()` waits for the copy to host memory to finish; one
  forward and backward pass of the model on a batch of 8 runs between them) against a
  synchronous `torch.save` of the same state and a synchronous
  `torch.distributed.checkpoint` save, both to the durable tier's directory.
- a swapped-in node's restore from the partner's copy (peer tier, host monitor to host
  monitor over the peer data channel on loopback) against a restore from durable, when
  the host monitor can be started here (the data channel against raw TCP:
  bench/peer_transfer.py).
"""

from __future__ import annotations

import gc
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.shared_settings import HOST_MONITOR_ENV_PREFIX, host_monitor_env
from training.checkpoint import Checkpointer, CheckpointSettings
from training.checkpoint import format as fmt
from training.checkpoint.peer import PeerTier

MiB = 1024 * 1024


@dataclass(frozen=True)
class CheckpointConfig:
    layers: int = 26
    width: int = 2048
    threads: int = 2
    saves: int = 5
    ram_root: Path = Path("/dev/shm")
    disk_root: Path | None = None  # default: a temporary directory under var/


class HostMonitor:
    """A real `host-monitor` process with the peer tier on, for the peer measurement."""

    def __init__(self, node: str, directory: Path, tokens: dict[str, str]) -> None:
        self.node = node
        self.root = directory / node / Tier.RAM
        self.root.mkdir(parents=True)
        argv = [
            sys.executable, "-m", "host_monitor.cli", "--node", node, "--port", "0",
            "--initial-state", "running", "--job", "bench",
            "--checkpoint-root", str(self.root),
            "--peer-store-dir", str(directory / node / Tier.PEER),
            "--run-dir", str(directory / node / "run"),
        ]  # fmt: skip
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(HOST_MONITOR_ENV_PREFIX)},
            **{host_monitor_env(f"{role}_token"): token for role, token in tokens.items()},
        }
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()  # "host-monitor NODE listening on URL"
        if " listening on " not in line:
            self.proc.kill()
            raise RuntimeError(f"host monitor {node} did not start: {line!r}")
        self.url = line.rsplit(" ", 1)[1]
        self.actuator = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {tokens['actuator']}"}
        )

    def partner(self, other: HostMonitor) -> None:
        body = {"node": other.node, "url": other.url}
        self.actuator.put("/v1/checkpoint-peer", json=body).raise_for_status()

    def stop(self) -> None:
        self.actuator.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def peer_restore(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ram: Path, threads: int
) -> tuple[float, float]:
    """(push MiB/s, restore MiB/s) of a node's checkpoint copied to its partner and
    restored from there by a swapped-in spare with an empty RAM tier."""
    tokens = {role: secrets.token_hex(16) for role in ("actuator", "worker", Tier.PEER)}
    monitors = [
        HostMonitor(node, ram / Tier.PEER, tokens) for node in ("node-b", "node-a", "spare")
    ]
    try:
        b, a, spare = monitors
        b.partner(a)
        spare.partner(a)  # the spare takes node-b's place: its partner is node-b's
        settings = CheckpointSettings(
            in_memory_checkpointing_freq=1, s3_checkpointing_freq=0, ckpt_threads_per_rank=threads
        )
        on_b = Checkpointer(
            model, optimizer, job="bench", settings=settings.with_changes(ram_dir=b.root / "j"),
            peer=PeerTier(b.url, tokens["worker"], 0, fetch_timeout_s=600),
        )  # fmt: skip
        on_b.save(1)
        on_b.wait()
        size = on_b.save_results[-1].size
        worker = httpx.Client(
            base_url=b.url, headers={"Authorization": f"Bearer {tokens['worker']}"}
        )
        deadline = time.monotonic() + 600
        while True:
            state = worker.get("/v1/workers/0/checkpoints/replicate").json()
            if state["state"] in ("done", "failed") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        worker.close()
        if state["state"] != "done":
            raise RuntimeError(f"the push to the partner did not finish: {state}")
        on_spare = Checkpointer(
            model, optimizer, job="bench",
            settings=settings.with_changes(ram_dir=spare.root / "j"),
            peer=PeerTier(spare.url, tokens["worker"], 0, fetch_timeout_s=600),
        )  # fmt: skip
        started = time.perf_counter()
        on_spare.restore()
        seconds = time.perf_counter() - started
        assert on_spare.last_restore is not None and on_spare.last_restore.tier == Tier.PEER
        on_b.close()
        on_spare.close()
        return size / MiB / state["seconds"], size / MiB / seconds
    finally:
        for monitor in monitors:
            monitor.stop()


@dataclass
class CheckpointResult:
    params: int = 0
    state_bytes: int = 0
    raw: dict[str, float] = field(default_factory=dict)  # "ram write" -> MiB/s
    tier: dict[str, float] = field(default_factory=dict)  # "ram save" -> MiB/s
    blocking_s: list[float] = field(default_factory=list)
    sync_torch_save_s: float = 0.0
    sync_dcp_save_s: float = 0.0
    peer_push: float | None = None  # MiB/s, host monitor to host monitor
    peer_load: float | None = None  # MiB/s, a spare's restore from the partner's copy
    peer_error: str | None = None


def _model(config: CheckpointConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Linear(config.width, config.width, bias=False) for _ in range(config.layers))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # creates exp_avg and exp_avg_sq
    model.zero_grad(set_to_none=True)
    return model, optimizer


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    """One step of the training loop the save overlaps with."""
    loss = model(torch.randn(8, width)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _evict(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_rates(
    directory: Path, nbytes: int, files: int, *, evict: bool, threads: int
) -> tuple[float, float]:
    """(write, read) MiB/s of `nbytes` in `files` fresh files, fsynced, `threads` files at
    a time: the parallelism the tier's writers and readers have (`ckpt_threads_per_rank`),
    so that the baseline is the medium's limit for them, not for one thread.

    Written from, and read back into, one buffer of the full size allocated and touched
    beforehand: what a loader that reads straight into the model's existing tensors
    would do, and nothing less (reading into one small reused buffer would measure a
    read that puts the data nowhere)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    per_file = nbytes // files
    buffer = bytearray(os.urandom(MiB) * (per_file // MiB + 1))[:per_file]
    view = memoryview(buffer)

    def write(i: int) -> None:
        with open(directory / f"raw-{i}", "wb", buffering=0) as f:
            f.write(view)
            os.fsync(f.fileno())

    into = [bytearray(per_file) for _ in range(files)]  # touched: zero-filled here

    def read(i: int) -> None:
        target = memoryview(into[i])
        with open(directory / f"raw-{i}", "rb", buffering=0) as f:
            done = 0
            while done < per_file and (n := f.readinto(target[done:])):
                done += n

    with ThreadPoolExecutor(max(1, threads)) as pool:
        started = time.perf_counter()
        list(pool.map(write, range(files)))
        write_rate = nbytes / MiB / (time.perf_counter() - started)
        if evict:
            _evict(directory)
        started = time.perf_counter()
        list(pool.map(read, range(files)))
        read_rate = nbytes / MiB / (time.perf_counter() - started)
    shutil.rmtree(directory, ignore_errors=True)
    return write_rate, read_rate


@contextmanager
def _directories(config: CheckpointConfig) -> Iterator[tuple[Path, Path]]:
    ram = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=config.ram_root))
    disk_parent = config.disk_root or Path("var")
    disk_parent.mkdir(parents=True, exist_ok=True)
    disk = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=disk_parent))
    try:
        yield ram, disk
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def _load_rate(ckpt: Checkpointer, nbytes: int, tier: str) -> float:
    started = time.perf_counter()
    ckpt.restore()
    seconds = time.perf_counter() - started
    assert ckpt.last_restore is not None and ckpt.last_restore.tier == tier, ckpt.last_restore
    return nbytes / MiB / seconds


def run(config: CheckpointConfig) -> CheckpointResult:
    """Warm-up saves first (the staging buffers are allocated once; in a long run a save
    reuses the memory the previous one freed), then `saves` rounds, each measuring the
    media's raw rates, one save to both tiers and a load from each, back to back, so that
    the tier and its baseline see the same machine. Medians over the rounds."""
    result = CheckpointResult()
    model, optimizer = _model(config)
    result.params = sum(p.numel() for p in model.parameters())
    samples: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    with _directories(config) as (ram, disk):
        settings = CheckpointSettings(
            in_memory_checkpointing_freq=1,
            s3_checkpointing_freq=1,
            ram_dir=ram / "tier",
            durable_dir=disk / "tier",
            ckpt_threads_per_rank=config.threads,
            topk_ckpt=1,
        )
        no_peer = PeerTier(None, None, 0, fetch_timeout_s=1)
        ckpt = Checkpointer(model, optimizer, settings=settings, peer=no_peer, job="bench")
        restorer = Checkpointer(model, optimizer, settings=settings, peer=no_peer, job="bench")
        for step in (1, 2):  # warm-up
            ckpt.save(step, to_ram=True, to_durable=True)
            ckpt.wait()
        for round_ in range(config.saves):
            step = 3 + 2 * round_
            nbytes = ckpt.save_results[-1].size
            newest = fmt.committed_steps(disk / "tier", 0)[-1]
            files = len(fmt.read_manifest(fmt.rank_dir(disk / "tier", newest, 0)).files)
            # The raw rates and the save alternate which goes first, so that neither
            # always finds the page cache the other left (dirty pages being written back).
            for first_raw in (round_ % 2 == 0, round_ % 2 == 1):
                if first_raw:
                    w, r = raw_rates(
                        ram / "raw", nbytes, files, evict=False, threads=config.threads
                    )
                    add("raw ram write", w)
                    add("raw ram read", r)
                    w, r = raw_rates(
                        disk / "raw", nbytes, files, evict=True, threads=config.threads
                    )
                    add("raw durable write", w)
                    add("raw durable read", r)
                    continue
                # Throughput: a save with nothing else running, as the raw rates ran.
                first = len(ckpt.save_results)
                ckpt.save(step, to_ram=True, to_durable=True)
                ckpt.wait()
                for saved in ckpt.save_results[first:]:
                    assert saved.error is None and saved.write_s, saved.error
                    # The tier's rate: its write, as the raw rate measures the medium's.
                    add(f"{saved.tier} save", saved.size / MiB / saved.write_s)
                    if saved.tier == Tier.RAM:  # and with the copy to host memory before it
                        add("ram save with staging", saved.size / MiB / saved.total_s)
            result.state_bytes = nbytes = ckpt.save_results[-1].size
            add("ram load", _load_rate(restorer, nbytes, Tier.RAM))
            # A node whose RAM tier is gone reads the durable copy, from the disk itself.
            shutil.rmtree(ram / "tier" / fmt.step_dir(Path(), step).name)
            _evict(disk / "tier")
            add("durable load", _load_rate(restorer, nbytes, Tier.DURABLE))
            # Blocking: a save followed by a training step, as in a training loop.
            ckpt.save(step + 1, to_ram=True)
            _train_step(model, optimizer, config.width)  # its optimizer step may wait
            result.blocking_s.append(ckpt.blocking[-1])
            ckpt.wait()
        for key, values in samples.items():
            target = result.raw if key.startswith("raw ") else result.tier
            target[key.removeprefix("raw ")] = statistics.median(values)
        # Synchronous baselines of the same state, to the durable tier's directory.
        state = ckpt.state.state_dict(0)
        started = time.perf_counter()
        with open(disk / "torch-save.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        result.sync_torch_save_s = time.perf_counter() - started
        (disk / "torch-save.pt").unlink()
        started = time.perf_counter()
        dcp_save(
            state,
            storage_writer=FileSystemWriter(disk / "dcp-sync", thread_count=config.threads),
            no_dist=True,
        )
        result.sync_dcp_save_s = time.perf_counter() - started
        del state
        shutil.rmtree(disk / "dcp-sync", ignore_errors=True)
        ckpt.close()
        restorer.close()
        try:
            result.peer_push, result.peer_load = peer_restore(model, optimizer, ram, config.threads)
        except (RuntimeError, OSError, httpx.HTTPError) as exc:
            result.peer_error = f"{type(exc).__name__}: {exc}"
    del model, optimizer, ckpt, restorer
    gc.collect()
    return result
