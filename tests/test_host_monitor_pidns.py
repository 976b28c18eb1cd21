"""Workers in their own PID namespaces (as in their own Kubernetes pods), for real.

Each worker runs under `unshare --pid --fork --mount-proc`: its own PID namespace and its
own /proc, where it is pid 1 (as a container's `exec python` is). It registers through
the worker client with a real host monitor, which must find its pid on the host and poll
and signal that process, not host pid 1. Needs root (or unprivileged user namespaces)
and util-linux: where `unshare` cannot make a PID namespace, these tests skip and say so.

The chart's posture (host monitor as root with CAP_KILL only, workers of another user,
whose PID namespace it may not read) runs the host monitor under `setpriv` with only
CAP_KILL in its bounding set and the worker as `nobody`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from host_monitor import pidns
from tests.test_host_monitor import (
    ACTUATOR_TOKEN,
    AGENT_TOKEN,
    WORKER_TOKEN,
    Agent,
    Supervisor,
    wait_for,
)
from tests.timing import scaled
from training.worker_client import WorkerClient

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
# Root, but with no capability other than CAP_KILL (no CAP_SYS_PTRACE): the chart's
# host monitor with kernelLog.source file/off.
KILL_ONLY = ["setpriv", "--bounding-set", "-all,+kill", "--inh-caps", "-all"]

# A training worker as a user writes it: the worker client registers it (sending its pid
# namespace and start time), reports steps, saves on SIGUSR1 and acks. It writes what it
# saw to OUT (a directory): its identity as it sees it, each emergency save, the SIGTERM.
WORKER_SCRIPT = r"""
import json, os, signal, sys, time
from pathlib import Path
from training.worker_client import WorkerClient

out = Path(sys.argv[1])
step = 0
client = WorkerClient.from_env(report_interval_s=0.1)

def save():
    (out / f"saved-{step}").write_text("")
    return step

def on_term(signum, frame):
    (out / "sigterm").write_text(str(os.getpid()))
    sys.exit(0)

client.on_emergency_checkpoint(save)
signal.signal(signal.SIGTERM, on_term)
me = {
    "pid": os.getpid(),
    "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
    "registered": client.register(attempts=1),
}
(out / "identity.tmp").write_text(json.dumps(me))
os.replace(out / "identity.tmp", out / "identity.json")
if not me["registered"]:
    sys.exit(5)
while True:
    client.at_safe_point()
    step += 1
    client.report_step(step)
    time.sleep(0.05)
