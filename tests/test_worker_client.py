"""The worker client against a tiny recording HTTP server (a stdlib server in a thread)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from supervisor.local.ports import free_port
from tests.timing import scaled
from training.npz_format import (
    checkpoint_file,
    list_checkpoints,
    newest_checkpoint,
    read_checkpoint,
    write_checkpoint_file,
)
from training.worker_client import WorkerClient


class RecordingServer:
    """Records every request as (path, body, Authorization header), and each checkpoint
    report's key. It can answer late (`delay_s`: a host monitor slower than the worker's
    report interval, which the real one is only on a loaded machine) and answer the next
    checkpoint reports with the statuses in `checkpoint_statuses` (a host monitor busy or
    restarting: a real one cannot be made to answer 503 on demand)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any, str | None]] = []
        self.keys: list[str | None] = []  # each checkpoint report's, in order
        self.delay_s = 0.0
        self.checkpoint_statuses: list[int] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                time.sleep(server.delay_s)
                code = 200
                with server.lock:
                    server.requests.append((self.path, body, self.headers.get("Authorization")))
                    if self.path.endswith("/checkpoints"):
                        server.keys.append(self.headers.get("Idempotency-Key"))
                        if server.checkpoint_statuses:
                            code = server.checkpoint_statuses.pop(0)
                data = json.dumps({}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def bodies(self, suffix: str) -> list[Any]:
        with self.lock:
            return [body for path, body, _ in self.requests if path.endswith(suffix)]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    s = RecordingServer()
    try:
        yield s
    finally:
        s.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_register_sends_identity_and_token(server: RecordingServer) -> None:
    client = WorkerClient(3, 1, monitor_url=server.url, token="tok", report_interval_s=0.05)
    try:
        assert client.online
        assert client.register(world_size=8)
    finally:
        client.close()
    path, body, auth = server.requests[0]
    assert path == "/v1/workers/register"
    # With what finds this process from another PID namespace (host_monitor/pidns.py).
    assert body == {
        "rank": 3,
        "local_rank": 1,
        "pid": os.getpid(),
        "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
        "start_time": int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]),
        "world_size": 8,
    }
    assert auth == "Bearer tok"
    assert all(p.startswith("/v1/workers/") for p, _, _ in server.requests)


