"""training.auto_progress: a PyTorch script that imports nothing of this project, started
as `supervisor run` and `training.pod_launch` start a worker (the startup directory first
on PYTHONPATH), reports its optimizer steps to its host monitor (a recording server here);
RESILIENCY_AUTO_PROGRESS=0 turns that off; a script with its own WorkerClient is not
counted twice; the interpreter's start stays cheap and the user's own sitecustomize runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.run_cli import add_commands, options
from tests.test_worker_client import RecordingServer, wait_for
from training.auto_progress import STARTUP_DIR, startup_env
from training.auto_progress.counter import StepCounter

ROOT = Path(__file__).resolve().parent.parent
STEPS = 7

#: The end of each script: it waits (up to a minute) for the test to have seen what it
#: waits for (the newest step sent by a client's thread, every 0.5 s), then says whether
#: the automatic count was activated.
END = """
import os, sys, time
deadline = time.monotonic() + 60
while not os.path.exists("stop") and time.monotonic() < deadline:
    time.sleep(0.05)
auto = sys.modules.get("training.auto_progress")
print("activated:", getattr(auto, "active", None) is not None)
"""

#: A plain script: a generator and a discriminator, each with its own optimizer, both
#: stepping in every training step (in an order that changes).
TWO_OPTIMIZERS = f"""
import torch
g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt_g = torch.optim.SGD(g.parameters(), lr=0.01)
opt_d = torch.optim.Adam(d.parameters(), lr=0.01)
for step in range({STEPS}):
    d(g(torch.randn(8, 4))).sum().backward()
    first, second = (opt_d, opt_g) if step % 2 else (opt_g, opt_d)
    first.step(); second.step()
    opt_d.zero_grad(); opt_g.zero_grad()
"""

#: A script that reports its own steps (1001, 1002, ...): from its first step, or only
#: after `LATE` steps counted automatically.
OWN_STEPS = f"""
import os, time, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
late = int(os.environ.get("LATE", "0"))
client = None
for step in range(1, {STEPS} + late + 1):
    if client is None and step > late:
        import training.auto_progress as auto
        deadline = time.monotonic() + 60
        while late and auto.active.client is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the automatic count registered
        from training.worker_client import WorkerClient
        client = WorkerClient.from_env()
        client.register(world_size=2)
    model(torch.randn(8, 4)).sum().backward()
    opt.step(); opt.zero_grad()
    if client is not None:
        client.report_step(1000 + step)