"""


def _runs(argv: Sequence[str]) -> bool:
    try:
        return subprocess.run(list(argv), capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


CAN_UNSHARE = sys.platform == "linux" and _runs([*UNSHARE, "true"])
pytestmark = pytest.mark.skipif(
    not CAN_UNSHARE, reason="cannot create a PID namespace here (`unshare --pid` failed)"
)


def _children(pid: int) -> list[int]:
    """Host pids of `pid`'s children, from the kernel (not from the code under test)."""
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class NamespacedProcess:
    """`argv` as pid 1 of a new PID namespace; `host_pid` is its pid in ours."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.launcher = subprocess.Popen(
            [*UNSHARE, *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        # unshare --fork: its only child is the namespace's pid 1.
        children = wait_for(lambda: _children(self.launcher.pid), 10, "the namespace's pid 1")
        self.host_pid: int = children[0]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.host_pid, signal.SIGKILL)  # ends the whole namespace
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.launcher.pid, signal.SIGKILL)
        self.launcher.wait(10)


class Node:
    """One host monitor (real process) and the namespaced processes the test starts."""

    def __init__(self, tmp: Path, supervisor_url: str | None, prefix: Sequence[str] = ()) -> None:
        self.tmp = tmp
        self.processes: list[NamespacedProcess] = []
        # Worker output outside pytest's tmp_path, whose parent only root may enter.
        self.shared = Path(tempfile.mkdtemp(prefix="pidns-"))
        self.shared.chmod(0o755)
        self.agent = self._start_agent(supervisor_url, prefix)

    def _start_agent(self, supervisor_url: str | None, prefix: Sequence[str]) -> Agent:
        node = f"ns-{uuid.uuid4().hex[:8]}"
        argv = [
            *prefix,
            sys.executable,
            "-m",
            "host_monitor.cli",
            *("--node", node, "--port", "0", "--initial-state", "running", "--job", "j1"),
            *("--heartbeat-polling-period-s", "0.2", "--worker-heartbeat-timeout-s", "1"),
            *("--kernel-log", "none", "--nvidia-smi", str(self.tmp / "no-nvidia-smi")),
            *("--run-dir", str(self.tmp / "run")),
        ]
        if supervisor_url is not None:
            argv += ["--supervisor-url", supervisor_url]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HOST_MONITOR_")},
            "HOST_MONITOR_AGENT_TOKEN": AGENT_TOKEN,
            "HOST_MONITOR_ACTUATOR_TOKEN": ACTUATOR_TOKEN,
            "HOST_MONITOR_WORKER_TOKEN": WORKER_TOKEN,
        }
        log = self.tmp / f"{node}.agent.log"
        with log.open("ab") as err:
            proc = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=err, start_new_session=True
            )
        assert proc.stdout is not None
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + scaled(15)
            while not line.endswith(b"\n"):
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    proc.kill()
                    raise AssertionError(f"agent did not start:\n{log.read_text()}")
                chunk = os.read(proc.stdout.fileno(), 1)
                if not chunk:
                    raise AssertionError(f"agent exited ({proc.wait()}):\n{log.read_text()}")
                line += chunk
        prefix_text = f"host-monitor {node} listening on "
        text = line.decode().strip()
        assert text.startswith(prefix_text), text
        return Agent(node, proc, text.removeprefix(prefix_text), log)

    def worker(self, rank: int, *, as_nobody: bool = False) -> tuple[NamespacedProcess, Path]:
        """A worker-client worker of `rank` in its own PID namespace; its output directory."""
        out = self.shared / f"rank{rank}"
        out.mkdir()
        out.chmod(0o777)  # a worker running as nobody writes here
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HOST_MONITOR_")},
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "HOST_MONITOR_URL": self.agent.url,
            "HOST_MONITOR_WORKER_TOKEN": WORKER_TOKEN,
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        }
        user = NOBODY if as_nobody else []
        argv = [*user, sys.executable, "-c", WORKER_SCRIPT, str(out)]
        process = NamespacedProcess(argv, env)
        self.processes.append(process)
        return process, out

    def sleeper(self) -> NamespacedProcess:
        process = NamespacedProcess(["sleep", "300"])
        self.processes.append(process)
        return process

    def workers(self) -> dict[int, dict[str, Any]]:
        return self.agent.workers()

    def close(self) -> None:
        for process in self.processes:
            process.kill()
        agent = self.agent
        agent.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)
        if agent.proc.stdout is not None:
            agent.proc.stdout.close()
        shutil.rmtree(self.shared, ignore_errors=True)


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    server = Supervisor(tmp_path_factory.mktemp("supervisor"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def node(tmp_path: Path, supervisor: Supervisor) -> Iterator[Node]:
    n = Node(tmp_path, supervisor.url)
    try:
        yield n
    finally:
        n.close()


def _identity(out: Path) -> dict[str, Any]:
    path = out / "identity.json"
    wait_for(path.exists, 20, f"{path}")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


# --- tests ----------------------------------------------------------------------------


def test_workers_in_their_own_pid_namespaces_are_polled_and_signalled_by_host_pid(
    supervisor: Supervisor, node: Node
) -> None:
    """Two workers, both pid 1 in their own namespace: each signal reaches the right one."""
    (w0, out0), (w1, out1) = node.worker(0), node.worker(1)
    me0, me1 = _identity(out0), _identity(out1)
    assert me0["registered"] and me1["registered"]
    assert me0["pid"] == me1["pid"] == 1
    own_namespace = os.stat("/proc/self/ns/pid").st_ino
    assert len({me0["pid_namespace"], me1["pid_namespace"], own_namespace}) == 3

    def running() -> bool:
        workers = node.workers()
        return all(
            workers.get(r, {}).get("state") == "running" and (workers[r]["step"] or 0) >= 1
            for r in (0, 1)
        )

    wait_for(running, 15, "both workers running")
    workers = node.workers()
    # Reported as the worker knows itself; signalled by its pid on the host.
    assert (workers[0]["pid"], workers[0]["host_pid"]) == (1, w0.host_pid)
    assert (workers[1]["pid"], workers[1]["host_pid"]) == (1, w1.host_pid)
    assert f"= host pid {w0.host_pid})" in node.agent.log.read_text()

    # Heartbeats carry the worker's own pid (WorkerReport.pid is informational).
    def reported() -> dict[int, dict[str, Any]] | None:
        view = supervisor.node(node.agent.node)
        ranks = {w["rank"]: w for w in (view or {}).get("workers", [])}
        return ranks if len(ranks) == 2 else None

    assert {w["pid"] for w in wait_for(reported, 10, "workers in heartbeats").values()} == {1}

    # Emergency checkpoint: SIGUSR1 reaches both namespaced processes, and both ack.
    r = node.agent.api.post(
        "/v1/emergency-checkpoint", json={"request_id": "em-1", "timeout_s": 20}
    )
    assert r.status_code == 200, r.text
    result = r.json()
    assert sorted(result["acked"]) == ["0", "1"] and result["missing"] == []
    assert all(a["ok"] for a in result["acked"].values())
    for rank, out in ((0, out0), (1, out1)):
        step = result["acked"][str(rank)]["step"]
        assert (out / f"saved-{step}").exists()

    # A crash of rank 1 (SIGKILL by host pid) ends rank 1's process only.
    outcome = node.agent.fault(kind="worker_crash", rank=1)
    assert outcome["pid"] == 1
    wait_for(lambda: _gone(w1.host_pid), 10, "rank 1's process killed")
    wait_for(lambda: node.workers()[1]["state"] == "exited", 10, "rank 1 exited")
    assert node.workers()[1]["exit_code"] is None  # not our child: unknown
    assert supervisor.wait_event(node.agent.node, "worker_exited", 10)["rank"] == 1
    assert not _gone(w0.host_pid) and node.workers()[0]["state"] == "running"

    # A hang (SIGSTOP by host pid) stops rank 0, which then turns lost.
    node.agent.fault(kind="worker_hang", rank=0)
    wait_for(lambda: _state(w0.host_pid) == "T", 10, "rank 0 stopped by SIGSTOP")
    wait_for(lambda: node.workers()[0]["state"] == "lost", 10, "rank 0 lost")

    # Stop: SIGTERM + SIGCONT to the host pid; the worker's handler runs and it exits.
    r = node.agent.api.post("/v1/workers/stop", json={"grace_s": 20})
    assert r.status_code == 200, r.text
    assert r.json()["exit_codes"] == {"0": None, "1": None}
    assert node.workers()[0]["state"] == "stopped"
    assert (out0 / "sigterm").read_text() == "1"  # its handler ran, in its namespace
    wait_for(lambda: _gone(w0.host_pid), 10, "rank 0's process gone")


def test_registration_that_names_no_process_of_this_node_is_refused(node: Node) -> None:
    """Unknown namespace, wrong pid, wrong start time: 409 naming `pid`, nothing changes."""
    sleeper = node.sleeper()
    namespace = os.stat(f"/proc/{sleeper.host_pid}/ns/pid").st_ino
    started = pidns.start_time(sleeper.host_pid)
    assert started is not None
    api = node.agent.worker_api
    base = {"rank": 3, "local_rank": 0}
    refused = [
        ({"pid": 4242, "pid_namespace": 4026599999, "start_time": started}, "4242", "4026599999"),
        ({"pid": 2, "pid_namespace": namespace, "start_time": started}, "pid 2 ", str(namespace)),
        ({"pid": 1, "pid_namespace": namespace, "start_time": started + 1}, "pid 1 ", "tick"),
        ({"pid": 1, "pid_namespace": 4026599998}, "pid 1 ", "4026599998"),
    ]
    for body, *words in refused:
        r = api.post("/v1/workers/register", json={**base, **body})
        assert r.status_code == 409, r.text
        detail = r.json()["detail"]
        assert detail.startswith("pid: cannot find pid "), detail
        assert "on this node" in detail and "hostPID" in detail, detail
        assert all(word in detail for word in words), (words, detail)
    assert node.workers() == {}
    assert node.agent.log.read_text().count("registration of rank 3 refused") == len(refused)
    r = api.post("/v1/workers/register", json={**base, "pid": 1, "pid_namespace": 0})
    assert r.status_code == 422 and "pid_namespace" in r.text

    # The same process, named right (with or without its start time), is adopted.
    for extra in ({"start_time": started}, {}):
        body = {**base, "pid": 1, "pid_namespace": namespace, **extra}
        r = api.post("/v1/workers/register", json=body)
        assert r.status_code == 200, r.text
        assert (r.json()["pid"], r.json()["host_pid"]) == (1, sleeper.host_pid)
    # Exit detection polls the host pid.
    os.kill(sleeper.host_pid, signal.SIGKILL)
    wait_for(lambda: node.workers()[3]["state"] == "exited", 10, "adopted sleeper exited")


def test_same_namespace_registration_is_unchanged(node: Node) -> None:
    """Local mode: a worker of our own namespace (or one that sends no namespace)."""
    own = os.stat("/proc/self/ns/pid").st_ino
    sleepers = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    try:
        for rank, (sleeper, extra) in enumerate(
            zip(sleepers, ({"pid_namespace": own}, {}), strict=True)
        ):
            body = {"rank": rank, "local_rank": 0, "pid": sleeper.pid, **extra}
            r = node.agent.worker_api.post("/v1/workers/register", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["pid"] == r.json()["host_pid"] == sleeper.pid
        node.agent.fault(kind="worker_crash", rank=0)
        assert sleepers[0].wait(10) == -signal.SIGKILL
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def test_monitor_without_the_hosts_pid_namespace_refuses_and_the_client_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The DaemonSet without hostPID: the monitor in a namespace of its own cannot see the
    worker (here: this test process), refuses it, and the worker client logs why."""
    node = Node(tmp_path, None, prefix=UNSHARE)
    client = WorkerClient(0, 0, monitor_url=node.agent.url, token=WORKER_TOKEN)
    try:
        with caplog.at_level(logging.WARNING, logger="training.worker_client"):
            assert client.register(attempts=1) is False
        assert f"cannot find pid {os.getpid()} of PID namespace" in caplog.text
        assert "does the host monitor run with hostPID?" in caplog.text
        assert node.agent.status()["workers"] == []
    finally:
        client.close()
        node.close()


