"""The demo training workload as real processes: 2 replicas x 2 nodes, killed, signalled,
restarted, with no host monitor (offline worker client)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.test_worker_client import RecordingServer
from tests.timing import scaled
from training.npz_format import checkpoint_file, read_checkpoint
from training.numpy_workload.checkpoint import CheckpointStore
from training.numpy_workload.model import init_state

REPO = Path(__file__).resolve().parents[1]
R, N = 2, 2
WORLD = R * N
TOTAL = 40
SEED = 7
STEP_RE = re.compile(r": step=(\d+)/")


class Job:
    """The 4 worker processes of one attempt, with their logs."""

    def __init__(
        self,
        run: Path,
        attempt: int,
        *,
        total: int = TOTAL,
        step_time_s: float = 0.002,
        nodes: dict[int, str] | None = None,
        ranks: range = range(WORLD),
        replicas: int = R,
        **extra: str,
    ) -> None:
        self.run = run
        self.attempt = attempt
        self.logs: dict[int, Path] = {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        (run / "logs").mkdir(parents=True, exist_ok=True)
        for rank in ranks:
            node = (nodes or {}).get(rank, f"node-{rank}")
            env = {
                **os.environ,
                "RANK": str(rank),
                "NUM_DP_REPLICAS": str(replicas),
                "NUM_NODES_PER_DP": str(N),
                "WORLD_SIZE": str(replicas * N),
                "SEED": str(SEED),
                "TOTAL_STEPS": str(total),
                "STEP_TIME_S": str(step_time_s),
                "RUN_DIR": str(run / "job"),
                "WORKLOAD_ATTEMPT": str(attempt),
                "LOCAL_CKPT_DIR": str(run / "nodes" / node / "checkpoints"),
                "DURABLE_CKPT_DIR": str(run / "durable"),
                "OUTPUT_DIR": str(run / "output"),
                "IN_MEMORY_CHECKPOINTING_FREQ": "5",
                "S3_CHECKPOINTING_FREQ": "10",
                "LOG_EVERY_STEPS": "1",
                "PYTHONPATH": str(REPO),
                **extra,
            }
            for var in (
                "HOST_MONITOR_URL",
                "HOST_MONITOR_WORKER_TOKEN",
                "HOST_MONITOR_REQUEST_FILE",
            ):
                if var not in extra:
                    env.pop(var, None)
            log = run / "logs" / f"attempt-{attempt}-rank-{rank}.log"
            self.logs[rank] = log
            with open(log, "wb") as out:
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "training.numpy_workload"],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def steps(self, rank: int) -> list[int]:
        return [int(m) for m in STEP_RE.findall(self.log(rank))]

    def furthest(self) -> int:
        return max((max(self.steps(r), default=0) for r in self.procs), default=0)

    def wait(self, timeout: float = 30.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        for rank, proc in self.procs.items():
            try:
                codes[rank] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                logs = "\n".join(self.log(r)[-2000:] for r in self.procs)
                raise AssertionError(f"rank {rank} did not exit in time:\n{logs}") from None
        return codes

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def finish(self) -> None:
        codes = self.wait()
        assert codes == dict.fromkeys(self.procs, 0), {r: self.log(r)[-2000:] for r in codes}

    def resumed_step(self, rank: int) -> tuple[int, str] | None:
        match = re.search(r"resumed step=(\d+) tier=(\w+)", self.log(rank))
        return (int(match.group(1)), match.group(2)) if match else None


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    """Every job a test starts; whatever still runs at the end is killed."""
    started: list[Job] = []
    try:
        yield started
    finally:
        for job in started:
            job.kill()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def outputs(run: Path) -> list[np.ndarray]:
    return [np.load(run / "output" / f"shard-{k}.npy") for k in range(N)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    """The final weights of an uninterrupted run."""
    run = tmp_path_factory.mktemp("reference")
    job = Job(run, 0)
    try:
        job.finish()
    finally:
        job.kill()
    assert job.furthest() == TOTAL
    return outputs(run)


def assert_equal(run: Path, reference: list[np.ndarray]) -> None:
    for got, want in zip(outputs(run), reference, strict=True):
        assert got.dtype == np.float64
        assert np.array_equal(got, want)


def assert_no_complete_looking_leftovers(root: Path) -> None:
    """Every file with a checkpoint's final name verifies; only hidden tmp files remain."""
    for path in root.rglob("*.npz"):
        if not path.name.startswith("."):
            assert read_checkpoint(path) is not None, path


def test_two_runs_with_the_same_seed_are_bit_identical(
    tmp_path: Path, reference: list[np.ndarray], jobs: list[Job]
) -> None:
    jobs.append(job := Job(tmp_path, 0, IN_MEMORY_CHECKPOINTING_FREQ="0"))
    job.finish()
    assert_equal(tmp_path, reference)
    # The shards learned something, and differ from each other and from the start.
    start = init_state(SEED, 0, 64).w
    assert not np.array_equal(reference[0], start)
    assert not np.array_equal(reference[0], reference[1])


