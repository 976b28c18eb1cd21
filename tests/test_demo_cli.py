"""`supervisor demo` as a user runs it: it starts, says how to use it, and leaves no
process behind when stopped with Ctrl+C, or even when it is killed outright."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.local.demo import leftover_processes
from supervisor.local.ports import free_port
from tests.http import http


def _start(run_dir: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "demo",
            "--run-dir",
            str(run_dir),
            "--port",
            str(port),
            "--spares",
            "1",
            "--replicas",
            "2",
            "--nodes-per-dp",
            "1",
            "--step-time-s",
            "0.05",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _read_banner(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Stop with Ctrl+C" in line:
            return "".join(lines)
    raise AssertionError("no banner:\n" + "".join(lines))


def _kill_everything(proc: subprocess.Popen[str], run_dir: Path) -> None:
    if proc.poll() is None:
        proc.kill()
    for pid in leftover_processes(run_dir.resolve()):
        os.kill(pid, signal.SIGKILL)


def _gone(run_dir: Path, within: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = leftover_processes(run_dir.resolve())
        if not left:
            return []
        time.sleep(0.2)
    return leftover_processes(run_dir.resolve())


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_demo_starts_and_leaves_nothing_behind(tmp_path: Path, how: signal.Signals) -> None:
    run_dir = tmp_path / "demo"
    port = free_port()
    proc = _start(run_dir, port)
    try:
        banner = _read_banner(proc)
        token = banner.split("operator token:")[1].split()[0]
        assert '"kind":"node_down"' in banner and f"127.0.0.1:{port}" in banner
        headers = {"Authorization": f"Bearer {token}"}
        url = f"http://127.0.0.1:{port}/api/v1/nodes"
        deadline = time.monotonic() + 20
        while len(http.get(url, headers=headers).json()) < 3:
            assert time.monotonic() < deadline, "not every node heartbeats"
            time.sleep(0.1)
        assert len(leftover_processes(run_dir.resolve())) >= 3 + 1 + 2  # agents, sup., workers
        proc.send_signal(how)
        code = proc.wait(30)
        assert code == (0 if how is signal.SIGINT else -9)
        assert _gone(run_dir) == []
    finally:
        _kill_everything(proc, run_dir)


def test_demo_runs_the_torch_workload(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    run_dir = tmp_path / "demo"
    port = free_port()
    proc = _start(run_dir, port, "--workload", "torch")
    try:
        banner = _read_banner(proc)
        token = banner.split("operator token:")[1].split()[0]
        headers = {"Authorization": f"Bearer {token}"}
        url = f"http://127.0.0.1:{port}/api/v1/jobs/demo"
        deadline = time.monotonic() + 180
        while (http.get(url, headers=headers).json().get("last_step") or 0) < 3:
            assert time.monotonic() < deadline, "the torch job does not train"
            time.sleep(0.5)
        logs = "".join(p.read_text() for p in (run_dir / "nodes").rglob("*.rank*.log"))
        for rank in (0, 1):
            started = f"torch workload rank={rank}: start attempt=1 world_size=2: starting from"
            assert started in logs
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert _gone(run_dir) == []
    finally:
        _kill_everything(proc, run_dir)


def test_demo_refuses_a_torch_job_sharded_over_nodes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    argv = [sys.executable, "-m", "supervisor.cli", "demo", "--run-dir", str(tmp_path / "d")]
    argv += ["--workload", "torch", "--nodes-per-dp", "2"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("supervisor demo: --nodes-per-dp must be 1 with the torch workload")
    assert not (tmp_path / "d").exists()  # nothing was started


def test_demo_refuses_a_port_in_use_and_starts_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "supervisor.cli", "demo", "--run-dir", str(tmp_path / "d")]
        done = subprocess.run(
            [*argv, "--port", str(port)], env=env, capture_output=True, text=True, timeout=60
        )
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"supervisor demo: the supervisor's port {port} on 127.0.0.1 is in use "
        "(Address already in use) (the demo's --port)"
    )
    assert not (tmp_path / "d").exists()  # nothing was started
    assert leftover_processes(tmp_path / "d") == []


QUIET_POLICY = '''
from supervisor.policy import Policy


class Watching(Policy):
    """Records every event and acts on none."""

    name = "watching"
'''


def test_demo_takes_a_policy_and_settings_and_survives_its_supervisor(tmp_path: Path) -> None:
    """A custom policy and setting reach the supervisor; killing only the supervisor leaves
    the job training, and the demo starts it again with the same policy."""
    policy = tmp_path / "watching.py"
    policy.write_text(QUIET_POLICY)
    run_dir = tmp_path / "demo"
    port = free_port()
    proc = _start(run_dir, port, "--policy", f"{policy}:Watching", "--set", "restart_window_s=900")
    try:
        banner = _read_banner(proc)
        assert f"policy={policy}:Watching restart_window_s=900" in banner
        assert "heartbeat_timeout_s=3 (a cluster's default: 15)" in banner
        token = banner.split("operator token:")[1].split()[0]
        pid = int(banner.split("kill -9 ")[1].split(")")[0])
        headers = {"Authorization": f"Bearer {token}"}
        api = f"http://127.0.0.1:{port}/api/v1"

        def step() -> int:
            # A generous timeout: a loaded machine may take seconds to answer.
            reply = http.get(f"{api}/jobs/demo", headers=headers, timeout=30)
            return int(reply.json().get("last_step") or 0)

        deadline = time.monotonic() + 60
        while step() < 3:
            assert time.monotonic() < deadline, "the job does not train"
            time.sleep(0.2)
        before = step()
        os.kill(pid, signal.SIGKILL)
        assert proc.stdout is not None
        lines = []
        while "the supervisor is back" not in (line := proc.stdout.readline()):
            assert line, "".join(lines)
            lines.append(line)
        deadline = time.monotonic() + 60
        while step() <= before:  # trained on, and seen by the new supervisor
            assert time.monotonic() < deadline, "no progress after the supervisor's restart"
            time.sleep(0.2)
        # The step may come from the other node's heartbeat: node-0's may still be on its way.
        while http.get(f"{api}/nodes/node-0", headers=headers, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "node-0 not heard by the new supervisor"
            time.sleep(0.2)
        fault = http.post(
            f"{api}/faults", json={"kind": "worker_crash", "node": "node-0"}, headers=headers
        )
        assert fault.status_code == 201, fault.text
        deadline = time.monotonic() + 30
        while not http.get(
            f"{api}/events", headers=headers, params={"type": "worker_exited"}
        ).json()["items"]:
            assert time.monotonic() < deadline, "the crash was not seen"
            time.sleep(0.2)
        time.sleep(2)  # the policy's turn
        assert http.get(f"{api}/actions", headers=headers).json()["items"] == []
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert _gone(run_dir) == []
    finally:
        _kill_everything(proc, run_dir)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--set", "no_such_setting=1"], "--set 'no_such_setting=1': expected SETTING=VALUE"),
        (["--policy", "policies.default:Nope"], "--policy: policy 'policies.default:Nope'"),
    ],
)
def test_demo_refuses_an_unknown_setting_or_policy(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    argv = [sys.executable, "-m", "supervisor.cli", "demo", "--run-dir", str(tmp_path / "d")]
    done = subprocess.run([*argv, *flags], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().startswith(f"supervisor demo: {message}"), done.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ("numpy", "--workload numpy needs NumPy: pip install 'resiliency-supervisor[demo]'"),
        ("torch", "--workload torch needs PyTorch: pip install 'resiliency-supervisor[torch]'"),
    ],
)
def test_demo_refuses_to_start_without_its_workloads_packages(
    tmp_path: Path, workload: str, message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    # As on an install without the extra: the package cannot be found.
    hide = "import sys; sys.modules['numpy'] = sys.modules['torch'] = None; "
    start = "from supervisor.cli import main; main()"
    argv = [sys.executable, "-c", hide + start, "demo", "--run-dir", str(tmp_path / "d")]
    done = subprocess.run(
        [*argv, "--workload", workload], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert done.stderr.strip() == f"supervisor demo: {message}"
    assert not (tmp_path / "d").exists()