def _nobody_runs_python() -> bool:
    return _runs([*NOBODY, sys.executable, "-c", "import httpx"])


@pytest.mark.skipif(not _runs([*KILL_ONLY, "true"]), reason="setpriv cannot drop capabilities")
def test_host_monitor_with_only_cap_kill_finds_a_worker_of_another_user(
    tmp_path: Path,
) -> None:
    """The chart's posture: the monitor may not read the worker's /proc/X/ns/pid, so the
    worker is told by its innermost pid and start time; signals still reach it."""
    if not _nobody_runs_python():
        pytest.skip("user nobody cannot run this Python here")
    node = Node(tmp_path, None, prefix=KILL_ONLY)
    try:
        worker, out = node.worker(0, as_nobody=True)
        assert _identity(out)["registered"], node.agent.log.read_text()
        assert node.workers()[0]["host_pid"] == worker.host_pid

        # The namespace was indeed out of the monitor's reach.
        probe = "import os, sys; os.stat(f'/proc/{sys.argv[1]}/ns/pid')"
        check = subprocess.run(
            [*KILL_ONLY, sys.executable, "-c", probe, str(worker.host_pid)],
            capture_output=True,
            text=True,
        )
        assert "PermissionError" in check.stderr, check.stderr

        # Without its start time such a worker cannot be told apart: refused, saying so.
        # Which words depends on the machine: any other process that is pid 1 of a
        # namespace the monitor may not read (a container's init) is a candidate too.
        namespace = os.stat(f"/proc/{worker.host_pid}/ns/pid").st_ino
        body = {"rank": 1, "local_rank": 0, "pid": 1, "pid_namespace": namespace}
        r = node.agent.worker_api.post("/v1/workers/register", json=body)
        assert r.status_code == 409, r.text
        detail = r.json()["detail"]
        alone = "carries no start_time" in detail
        among_others = "cannot tell which one is the worker" in detail and (
            str(worker.host_pid) in detail
        )
        assert alone or among_others, detail

        r = node.agent.api.post(
            "/v1/emergency-checkpoint", json={"request_id": "em-2", "timeout_s": 20}
        )
        assert r.status_code == 200 and r.json()["missing"] == [], r.text
        r = node.agent.api.post("/v1/workers/stop", json={"grace_s": 20})
        assert r.status_code == 200, r.text
        assert (out / "sigterm").exists()
        wait_for(lambda: _gone(worker.host_pid), 10, "worker gone")
    finally:
        node.close()


