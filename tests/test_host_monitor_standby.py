"""Warm standbys of a real host monitor: started ahead with the job's modules imported,
forking a worker for every start of the job's command on the node (their exits reported
as a launched worker's), and never left behind when the host monitor dies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from resiliency_protocol.standby_orders import Exited, Forked, Ready, WorkerOrder, parse_reply
from tests.test_host_monitor import Agent, Cluster, wait_for

COMMAND = [sys.executable, "-m", "tests.fixtures.standby_worker", "--flag"]
PRELOAD = ["tests.fixtures.standby_marker"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Agent, Path]]:
    (tmp_path / "monitor").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    cluster = Cluster(tmp_path / "monitor")
    monitor = cluster.start_agent(None, node="node-s", initial_state="spare")
    try:
        yield monitor, out
    finally:
        monitor.close()
        monitor.proc.kill()
        monitor.proc.wait(10)


def preloaded(out: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in out.glob("preloaded-*")}


def workers(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("worker-*.json"))]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def start(monitor: Agent, request_id: str, env: dict[str, str], *ranks: int) -> None:
    body = {
        "request_id": request_id,
        "job": "j1",
        "command": COMMAND,
        "env": env,
        "workers": [{"rank": r, "local_rank": i} for i, r in enumerate(ranks)],
        "standby_preload": PRELOAD,
    }
    r = monitor.api.post("/v1/workers/start", json=body)
    assert r.status_code == 200, r.text


def ended(monitor: Agent, rank: int) -> dict[str, Any] | None:
    worker = monitor.workers().get(rank)
    return worker if worker is not None and worker["exit_code"] is not None else None


def test_a_standby_forks_every_start_of_its_job_and_reports_their_exits(
    agent: tuple[Agent, Path],
) -> None:
    monitor, out = agent
    env = {"STANDBY_OUT": str(out), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    body = {"job": "j1", "command": COMMAND, "env": env, "preload": PRELOAD}
    r = monitor.api.post("/v1/standby", json=body)
    assert r.status_code == 200 and r.json()["ready"] is True, r.text
    (standby,) = wait_for(lambda: preloaded(out), 30, "the standby preloaded")
    # Asked again: the same standby, not a second one; warm once its imports are done.
    wait_for(
        lambda: monitor.api.post("/v1/standby", json=body).json() == {"ready": True, "warm": True},
        30,
        "the standby warm",
    )

    # Two ranks, each forked by the standby: its modules already imported, the rank's
    # own environment, argv and log, each in a process group of its own.
    start(monitor, "s1", {**env, "WORKER_SECONDS": "0.5", "WORKER_EXIT": "3"}, 3, 4)
    first = wait_for(lambda: len(workers(out)) == 2 and workers(out), 30, "the workers ran")
    assert {w["rank"] for w in first} == {"3", "4"}
    for worker in first:
        assert worker["parent"] == standby and worker["pid"] != standby
        assert worker["group"] == worker["pid"]
        assert worker["preloaded"] is True and worker["argv"] == ["--flag"]
    assert {monitor.workers()[r]["host_pid"] for r in (3, 4)} == {w["pid"] for w in first}
    log = (monitor.log.parent / "run" / "node-s.j1.rank3.log").read_text()
    assert "worker rank=3 running" in log
    # Their exit codes, as the standby reaped them.
    done = wait_for(lambda: ended(monitor, 3) and ended(monitor, 4), 30, "both exits seen")
    assert done["exit_code"] == 3 and monitor.workers()[3]["exit_code"] == 3

    # The next start of the job is a fork of the same standby: nothing imported again, and
    # no other standby started (a few seconds after a start, the host monitor asks again).
    start(monitor, "s2", {**env, "WORKER_SECONDS": "60"}, 3)
    (second,) = wait_for(
        lambda: [w for w in workers(out) if w["pid"] not in {x["pid"] for x in first}],
        30,
        "the next worker ran",
    )
    assert second["parent"] == standby and second["preloaded"] is True
    assert preloaded(out) == {standby}
    # Stopped as a launched worker is: its whole group, its end recorded.
    r = monitor.api.post("/v1/workers/stop", json={"grace_s": 5})
    assert r.status_code == 200, r.text
    assert not alive(second["pid"])
    assert monitor.workers()[3]["exit_code"] == -signal.SIGTERM

    # The host monitor dies: its standby goes with it; a worker it forked stays (as a
    # launched one does).
    start(monitor, "s3", {**env, "WORKER_SECONDS": "60"}, 5)
    (third,) = wait_for(
        lambda: [w for w in workers(out) if w["rank"] == "5"], 30, "the third worker ran"
    )
    monitor.proc.send_signal(signal.SIGKILL)
    monitor.proc.wait(10)
    wait_for(lambda: not alive(standby), 10, "the standby gone with its host monitor")
    assert alive(third["pid"])
    os.kill(third["pid"], signal.SIGKILL)


def test_a_standby_that_died_is_not_started_again_and_its_ranks_start_without_one(
    agent: tuple[Agent, Path],
) -> None:
    """A standby whose imports end the interpreter: the next request for it is answered
    `ready: false` (no standby started again, one import per request), and the job's
    ranks start as launched workers."""
    monitor, out = agent
    env = {"STANDBY_OUT": str(out), "PYTHONPATH": str(ROOT)}
    fatal = ["tests.fixtures.standby_fatal"]
    body = {"job": "j1", "command": COMMAND, "env": env, "preload": fatal}
    r = monitor.api.post("/v1/standby", json=body)
    assert r.status_code == 200 and r.json()["ready"] is True, r.text
    cold = {"ready": False, "warm": False}
    wait_for(
        lambda: monitor.api.post("/v1/standby", json=body).json() == cold,
        30,
        "the standby's death seen",
    )
    start_body = {
        "request_id": "s1",
        "job": "j1",
        "command": COMMAND,
        "env": {**env, "WORKER_SECONDS": "0"},
        "workers": [{"rank": 0, "local_rank": 0}],
        "standby_preload": fatal,
    }
    r = monitor.api.post("/v1/workers/start", json=start_body)
    assert r.status_code == 200, r.text
    (ran,) = wait_for(lambda: workers(out), 30, "the worker ran")
    assert ran["parent"] == monitor.proc.pid and ran["preloaded"] is False
    assert monitor.log.read_text().count("standby of job j1 started") == 1


@contextlib.contextmanager
def bare_standby(
    env: dict[str, str], preload: list[str]
) -> Iterator[tuple[subprocess.Popen[bytes], BinaryIO]]:
    """`python -m training.warm_start` without a host monitor: the process, its stdin
    open for orders, and its reply pipe; killed at the end."""
    replies, reply_w = os.pipe()
    argv = [sys.executable, "-m", "training.warm_start", "--reply-fd", str(reply_w)]
    for module in preload:
        argv += ["--preload", module]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, pass_fds=(reply_w,))
    os.close(reply_w)
    assert proc.stdin is not None
    try:
        with os.fdopen(replies, "rb") as pipe:
            yield proc, pipe
    finally:
        proc.kill()
        proc.wait(10)


def run_to_its_end(proc: subprocess.Popen[bytes], pipe: BinaryIO, order: WorkerOrder) -> None:
    """Order a bare standby's worker and wait until it exited 0."""
    assert proc.stdin is not None
    proc.stdin.write(order.to_line())
    proc.stdin.flush()
    forked = parse_reply(pipe.readline())
    assert isinstance(forked, Forked) and forked.pid is not None
    assert parse_reply(pipe.readline()) == Exited(forked.pid, 0)


