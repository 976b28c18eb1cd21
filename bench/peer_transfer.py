"""The peer tier's data plane against the wire: MiB/s of a checkpoint copied host monitor
to host monitor (a push) and from a host monitor into a spare rank's RAM tier (a fetch),
beside raw loopback TCP measured in the same run, in alternation, round after round.

Raw loopback TCP is the best one stream does here: `sendfile` from a tmpfs file into
`recv_into` a preallocated buffer, written to a tmpfs file (what a copy has to do at
the least, without protocol or checksum). Each round measures raw, a push and a fetch,
the order turning from round to round so that none always finds the machine the other
left; medians over the rounds. A push's time is the host monitor's own (`seconds` of
the push's state: from the first byte asked for to the commit); a fetch's is the rank's
whole `PeerTier.fetch` (training/checkpoint/peer.py: the lookups, the files relayed by
its host monitor from the partner, each checked, the commit). CPU seconds per GiB moved
of the host monitors come from /proc, the rank's from this process. The same again with
TLS on (certificates made here), for its cost.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import httpx

from bench.bucket_restore import BucketRestore
from resiliency_protocol.checkpoint_manifest import MANIFEST, FileEntry, Manifest
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.shared_settings import HOST_MONITOR_ENV_PREFIX, host_monitor_env
from training.checkpoint.peer import PeerTier as WorkerPeerTier

MiB = 1024 * 1024
GiB = 1024 * MiB
TICK = os.sysconf("SC_CLK_TCK")
SERVER_NAME = "host-monitor.bench.svc"


@dataclass(frozen=True)
class PeerTransferConfig:
    file_bytes: int = 512 * MiB
    files: int = 2
    rounds: int = 5
    root: Path = Path("/dev/shm")
    tls: bool = True
    #: Also restore the spare from an object store (SeaweedFS, its volumes on disk under
    #: `store_root`): the same step, in the same rounds (bench/bucket_restore.py).
    bucket: bool = True
    store_root: Path | None = None


@dataclass
class PeerTransferResult:
    nbytes: int = 0
    rates: dict[str, list[float]] = field(default_factory=dict)  # "push" -> MiB/s per round
    cpu: dict[str, list[float]] = field(default_factory=dict)  # "push sender" -> s/GiB
    error: str | None = None

    def median(self, key: str) -> float:
        return statistics.median(self.rates[key])

    def cpu_median(self, key: str) -> float:
        return statistics.median(self.cpu[key])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


class Monitor:
    """A real `host-monitor` process with the peer tier on."""

    def __init__(self, node: str, directory: Path, tokens: dict[str, str], tls: Tls | None):
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
        if tls is not None:
            argv += [
                "--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key),
                "--tls-ca-file", str(tls.ca), "--tls-server-name", SERVER_NAME,
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
        self.worker_token = tokens["worker"]
        verify: ssl.SSLContext | bool = True
        if tls is not None:
            verify = ssl.create_default_context(cafile=str(tls.ca))
            verify.check_hostname = False  # reached at 127.0.0.1: the name is not checked
        self.actuator = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {tokens['actuator']}"},
            verify=verify,
        )
        self.worker = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {tokens['worker']}"},
            verify=verify,
            timeout=600,
        )

    def partner(self, other: Monitor) -> None:
        body = {"node": other.node, "url": other.url}
        self.actuator.put("/v1/checkpoint-peer", json=body).raise_for_status()

    def cpu_s(self) -> float:
        return _cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.actuator.close()
        self.worker.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@dataclass(frozen=True)
class Tls:
    ca: Path
    cert: Path
    key: Path


def _make_tls(directory: Path) -> Tls | None:
    try:
        import trustme
    except ImportError:
        return None
    ca = trustme.CA()
    issued = ca.issue_cert(SERVER_NAME)
    tls = Tls(directory / "ca.crt", directory / "monitor.crt", directory / "monitor.key")
    ca.cert_pem.write_to_path(str(tls.ca))
    issued.cert_chain_pems[0].write_to_path(str(tls.cert))
    issued.private_key_pem.write_to_path(str(tls.key))
    return tls


def _write_checkpoint(directory: Path, step: int, files: list[Path]) -> Path:
    """A committed rank directory of `step` whose files are hard links to `files`."""
    rank_dir = directory / f"step-{step:010d}" / "rank-0"
    rank_dir.mkdir(parents=True)
    entries = {}
    for source in files:
        os.link(source, rank_dir / source.name)
        entries[source.name] = FileEntry(size=source.stat().st_size, crc32c=int(source.stem[5:]))
    manifest = Manifest(
        step=step, rank=0, world_size=1, job="bench", files=entries, created=time.time()
    )
    (rank_dir / MANIFEST).write_text(manifest.to_json())
    return rank_dir


def _source_files(directory: Path, config: PeerTransferConfig) -> list[Path]:
    """Random-looking files of `file_bytes` each, named with their CRC-32C."""
    directory.mkdir(parents=True)
    block = os.urandom(MiB)
    files = []
    for i in range(config.files):
        data = bytes([i]) * 64 + block[64:]
        whole = data * (config.file_bytes // MiB)
        path = directory / f"shard{crc32c.crc32c(whole)}.distcp"
        path.write_bytes(whole)
        files.append(path)
    return files


# The sending side of the raw baseline, in a process of its own as a host monitor is:
# argv port, CA file or "", then the files; one connection and thread per file; prints
# the CPU seconds its threads spent sending.
_SENDER = r"""
import os, socket, ssl, sys, threading, time
from host_monitor.peer.wire import configure, send_file
port, ca, files = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
context = ssl.create_default_context(cafile=ca) if ca else None
cpu = []
def send(path):
    sock = socket.create_connection(("127.0.0.1", port))
    configure(sock, 60)
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname="%s")
    fd = os.open(path, os.O_RDONLY)
    started = time.thread_time()
    send_file(sock, fd, os.fstat(fd).st_size)
    cpu.append(time.thread_time() - started)
    sock.recv(1)  # the receiver's close: closing first could reset what is in flight
    os.close(fd)
    sock.close()