def kill_rank0_mid_run(tmp_path: Path, jobs: list[Job]) -> Job:
    """Start 4 workers, SIGKILL rank 0 (replica 0) mid-run, let the others block."""
    jobs.append(job := Job(tmp_path, 0, step_time_s=0.01))
    assert wait_for(lambda: max(job.steps(0), default=0) >= 12), job.log(0)
    job.procs[0].send_signal(signal.SIGKILL)
    job.procs[0].wait()
    # The survivors block in the next all-reduce: no new step for a while.
    seen = -1
    while (now := job.furthest()) != seen:
        seen = now
        time.sleep(0.3)
    assert job.furthest() < TOTAL
    assert all(job.procs[r].poll() is None for r in (1, 2, 3))
    return job


def test_emergency_checkpoint_then_resume_is_exact(
    tmp_path: Path, reference: list[np.ndarray], jobs: list[Job]
) -> None:
    job = kill_rank0_mid_run(tmp_path, jobs)
    furthest = job.furthest()
    for rank in (1, 2, 3):
        job.procs[rank].send_signal(signal.SIGUSR1)
    pattern = re.compile(r"emergency checkpoint saved step=(\d+) tier=emergency")
    assert wait_for(lambda: all(pattern.search(job.log(r)) for r in (1, 2, 3)))
    steps = {int(pattern.findall(job.log(r))[0]) for r in (1, 2, 3)}
    assert len(steps) == 1, steps
    (emergency,) = steps
    assert furthest - 1 <= emergency <= furthest
    for shard in range(N):
        path = checkpoint_file(tmp_path / "durable" / "emergency", emergency, shard, N)
        data = read_checkpoint(path, step=emergency, shard=shard, num_shards=N)
        assert data is not None, path

    for rank in (1, 2, 3):
        job.procs[rank].send_signal(signal.SIGTERM)
    codes = job.wait(10)
    assert codes == {0: -signal.SIGKILL, 1: 143, 2: 143, 3: 143}
    assert_no_complete_looking_leftovers(tmp_path)

    jobs.append(again := Job(tmp_path, 1))
    again.finish()
    assert {again.resumed_step(r) for r in range(WORLD)} <= {
        (emergency, "emergency"),
        (emergency, "local"),  # the step was also a periodic one
        (emergency, "durable"),
    }
    assert all(again.resumed_step(r) for r in range(WORLD))
    assert_equal(tmp_path, reference)
    # The old attempt's collective files are cleaned up by the new attempt.
    assert not (tmp_path / "job" / "collective" / "0").exists()


def test_without_emergency_checkpoint_resume_from_periodic(
    tmp_path: Path, reference: list[np.ndarray], jobs: list[Job]
) -> None:
    job = kill_rank0_mid_run(tmp_path, jobs)
    furthest = job.furthest()
    for rank in (1, 2, 3):
        job.procs[rank].send_signal(signal.SIGTERM)
    assert job.wait(10) == {0: -signal.SIGKILL, 1: 143, 2: 143, 3: 143}
    assert not (tmp_path / "durable" / "emergency").exists()

    jobs.append(again := Job(tmp_path, 1))
    again.finish()
    resumed = {again.resumed_step(r) for r in range(WORLD)}
    steps = {s[0] for s in resumed if s}
    assert len(steps) == 1 and None not in resumed, resumed
    (step,) = steps
    assert step % 5 == 0 and furthest - 6 <= step <= furthest
    assert_equal(tmp_path, reference)


def test_partial_files_are_never_taken_as_complete(
    tmp_path: Path, reference: list[np.ndarray], jobs: list[Job]
) -> None:
    jobs.append(first := Job(tmp_path, 0, total=30, IN_MEMORY_CHECKPOINTING_FREQ="0"))
    first.finish()
    durable = tmp_path / "durable"
    assert sorted(p.name for p in durable.glob("step-*")) == [
        "step-00000010",
        "step-00000020",
        "step-00000030",
    ]
    # The newest step: shard 1 truncated (as a torn, non-atomic write would leave it).
    torn = checkpoint_file(durable, 30, 1, N)
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    # A step a crashed writer left only temporary files in.
    for shard in range(N):
        final = checkpoint_file(durable, 40, shard, N)
        final.parent.mkdir(parents=True, exist_ok=True)
        (final.parent / f".{final.name}.tmp-999-dead").write_bytes(b"PK\x03\x04 partial")
    store = CheckpointStore({"durable": durable}, shard=1, num_shards=N)
    assert sorted(store.available()) == [10, 20]

    jobs.append(again := Job(tmp_path, 1, IN_MEMORY_CHECKPOINTING_FREQ="0"))
    again.finish()
    assert {again.resumed_step(r) for r in range(WORLD)} == {(20, "durable")}
    assert_equal(tmp_path, reference)
    # Step 30 was written again, complete this time.
    assert read_checkpoint(torn, step=30, shard=1, num_shards=N) is not None