def test_find_host_pid_reads_real_proc(node: Node) -> None:
    """The scan itself, on real processes: nested pids, names with ') ', no match."""
    sleeper = node.sleeper()
    me = pidns.self_identity()
    assert (me.pid, me.pid_namespace) == (os.getpid(), os.stat("/proc/self/ns/pid").st_ino)
    assert pidns.nspids("self") == [os.getpid()]
    assert pidns.nspids(sleeper.host_pid) == [sleeper.host_pid, 1]
    namespace = pidns.pid_namespace(sleeper.host_pid)
    started = pidns.start_time(sleeper.host_pid)
    assert namespace is not None and namespace != me.pid_namespace
    found = pidns.find_host_pid(pidns.PidIdentity(1, namespace, started))
    assert found == sleeper.host_pid
    # A command name with spaces and parentheses does not shift the stat fields.
    rename = (
        "import os, sys, time\n"
        "print(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19], flush=True)\n"
        "fd = os.open('/proc/self/comm', os.O_WRONLY)\n"  # as prctl(PR_SET_NAME) does
        "os.write(fd, b'a) 1 2 (c'); os.close(fd)\n"
        "print('renamed', flush=True); time.sleep(300)\n"
    )
    odd = subprocess.Popen(
        [sys.executable, "-c", rename], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
    )
    try:
        assert odd.stdout is not None
        started_at = int(odd.stdout.readline())
        assert odd.stdout.readline() == "renamed\n"
        assert Path(f"/proc/{odd.pid}/comm").read_text() == "a) 1 2 (c\n"
        assert pidns.start_time(odd.pid) == started_at
    finally:
        odd.kill()
        odd.wait()
        odd.stdout.close()  # type: ignore[union-attr]
    with pytest.raises(pidns.PidNotFound, match="cannot find pid 1 of PID namespace 7"):
        pidns.find_host_pid(pidns.PidIdentity(1, 7, started))
    assert pidns.start_time(2**22 + 12345) is None and pidns.nspids(2**22 + 12345) is None