threads = [threading.Thread(target=send, args=(f,)) for f in files]
for t in threads: t.start()
for t in threads: t.join()
print(sum(cpu))
"""


def raw_tcp(sources: list[Path], directory: Path, tls: Tls | None) -> tuple[float, float, float]:
    """(Seconds, sender CPU s, receiver CPU s) of loopback TCP moving `sources`, one stream
    each, all at once (as the tier moves a copy's files), from another process (as
    between host monitors): sent with `sendfile` (through a buffer with TLS) into
    `recv_into` a preallocated buffer, written to a file in `directory`."""
    from host_monitor.peer.wire import BUFFER, configure, recv_file

    context = None
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.cert, tls.key)
    listener = socket.create_server(("127.0.0.1", 0), backlog=len(sources))
    port = listener.getsockname()[1]
    script = _SENDER % SERVER_NAME
    argv = [sys.executable, "-c", script, str(port), str(tls.ca) if tls else ""]
    sender = subprocess.Popen([*argv, *map(str, sources)], stdout=subprocess.PIPE, text=True)
    connections = []
    try:
        for _ in sources:
            conn, _ = listener.accept()
            configure(conn, 60)
            connections.append(context.wrap_socket(conn, server_side=True) if context else conn)
        # The sender sent each connection's file in the order it connected: sizes are equal.
        cpu: list[float] = []

        def receive(index: int, sock: socket.socket) -> None:
            size = sources[index].stat().st_size
            dest = directory / f"raw-{index}.out"
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                started = time.thread_time()
                recv_file(sock, fd, size, lambda _data, crc: crc, bytearray(BUFFER))  # no sum
                cpu.append(time.thread_time() - started)
            finally:
                os.close(fd)
                dest.unlink()
                sock.close()

        threads = [
            threading.Thread(target=receive, args=(i, sock)) for i, sock in enumerate(connections)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        out, _ = sender.communicate(timeout=60)
    finally:
        for sock in connections:
            sock.close()
        listener.close()
        if sender.poll() is None:
            sender.kill()
        sender.wait()
    if len(cpu) != len(sources):
        raise RuntimeError("the raw TCP baseline did not receive every file")
    return seconds, float(out.strip() or 0), sum(cpu)


@contextmanager
def _monitors(directory: Path, tls: Tls | None) -> Iterator[tuple[Monitor, Monitor, Monitor]]:
    tokens = {role: secrets.token_hex(16) for role in ("actuator", "worker", Tier.PEER)}
    started: list[Monitor] = []
    try:
        for node in ("node-a", "node-b", "spare"):
            started.append(Monitor(node, directory, tokens, tls))
        a, b, spare = started
        a.partner(b)
        spare.partner(b)  # the spare takes node-a's place: its partner is node-a's
        yield a, b, spare
    finally:
        for monitor in started:
            monitor.stop()


def _rounds(
    config: PeerTransferConfig,
    result: PeerTransferResult,
    directory: Path,
    files: list[Path],
    tls: Tls | None,
    bucket: BucketRestore | None = None,
) -> None:
    suffix = " tls" if tls is not None else ""
    with _monitors(directory, tls) as (a, b, spare):
        tier = a.root / "tier"
        dest = spare.root / "tier"

        warm = [False]  # the first push and fetch are not recorded

        def add(key: str, value: float) -> None:
            if warm[0]:
                result.rates.setdefault(key + suffix, []).append(value)

        def cpu(key: str, seconds: float) -> None:
            if warm[0]:
                result.cpu.setdefault(key + suffix, []).append(seconds / (result.nbytes / GiB))

        def raw() -> None:
            seconds, sender, receiver = raw_tcp(files, directory, tls)
            add("raw", result.nbytes / MiB / seconds)
            cpu("raw sender", sender)
            cpu("raw receiver", receiver)

        def push(step: int) -> None:
            saved = _write_checkpoint(tier, step, files)
            cpu_a, cpu_b = a.cpu_s(), b.cpu_s()
            body = {"step": step, "path": str(saved)}
            a.worker.post("/v1/workers/0/checkpoints/replicate", json=body).raise_for_status()
            deadline = time.monotonic() + 600
            while True:
                state = a.worker.get("/v1/workers/0/checkpoints/replicate").json()
                if state["step"] == step and state["state"] in ("done", "failed"):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"push of step {step} did not finish: {state}")
                time.sleep(0.02)
            if state["state"] != "done":
                raise RuntimeError(f"push of step {step} failed: {state['error']}")
            add("push", result.nbytes / MiB / state["seconds"])
            cpu("push sender", a.cpu_s() - cpu_a)
            cpu("push receiver", b.cpu_s() - cpu_b)
            if bucket is not None:
                bucket.upload(saved, step)  # the same step in the bucket, for `restore`
            shutil.rmtree(saved.parent)

        def from_bucket(step: int) -> None:
            # The spare's rank restoring the same step from the object store instead.
            assert bucket is not None
            add("bucket", result.nbytes / MiB / bucket.restore(step, dest))
            shutil.rmtree(dest)

        # The spare's rank: it receives the copy into its RAM tier, relayed by its host
        # monitor (training/checkpoint/peer.py).
        rank = WorkerPeerTier(
            spare.url,
            spare.worker_token,
            0,
            fetch_timeout_s=600,
            ca_file=str(tls.ca) if tls is not None else None,
            server_name=SERVER_NAME if tls is not None else None,
        )

        def fetch(step: int) -> None:
            cpu_b, cpu_s, cpu_rank = b.cpu_s(), spare.cpu_s(), time.process_time()
            started = time.perf_counter()
            fetched = rank.fetch(step, dest)
            seconds = time.perf_counter() - started
            if fetched is None or not fetched[1]:
                raise RuntimeError(f"fetch of step {step} into the rank's RAM tier failed")
            add("fetch", result.nbytes / MiB / seconds)
            cpu("fetch sender", b.cpu_s() - cpu_b)
            cpu("fetch relay", spare.cpu_s() - cpu_s)
            cpu("fetch receiver", time.process_time() - cpu_rank)
            shutil.rmtree(dest)

        push(1)  # warm-up: connections, the partner's store, page tables
        fetch(1)
        if bucket is not None:
            from_bucket(1)
        warm[0] = True
        orders = (
            ("raw", "push", "fetch", "bucket"),
            ("push", "bucket", "fetch", "raw"),
            ("push", "raw", "bucket", "fetch"),
        )
        for round_ in range(config.rounds):
            step = 2 + round_
            for name in orders[round_ % len(orders)]:  # raw first, last, between
                if name == "raw":
                    raw()
                elif name == "push":
                    push(step)
                elif name == "fetch":
                    fetch(step)
                elif bucket is not None:
                    from_bucket(step)
        rank.close()


def run(config: PeerTransferConfig) -> PeerTransferResult:
    result = PeerTransferResult(nbytes=config.file_bytes // MiB * MiB * config.files)
    directory = Path(tempfile.mkdtemp(prefix="bench-peer-", dir=config.root))
    cleanup = [directory]
    try:
        files = _source_files(directory / "source", config)
        bucket = None
        if config.bucket:
            store_dir = Path(tempfile.mkdtemp(prefix="bench-bucket-", dir=config.store_root))
            cleanup.append(store_dir)
            (directory / "bucket-scratch").mkdir()
            bucket = BucketRestore(store_dir, directory / "bucket-scratch")
        try:
            _rounds(config, result, directory / "plain", files, None, bucket)
        finally:
            if bucket is not None:
                bucket.stop()
        if config.tls:
            tls = _make_tls(directory)
            if tls is not None:
                _rounds(config, result, directory / "tls", files, tls)
    except (RuntimeError, OSError, httpx.HTTPError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
    return result