def test_local_checkpoints_are_not_seen_from_another_node(
    tmp_path: Path, reference: list[np.ndarray], jobs: list[Job]
) -> None:
    jobs.append(first := Job(tmp_path, 0, total=15))
    first.finish()
    nodes = tmp_path / "nodes"
    for rank in range(WORLD):
        store = CheckpointStore(
            {"local": nodes / f"node-{rank}" / "checkpoints"}, shard=rank % N, num_shards=N
        )
        assert sorted(store.available()) == [5, 10, 15]
    # Durable: step 10 only. Every node could resume from its local step 15 ...
    # ... but rank 0 moves to a spare node, which holds nothing locally.
    jobs.append(again := Job(tmp_path, 1, nodes={0: "spare"}))
    again.finish()
    resumed = {r: again.resumed_step(r) for r in range(WORLD)}
    assert resumed == {0: (10, "durable"), 1: (10, "local"), 2: (10, "local"), 3: (10, "local")}
    assert_equal(tmp_path, reference)


def test_collective_timeout_exits_with_code_3(tmp_path: Path, jobs: list[Job]) -> None:
    # Rank 0 of a 2 x 2 job alone: the resume all-gather never completes.
    jobs.append(job := Job(tmp_path, 0, ranks=range(1), COLLECTIVE_TIMEOUT_S="0.3"))
    assert job.wait(10) == {0: 3}
    assert "collective timed out" in job.log(0)


def test_reports_to_the_host_monitor(tmp_path: Path, jobs: list[Job]) -> None:
    """One worker (1 x 2 job, both ranks) online against a recording server."""
    server = RecordingServer()
    try:
        jobs.append(
            job := Job(
                tmp_path,
                0,
                total=10,
                replicas=1,
                ranks=range(N),
                HOST_MONITOR_URL=server.url,
                HOST_MONITOR_WORKER_TOKEN="tok",
            )
        )
        job.finish()
    finally:
        server.close()
    registered = sorted(b["rank"] for b in server.bodies("/v1/workers/register"))
    assert registered == [0, 1]
    assert all(b["world_size"] == N for b in server.bodies("/register"))
    # The newest step, and the world it was trained in (WORKLOAD_ATTEMPT).
    progress = server.bodies("/v1/workers/0/progress")
    last = {k: v for k, v in progress[-1].items() if k != "compute_s"}
    assert last == {"step": 10, "attempt": "0"}
    # Its work per step before the all-reduce (what stragglers are scored on).
    computes = [b["compute_s"] for b in progress if "compute_s" in b]
    assert computes and all(0 <= c < 5 for c in computes)
    saved = server.bodies("/v1/workers/1/checkpoints")
    assert {(b["event"], b["step"], b["tier"]) for b in saved} == {
        ("saved", 5, "local"),
        ("saved", 10, "local"),
        ("saved", 10, "durable"),
    }
    assert {auth for _, _, auth in server.requests} == {"Bearer tok"}


def test_emergency_checkpoint_is_acked_to_the_host_monitor(tmp_path: Path, jobs: list[Job]) -> None:
    server = RecordingServer()
    request_file = tmp_path / "request"
    request_file.write_text("round-1")
    try:
        jobs.append(
            job := Job(
                tmp_path,
                0,
                total=100_000,
                replicas=1,
                ranks=range(N),
                HOST_MONITOR_URL=server.url,
                HOST_MONITOR_REQUEST_FILE=str(request_file),
            )
        )
        assert wait_for(lambda: all(max(job.steps(r), default=0) >= 3 for r in range(N)))
        for proc in job.procs.values():
            proc.send_signal(signal.SIGUSR1)
        assert wait_for(lambda: len(server.bodies("/emergency-ack")) == N)
        for proc in job.procs.values():
            proc.send_signal(signal.SIGTERM)
        assert job.wait(10) == dict.fromkeys(range(N), 143)
    finally:
        server.close()
    acks = {int(p.split("/")[3]): b for p, b, _ in server.requests if p.endswith("-ack")}
    assert set(acks) == {0, 1}
    assert all(a["ok"] and a["request_id"] == "round-1" for a in acks.values())
    # Both shards saved the same step, at most one step apart in flight: the same barrier.
    assert abs(acks[0]["step"] - acks[1]["step"]) <= 1
    for rank, ack in acks.items():
        path = checkpoint_file(tmp_path / "durable" / "emergency", ack["step"], rank, N)
        assert read_checkpoint(path) is not None
        reports = server.bodies(f"/v1/workers/{rank}/checkpoints")
        assert {"event": "saved", "tier": "emergency", "step": ack["step"]} in [
            {k: b[k] for k in ("event", "tier", "step")} for b in reports
        ]