def test_a_bad_order_is_refused_by_the_standby_which_keeps_serving(tmp_path: Path) -> None:
    """The pipe itself, without a host monitor: a line that is not an order is refused
    with its field named, and the next order is forked."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "STANDBY_OUT": str(out), "PYTHONPATH": str(ROOT)}
    with bare_standby(env, PRELOAD) as (proc, pipe):
        assert proc.stdin is not None
        proc.stdin.write(b'{"argv": ["-c", "pass"], "env": {}}\n')
        order = WorkerOrder(tuple(COMMAND[1:]), {**env, "WORKER_SECONDS": "0"}, None, None)
        proc.stdin.write(order.to_line())
        proc.stdin.flush()
        ready, refused, forked, exited = (parse_reply(pipe.readline()) for _ in range(4))
        assert ready == Ready()
        assert isinstance(refused, Forked) and refused.pid is None
        assert refused.error is not None and "argv" in refused.error
        assert isinstance(forked, Forked) and forked.pid is not None
        assert exited == Exited(forked.pid, 0)
        proc.stdin.close()  # dropped: no child left, so it ends
        assert proc.wait(10) == 64
        assert pipe.readline() == b""


def test_forked_workers_draw_random_numbers_of_their_own(tmp_path: Path) -> None:
    """A launched interpreter seeds torch's generator, NumPy's and Python's from the OS's
    entropy: two workers forked by one standby, which imported all three, must not draw
    the same numbers (the same dropout masks on every rank, the same again after each
    restart), as they would with the standby's generators."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "STANDBY_OUT": str(out), "OMP_NUM_THREADS": "1"}
    with bare_standby(env, ["torch", "numpy.random", "random"]) as (proc, pipe):
        assert proc.stdin is not None
        order = WorkerOrder(("-m", "tests.fixtures.seed_worker"), env, str(ROOT), None)
        assert parse_reply(pipe.readline()) == Ready()
        for _ in range(2):  # one after the other: the second forks what the first left
            run_to_its_end(proc, pipe, order)
        proc.stdin.close()
        assert proc.wait(10) == 64
    first, second = (json.loads(p.read_text()) for p in sorted(out.glob("seeds-*.json")))
    for generator in ("torch_seed", "torch", "numpy", "random"):
        assert first[generator] != second[generator], generator