print("count:", auto.active is None or (auto.active.done.wait(5) and auto.active.off))
"""


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    s = RecordingServer()
    try:
        yield s
    finally:
        s.close()


def worker_env(url: str | None, **extra: str) -> dict[str, str]:
    """A worker's environment as its launcher gives it: the startup directory first on
    PYTHONPATH, then the checkout (where `training` is)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SUPERVISOR_", "HOST_MONITOR_", "RESILIENCY_"))
    }
    env.update(startup_env({"PYTHONPATH": str(ROOT)}))
    env.update(RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", OMP_NUM_THREADS="1")
    if url is not None:
        env["HOST_MONITOR_URL"] = url
    return {**env, **extra}


def run_script(tmp: Path, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (tmp / "train.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def run_until(
    tmp: Path, code: str, env: dict[str, str], server: RecordingServer, last_step: int | None
) -> str:
    """Run `code` + END until `server` has seen `last_step` (None: at once); its output."""
    (tmp / "train.py").write_text(code + END)
    proc = subprocess.Popen(
        [sys.executable, "train.py"],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if last_step is not None:
            wait_for(lambda: last_step in steps_of(server), 60)
        (tmp / "stop").touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    return out


def steps_of(server: RecordingServer) -> list[int]:
    return [b["step"] for b in server.bodies("/progress") if b.get("step") is not None]


def test_a_plain_torch_script_reports_one_step_per_round_of_its_optimizers(
    tmp_path: Path, server: RecordingServer
) -> None:
    out = run_until(tmp_path, TWO_OPTIMIZERS, worker_env(server.url), server, STEPS)
    assert "activated: True" in out
    [registration] = server.bodies("/v1/workers/register")
    assert (registration["rank"], registration["world_size"]) == (1, 2)
    steps = steps_of(server)
    assert steps and steps == sorted(steps), steps
    assert steps[-1] == STEPS, steps  # two optimizers a step: counted once
    assert all(path.startswith("/v1/workers/1/") for path, _, _ in server.requests[1:])
    # At the interpreter's exit: finishing (its exit may take seconds, which is no hang).
    assert len(server.bodies("/finishing")) == 1


def test_turned_off_or_without_a_host_monitor_nothing_is_reported(
    tmp_path: Path, server: RecordingServer
) -> None:
    env = worker_env(server.url, RESILIENCY_AUTO_PROGRESS="0")
    assert "activated: False" in run_until(tmp_path, TWO_OPTIMIZERS, env, server, None)
    assert server.requests == []
    # Without a host monitor: not activated either.
    out = run_until(tmp_path, TWO_OPTIMIZERS, worker_env(None), server, None)
    assert "activated: False" in out


def test_a_script_that_reports_its_own_steps_is_not_counted_twice(
    tmp_path: Path, server: RecordingServer
) -> None:
    out = run_until(tmp_path, OWN_STEPS, worker_env(server.url), server, 1000 + STEPS)
    # Its client registered before its first step: the count never did.
    assert len(server.bodies("/v1/workers/register")) == 1
    steps = steps_of(server)
    assert steps and all(step > 1000 for step in steps), steps
    assert steps[-1] == 1000 + STEPS
    assert "count: True" in out


def test_a_script_client_that_comes_later_takes_over_from_the_count(
    tmp_path: Path, server: RecordingServer
) -> None:
    env = worker_env(server.url, LATE="3")
    out = run_until(tmp_path, OWN_STEPS, env, server, 1000 + 3 + STEPS)
    registrations = server.bodies("/v1/workers/register")
    assert len(registrations) == 2  # the count's, then the script's
    steps = steps_of(server)
    counted = [s for s in steps if s < 1000]
    assert counted and max(counted) == 3, steps
    # Once the script's steps come, the count's never again (no step back and forth).
    first_own = next(i for i, s in enumerate(steps) if s > 1000)
    assert all(s > 1000 for s in steps[first_own:]), steps
    assert steps[-1] == 1000 + 3 + STEPS
    assert not server.bodies("/finishing")  # the count stepped aside without a word
    assert "count: True" in out


def test_the_start_stays_cheap_and_the_users_sitecustomize_still_runs(tmp_path: Path) -> None:
    user_site = tmp_path / "user-site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE'] = 'ran'\n")
    env = worker_env("http://127.0.0.1:9")
    env["PYTHONPATH"] = os.pathsep.join([STARTUP_DIR, str(user_site), str(ROOT)])
    probe = (
        "import json, os, sys\n"
        "print(json.dumps({'user_site': os.environ.get('USER_SITE'),\n"
        "  'sitecustomize': sys.modules['sitecustomize'].__file__,\n"
        "  'loaded': sorted(m for m in ('torch', 'httpx', 'training.worker_client')\n"
        "                   if m in sys.modules),\n"
        "  'active': 'training.auto_progress' in sys.modules,\n"
        "  'pythonpath': os.environ.get('PYTHONPATH'),\n"
        f"  'on_path': {STARTUP_DIR!r} in sys.path}}))\n"
    )
    done = run_script(tmp_path, probe, env)
    seen = json.loads(done.stdout)
    assert seen["user_site"] == "ran"
    assert seen["sitecustomize"] == str(user_site / "sitecustomize.py")
    assert seen["active"] and seen["loaded"] == []  # nothing heavy before torch is imported
    # The processes the worker starts do not count: the directory is off their path.
    assert seen["pythonpath"] == os.pathsep.join([str(user_site), str(ROOT)])
    assert not seen["on_path"]


class FakeOptimizer:
    pass


def test_the_count_is_one_step_per_round_of_optimizer_steps() -> None:
    counter = StepCounter()
    a, b = FakeOptimizer(), FakeOptimizer()
    assert [counter.optimizer_stepped(a) for _ in range(3)] == [1, 2, 3]
    # Two optimizers a step, in any order (an optimizer wrapping another too): once each.
    counter = StepCounter()
    rounds = [(a, b), (b, a), (a, b), (a, b)]
    assert [[counter.optimizer_stepped(o) for o in pair] for pair in rounds] == [
        [1, 1],
        [2, 2],
        [3, 3],
        [4, 4],
    ]
    # A replacement kept alive joins the step it came in, then counts.
    counter = StepCounter()
    counter.optimizer_stepped(a)
    assert [counter.optimizer_stepped(b) for _ in range(3)] == [1, 2, 3]
    # One freed (re-created each step): the new one's first step counts at once.
    counter = StepCounter()
    opt: Any = FakeOptimizer()
    counter.optimizer_stepped(opt)
    for step in (2, 3, 4):
        opt = FakeOptimizer()
        gc.collect()
        assert counter.optimizer_stepped(opt) == step


def test_supervisor_run_and_pod_launch_arrange_it_unless_turned_off(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    argv = ["run", "--run-dir", str(tmp_path / "run"), str(tmp_path / "train.py")]
    path = options(parser.parse_args(argv)).workload_env["PYTHONPATH"]
    assert path.split(os.pathsep)[0] == STARTUP_DIR
    no = options(parser.parse_args([*argv[:1], "--no-auto-progress", *argv[1:]]))
    assert "PYTHONPATH" not in no.workload_env
    assert startup_env({"RESILIENCY_AUTO_PROGRESS": "0", "PYTHONPATH": "x"}) == {}
    # pod_launch: each rank activated when the pod has a host monitor, and not turned off.
    probe = "import sys; print('training.auto_progress' in sys.modules)"
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("HOST_MONITOR_", "RESILIENCY_"))
    }
    seen = []
    for extra in (
        {"HOST_MONITOR_URL": "http://127.0.0.1:9"},
        {"HOST_MONITOR_URL": "http://127.0.0.1:9", "RESILIENCY_AUTO_PROGRESS": "0"},
        {},
    ):
        done = subprocess.run(
            [sys.executable, "-m", "training.pod_launch", "--", sys.executable, "-c", probe],
            cwd=ROOT,
            env={**base, "PYTHONPATH": str(ROOT), **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip())
    assert seen == ["True", "False", "False"]