def test_monitor_down_never_breaks_training() -> None:
    client = WorkerClient(0, 0, monitor_url=f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    assert client.register(attempts=2, retry_delay_s=0.01) is False
    client.report_step(1)
    client.report_checkpoint_saved(1, 0.1, "local")
    client.close()
    assert time.monotonic() - started < 3.0


def test_progress_is_batched_and_sends_the_newest_step(server: RecordingServer) -> None:
    client = WorkerClient(2, 0, monitor_url=server.url, report_interval_s=0.1)
    client.register()
    calls = 0
    end = time.monotonic() + 0.35
    while time.monotonic() < end:
        client.report_step(calls)
        calls += 1
    last = calls - 1
    client.close()  # flushes one last progress report
    progress = server.bodies("/v1/workers/2/progress")
    assert calls > 1000
    assert 2 <= len(progress) <= 8
    assert progress[-1] == {"step": last}
    steps = [b["step"] for b in progress if b["step"] is not None]
    assert steps == sorted(steps)


def test_progress_doubles_as_heartbeat(server: RecordingServer) -> None:
    client = WorkerClient(0, 0, monitor_url=server.url, report_interval_s=0.03)
    client.register()
    try:
        assert wait_for(lambda: len(server.bodies("/progress")) >= 3)
        assert server.bodies("/progress")[0] == {"step": None}  # before any step
        client.report_step(5)
        assert wait_for(lambda: server.bodies("/progress").count({"step": 5}) >= 3)
    finally:
        client.close()


def test_compute_times_are_sent_as_their_mean_since_the_last_report(
    server: RecordingServer,
) -> None:
    client = WorkerClient(0, 0, monitor_url=server.url, report_interval_s=3600)
    client.register()
    try:
        # The reporting thread's first report, then nothing for an hour: the reports
        # below are the test's own, in order.
        assert wait_for(lambda: server.bodies("/progress") == [{"step": None}])
        client.report_step(5, compute_s=0.2)
        client.report_step(6, compute_s=0.4)
        client._reporter.send_progress()  # what the reporting thread does every interval
        client.report_step(7)  # a step without a time: nothing to average
        client._reporter.send_progress()
        progress = server.bodies("/progress")
        assert {"step": 6, "compute_s": pytest.approx(0.3)} in progress
        assert progress[-1] == {"step": 7}
    finally:
        client.close()


def test_sigusr1_is_served_at_a_safe_point_and_acked(
    server: RecordingServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request_file = tmp_path / "request"
    request_file.write_text("round-7\n")
    monkeypatch.setenv("HOST_MONITOR_REQUEST_FILE", str(request_file))
    before = signal.getsignal(signal.SIGUSR1)
    saved: list[int] = []

    def save() -> int:
        saved.append(42)
        return 42

    client = WorkerClient(1, 0, monitor_url=server.url, report_interval_s=0.05)
    try:
        client.on_emergency_checkpoint(save)
        assert not client.checkpoint_requested
        assert client.at_safe_point() is False
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: client.checkpoint_requested)
        assert saved == []  # the handler only sets a flag
        assert client.at_safe_point() is True
        assert saved == [42]
        assert client.at_safe_point() is False
        acks = server.bodies("/v1/workers/1/emergency-ack")
        assert len(acks) == 1
        ack = acks[0]
        assert ack["request_id"] == "round-7"
        assert ack["ok"] is True and ack["step"] == 42 and ack["error"] is None
        assert ack["duration_s"] >= 0
    finally:
        client.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_thread_of_the_client_serves_requests_whatever_the_main_thread_does(
    server: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    monkeypatch.delenv("HOST_MONITOR_REQUEST_FILE", raising=False)
    served_by: list[str] = []

    def save() -> int:
        served_by.append(threading.current_thread().name)
        return 7

    client = WorkerClient(3, 0, monitor_url=server.url, report_interval_s=0.05)
    try:
        assert client.serve_emergency_checkpoints(save) is True
        os.kill(os.getpid(), signal.SIGUSR1)
        # Served without any call from this (the main) thread.
        assert wait_for(lambda: server.bodies("/v1/workers/3/emergency-ack"))
        assert served_by == ["emergency-checkpoint-3"]
        assert client.at_safe_point() is False  # the thread serves, not the safe point
        (ack,) = server.bodies("/v1/workers/3/emergency-ack")
        assert ack["ok"] is True and ack["step"] == 7
    finally:
        client.close()
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was given back


def test_the_wakeup_fd_of_someone_else_is_left_alone(server: RecordingServer) -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    client = WorkerClient(0, 0, monitor_url=server.url)
    try:
        assert client.serve_emergency_checkpoints(lambda: 1) is False  # safe points only
        assert signal.set_wakeup_fd(write_end) == write_end
    finally:
        client.close()
        signal.set_wakeup_fd(-1)
        os.close(read_end)
        os.close(write_end)


def test_failing_callback_is_acked_as_failed(
    server: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HOST_MONITOR_REQUEST_FILE", raising=False)

    def save() -> int:
        raise OSError("disk full")

    client = WorkerClient(0, 0, monitor_url=server.url)
    try:
        client.on_emergency_checkpoint(save)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: client.checkpoint_requested)
        assert client.at_safe_point() is True
    finally:
        client.close()
    (ack,) = server.bodies("/emergency-ack")
    assert ack["request_id"] == "signal"
    assert ack["ok"] is False and ack["step"] is None
    assert "disk full" in ack["error"]


def test_checkpoint_reports_are_flushed_on_close(server: RecordingServer) -> None:
    client = WorkerClient(4, 0, monitor_url=server.url, report_interval_s=10)
    client.report_checkpoint_saved(20, 0.5, "durable")
    client.report_checkpoint_loaded(10, 0.25, "emergency")
    with pytest.raises(ValueError):
        client.report_checkpoint_saved(1, 0.1, "tape")  # type: ignore[arg-type]
    client.close()
    assert server.bodies("/v1/workers/4/checkpoints") == [
        {"event": "saved", "step": 20, "duration_s": 0.5, "tier": "durable"},
        {"event": "loaded", "step": 10, "duration_s": 0.25, "tier": "emergency"},
    ]


def test_checkpoint_reports_are_not_starved_by_a_host_monitor_slower_than_the_interval(
    server: RecordingServer,
) -> None:
    """Each answer takes three report intervals: progress is due again before every
    answer, and still every checkpoint report goes, between progress reports."""
    server.delay_s = 0.15
    client = WorkerClient(1, 0, monitor_url=server.url, report_interval_s=0.05)
    try:
        for step in range(1, 5):
            client.report_step(step)
            client.report_checkpoint_saved(step, 0.01, "ram")
        assert wait_for(lambda: len(server.bodies("/checkpoints")) == 4, 10)
        assert [b["step"] for b in server.bodies("/checkpoints")] == [1, 2, 3, 4]
        assert len(server.bodies("/progress")) >= 2  # and progress went on meanwhile
    finally:
        client.close()


def test_a_checkpoint_report_not_taken_is_sent_again_under_its_key_in_order(
    server: RecordingServer,
) -> None:
    """503 twice (a host monitor busy), then 404 (it restarted and forgot the worker): the
    report is sent until taken, with the same key each time, and the next one only after
    it. A refusal for good (422) is not sent again."""
    server.checkpoint_statuses = [503, 503, 404, 200, 422]
    client = WorkerClient(3, 0, monitor_url=server.url, report_interval_s=10)
    try:
        client.report_checkpoint_saved(10, 0.1, "ram")
        client.report_checkpoint_saved(20, 0.1, "ram")
        client.report_checkpoint_saved(30, 0.1, "ram")
        assert client.flush(scaled(10))
        steps = [b["step"] for b in server.bodies("/checkpoints")]
        assert steps == [10, 10, 10, 10, 20, 30]
        first, second, third = server.keys[0], server.keys[4], server.keys[5]
        assert server.keys[:4] == [first] * 4 and first is not None
        assert len({first, second, third}) == 3
    finally:
        client.close()


def test_close_gives_up_a_report_never_taken_within_its_time(server: RecordingServer) -> None:
    server.checkpoint_statuses = [503] * 1000
    client = WorkerClient(3, 0, monitor_url=server.url, report_interval_s=10)
    client.report_checkpoint_saved(10, 0.1, "ram")
    assert wait_for(lambda: len(server.bodies("/checkpoints")) >= 2)
    started = time.monotonic()
    client.close(timeout_s=1.0)
    assert time.monotonic() - started < scaled(3.0)
    assert client.flush(0.1)  # given up: nothing left to wait for


def test_checkpoint_reports_carry_sizes_and_total_times(server: RecordingServer) -> None:
    client = WorkerClient(4, 0, monitor_url=server.url, report_interval_s=10)
    client.report_checkpoint_saved(30, 0.2, "ram", size_bytes=2**40, total_s=3.5)
    client.report_checkpoint_saved(30, 0.0, "peer", size_bytes=0)
    client.report_checkpoint_loaded(30, 1.5, "peer", size_bytes=2**40, total_s=1.5)
    client.report_checkpoint_loaded(30, 0.5, "ram", total_s=-0.001)  # clock jitter: 0
    for kwargs, field in (
        ({"size_bytes": -1}, "size_bytes"),
        ({"size_bytes": 2**62 + 1}, "size_bytes"),
        ({"size_bytes": 1.5}, "size_bytes"),
        ({"size_bytes": True}, "size_bytes"),
        ({"total_s": float("nan")}, "total_s"),
        ({"total_s": float("inf")}, "total_s"),
        ({"total_s": 604_801.0}, "total_s"),
    ):
        with pytest.raises(ValueError, match=field):
            client.report_checkpoint_saved(31, 0.1, "ram", **kwargs)  # type: ignore[arg-type]
    client.close()
    assert server.bodies("/v1/workers/4/checkpoints") == [
        {"event": "saved", "step": 30, "duration_s": 0.2, "tier": "ram", "bytes": 2**40,
         "total_s": 3.5},
        {"event": "saved", "step": 30, "duration_s": 0.0, "tier": "peer", "bytes": 0},
        {"event": "loaded", "step": 30, "duration_s": 1.5, "tier": "peer", "bytes": 2**40,
         "total_s": 1.5},
        {"event": "loaded", "step": 30, "duration_s": 0.5, "tier": "ram", "total_s": 0.0},
    ]  # fmt: skip


def test_offline_mode_works_without_a_monitor() -> None:
    client = WorkerClient.from_env({"RANK": "2", "LOCAL_RANK": "1"})
    assert (client.rank, client.local_rank, client.online) == (2, 1, False)
    assert client.register(world_size=4) is False
    client.report_step(3)
    client.report_checkpoint_saved(3, 0.1, "local")
    calls: list[int] = []

    def save() -> int:
        calls.append(3)
        return 3

    client.on_emergency_checkpoint(save)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert wait_for(lambda: client.checkpoint_requested)
    assert client.at_safe_point() is True
    assert calls == [3]
    assert client._reporter.thread is None  # nothing runs in the background offline
    client.close()


def test_from_env_reads_url_and_token(server: RecordingServer) -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "0",
        "HOST_MONITOR_URL": server.url + "/",
        "HOST_MONITOR_WORKER_TOKEN": "secret",
    }
    with WorkerClient.from_env(env) as client:
        assert client.online and client.rank == 5
        assert client.register()
    assert server.requests[0][2] == "Bearer secret"


# --- checkpoint layout -------------------------------------------------------------------


def _write(tier: Path, step: int, shard: int = 0, num_shards: int = 2) -> Path:
    return write_checkpoint_file(tier, step, shard, num_shards, {"w.npy": bytes([step]) * 64})


def test_newest_checkpoint_skips_partial_and_corrupt_files(tmp_path: Path) -> None:
    local, durable = tmp_path / "local", tmp_path / "durable"
    assert newest_checkpoint([local, durable], 0, 2) is None
    _write(durable, 10)
    _write(local, 15)
    _write(durable, 20)
    _write(durable, 20, shard=1)
    assert newest_checkpoint([local, durable], 0, 2) == (20, checkpoint_file(durable, 20, 0, 2))
    assert newest_checkpoint([local, durable], 1, 2) == (20, checkpoint_file(durable, 20, 1, 2))
    # A shard of another layout (num_shards) is not this one.
    assert newest_checkpoint([local, durable], 0, 4) is None

    # Truncated newest: not complete.
    newest = checkpoint_file(durable, 20, 0, 2)
    newest.write_bytes(newest.read_bytes()[:-40])
    assert read_checkpoint(newest) is None
    assert newest_checkpoint([local, durable], 0, 2) == (15, checkpoint_file(local, 15, 0, 2))

    # Same size, one byte flipped inside the data: the checksum catches it.
    path = checkpoint_file(local, 15, 0, 2)
    blob = bytearray(path.read_bytes())
    blob[blob.index(bytes([15]) * 64) + 3] ^= 0xFF
    path.write_bytes(bytes(blob))
    assert read_checkpoint(path) is None

    # A leftover temporary file (a writer died) never counts.
    step30 = checkpoint_file(durable, 30, 0, 2)
    step30.parent.mkdir(parents=True)
    (step30.parent / f".{step30.name}.tmp-123-abcd").write_bytes(b"partial")
    assert newest_checkpoint([local, durable], 0, 2) == (10, checkpoint_file(durable, 10, 0, 2))
    assert list(list_checkpoints([local, durable], 0, 2)) == [10]


def test_first_tier_wins_a_tie(tmp_path: Path) -> None:
    local, durable = tmp_path / "local", tmp_path / "durable"
    _write(durable, 10)
    _write(local, 10)
    assert newest_checkpoint([local, durable], 0, 2) == (10, checkpoint_file(local, 10, 0, 2))
    assert list_checkpoints([durable, local], 0, 2) == {10: checkpoint_file(durable, 10, 0, 2)}
    data = read_checkpoint(checkpoint_file(local, 10, 0, 2), step=10, shard=0, num_shards=2)
    assert data is not None and data.members == {"w.npy": bytes([10]) * 64}
    # The metadata must name the step of the directory it sits in.
    moved = checkpoint_file(local, 11, 0, 2)
    moved.parent.mkdir(parents=True)
    checkpoint_file(local, 10, 0, 2).replace(moved)
    assert read_checkpoint(moved, step=11) is None