def test_a_forked_workers_collector_walks_only_its_own_objects(tmp_path: Path) -> None:
    """What the standby imported is frozen before it forks (gc.freeze): a worker's full
    collection walks the worker's own objects, not the imports' hundreds of thousands
    (a tenth of a second each, with torch, and every page it walked unshared)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "STANDBY_OUT": str(out), "PYTHONPATH": str(ROOT)}
    preload = ["asyncio", "email.message", "http.server", "json"]
    with bare_standby(env, preload) as (proc, pipe):
        assert proc.stdin is not None
        order = WorkerOrder(("-m", "tests.fixtures.gc_worker"), env, str(ROOT), None)
        assert parse_reply(pipe.readline()) == Ready()
        run_to_its_end(proc, pipe, order)
        proc.stdin.close()
        assert proc.wait(10) == 64
    seen = json.loads((out / "gc.json").read_text())
    assert seen["frozen"] > 10_000, seen  # the interpreter's and the imports' objects
    assert seen["tracked"] < seen["frozen"] / 5, seen


def test_a_forked_worker_finds_what_torch_imports_on_first_use_imported(tmp_path: Path) -> None:
    """torch imports `torch._dynamo` when a process makes its first optimizer (half a second
    of CPU): a standby that preloaded torch imported it, once, for every worker it forks."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "STANDBY_OUT": str(out), "OMP_NUM_THREADS": "1"}
    with bare_standby(env, ["torch"]) as (proc, pipe):
        assert proc.stdin is not None
        order = WorkerOrder(("-m", "tests.fixtures.first_optimizer_worker"), env, str(ROOT), None)
        assert parse_reply(pipe.readline()) == Ready()
        run_to_its_end(proc, pipe, order)
    (report,) = (json.loads(p.read_text()) for p in out.glob("first-optimizer-*.json"))
    assert not [m for m in report["imported"] if m.startswith("torch._dynamo")], report


def test_a_command_a_standby_cannot_run_has_none(agent: tuple[Agent, Path]) -> None:
    monitor, _ = agent
    for command in (
        [sys.executable, "-c", "pass"],
        [sys.executable, "-X", "dev", "-m", "json.tool"],  # an option it would not have
        ["/bin/sh", "job.sh"],
    ):
        body = {"job": "j1", "command": command, "preload": PRELOAD}
        r = monitor.api.post("/v1/standby", json=body)
        assert r.status_code == 200 and r.json() == {"ready": False, "warm": False}, command
    r = monitor.api.post("/v1/standby", json={**body, "preload": []})
    assert r.status_code == 422 and "preload" in r.text


def script_in(tmp: Path) -> Path:
    """The fixture script, in a folder of its own (a user's script, away from ours)."""
    folder = tmp / "job"
    folder.mkdir()
    script = folder / "train.py"
    script.write_text((ROOT / "tests" / "fixtures" / "standby_script.py").read_text())
    return script


def scripts(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("script-*.json"))]


def test_a_script_is_forked_by_its_standby_as_python_would_run_it(
    agent: tuple[Agent, Path], tmp_path: Path
) -> None:
    """`python -u train.py --flag`, as `supervisor run train.py` makes it: the standby is
    started with `-u` and forks each start, and the script sees what `python train.py`
    shows it: itself as argv[0], its own folder first on the path, `__main__`."""
    monitor, out = agent
    script = script_in(tmp_path)
    command = [sys.executable, "-u", str(script), "--flag"]
    env = {"STANDBY_OUT": str(out), "PYTHONPATH": str(ROOT)}
    body = {"job": "j1", "command": command, "env": env, "preload": PRELOAD}
    wait_for(
        lambda: monitor.api.post("/v1/standby", json=body).json() == {"ready": True, "warm": True},
        30,
        "the standby warm",
    )
    (standby,) = preloaded(out)
    cmdline = Path(f"/proc/{standby}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1:4] == [b"-u", b"-m", b"training.warm_start"]
    start_body = {
        "request_id": "s1",
        "job": "j1",
        "command": command,
        "env": {**env, "WORKER_EXIT": "3"},
        "workers": [{"rank": 2, "local_rank": 0}],
        "standby_preload": PRELOAD,
    }
    r = monitor.api.post("/v1/workers/start", json=start_body)
    assert r.status_code == 200, r.text
    (ran,) = wait_for(lambda: scripts(out), 30, "the script ran")
    assert ran["parent"] == standby and ran["preloaded"] is True
    assert ran["argv"] == [str(script), "--flag"]
    assert ran["path0"] == str(script.parent) and ran["file"] == str(script)
    assert ran["name"] == "__main__" and ran["rank"] == "2"
    done = wait_for(lambda: ended(monitor, 2), 30, "its exit seen")
    assert done["exit_code"] == 3
    log = (monitor.log.parent / "run" / "node-s.j1.rank2.log").read_text()
    assert "script rank=2 running" in log


def test_a_forked_worker_counts_its_own_steps(tmp_path: Path) -> None:
    """The automatic step count (training.auto_progress) is activated at every worker's
    interpreter start, the standby's included, and a forked process does not count: a
    worker the standby forks activates its own, with its own environment, and takes the
    startup folder off PYTHONPATH as a launched worker does."""
    pytest.importorskip("torch")
    from training.auto_progress import STARTUP_DIR

    out = tmp_path / "out"
    out.mkdir()
    script = script_in(tmp_path)
    env = {
        **os.environ,
        "STANDBY_OUT": str(out),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([STARTUP_DIR, str(ROOT)]),
        "HOST_MONITOR_URL": "http://127.0.0.1:9",  # never reached: no optimizer steps
    }
    with bare_standby(env, ["torch.optim"]) as (proc, pipe):
        assert proc.stdin is not None
        assert parse_reply(pipe.readline()) == Ready()
        proc.stdin.write(WorkerOrder((str(script),), env, str(tmp_path), None).to_line())
        proc.stdin.flush()
        forked = parse_reply(pipe.readline())
        assert isinstance(forked, Forked) and forked.pid is not None
        assert parse_reply(pipe.readline()) == Exited(forked.pid, 0)
    (ran,) = scripts(out)
    assert ran["counting"] is True
    assert ran["pythonpath"] == str(ROOT)


#: A script whose exit hook and whose object's end say when they ran. No function of its
#: own: one would hold its namespace in a cycle, left to the collector at the end.
EXIT_ORDER_SCRIPT = """\
import atexit, functools, os

out = os.open(os.environ["EXIT_ORDER"], os.O_WRONLY | os.O_CREAT)

class Model:  # not a descriptor: called with no argument
    __del__ = functools.partial(os.write, out, b"the script's objects destroyed\\n")

model = Model()
atexit.register(os.write, out, b"the exit hooks ran\\n")
os.write(out, b"the script ended\\n")
"""


def test_a_forked_scripts_objects_outlive_its_exit_hooks_as_with_python(tmp_path: Path) -> None:
    """`python train.py` keeps its `__main__` until the interpreter ends: its exit hooks
    (the automatic step count's `finishing`) run before its objects are destroyed (a DDP
    model and its process group, whose destruction can block). A forked worker ends in
    the same order, not with its objects destroyed as the script returns."""
    script = tmp_path / "train.py"
    script.write_text(EXIT_ORDER_SCRIPT)
    plain, forked = tmp_path / "plain.txt", tmp_path / "forked.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(script)], env={**env, "EXIT_ORDER": str(plain)}, check=True)
    with bare_standby(env, []) as (proc, pipe):
        assert parse_reply(pipe.readline()) == Ready()
        order = WorkerOrder((str(script),), {**env, "EXIT_ORDER": str(forked)}, str(tmp_path), None)
        run_to_its_end(proc, pipe, order)
    expected = ["the script ended", "the exit hooks ran", "the script's objects destroyed"]
    assert plain.read_text().splitlines() == expected
    assert forked.read_text().splitlines() == expected
