"""How long a frozen rank goes unnoticed: a plain DDP script that imports nothing of this
project under `supervisor run` (its optimizer steps counted by training.auto_progress),
the same script reporting its own steps through the worker client, and the plain script
under torchrun, which watches exits only.

Each run is 2 ranks on gloo (`--nnodes 2 --nproc-per-node 1` for the supervisor, one
node of 2 for torchrun) stepping every STEP_TIME_S; rank 1 is stopped with SIGSTOP past
step WARM_STEPS, and the time to the first `hang` or `worker_heartbeat_lost` event is
measured (torchrun: whether anything ended within TORCHRUN_WAIT_S; gloo's collectives
time out after 30 minutes by default, NCCL's after 10). The hang timeout is fixed
(`hang_timeout_s`), so the rows compare what each kind of job needs to be seen at all.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.table import Row, verdict
from resiliency_protocol import worker_env
from resiliency_protocol.shared_settings import HOST_MONITOR_ENV_PREFIX

HANG_TIMEOUT_S = 4.0
STEP_TIME_S = 0.05
WARM_STEPS = 20
#: Heartbeat periods and the sensor's own: what a detection may take past the timeout.
SLACK_S = 6.0
TORCHRUN_WAIT_S = 60.0
BANNER = re.compile(r"the supervisor at (\S+) \(operator token (\S+)\)")

PLAIN = """\
import os, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print(f"pid {os.getpid()} rank {dist.get_rank()}", flush=True)
for step in range(1, 100_000):
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(float(os.environ["STEP_TIME_S"]))
"""

#: The same script reporting its own steps (docs/training.md, the worker client).
INSTRUMENTED = (
    PLAIN.replace(
        "import torch\n", "import torch\nfrom training.worker_client import WorkerClient\n"
    )
    .replace(
        "for step in range(1, 100_000):\n",
        "client = WorkerClient.from_env()\nclient.register(world_size=dist.get_world_size())\n"
        "for step in range(1, 100_000):\n",
    )
    .replace("    opt.zero_grad()\n", "    opt.zero_grad()\n    client.report_step(step)\n")
)


@dataclass(frozen=True, slots=True)
class Detection:
    seconds: float | None  # None: not seen
    what: str


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SUPERVISOR_", HOST_MONITOR_ENV_PREFIX, "CHECKPOINT_"))
    }
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return {**env, "OMP_NUM_THREADS": "1", "STEP_TIME_S": f"{STEP_TIME_S:g}", **extra}


class _Output:
    """A process's output lines, read as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, pattern: re.Pattern[str], within: float) -> re.Match[str]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if (match := pattern.search(line)) is not None:
                    return match
            if self._proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"no line like {pattern.pattern!r}:\n" + "\n".join(self.lines[-40:]))


def _stop(proc: subprocess.Popen[str], frozen: int | None) -> None:
    if frozen is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)  # `supervisor run` stops every process it started
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def supervised(tmp: Path, script: str, auto: bool) -> Detection:
    """`supervisor run` of `script` on 2 nodes x 1 rank; seconds from SIGSTOP of rank 1 to
    the first event that says so."""
    (tmp / "train.py").write_text(script)
    command = [sys.executable, "-m", "supervisor.cli", "run", "--run-dir", str(tmp / "run")]
    command += ["--nnodes", "2", "--nproc-per-node", "1"]
    command += ["--set", f"hang_timeout_s={HANG_TIMEOUT_S:g}", "train.py"]
    extra = {} if auto else {worker_env.AUTO_PROGRESS: "0"}
    proc = subprocess.Popen(
        command,
        cwd=tmp,
        env=_env(extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = _Output(proc)
    frozen: int | None = None
    try:
        url, token = output.wait(BANNER, 120).groups()
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=5)
        deadline = time.monotonic() + 180
        while (api.get("/api/v1/jobs/job").json().get("last_step") or 0) < WARM_STEPS:
            if time.monotonic() > deadline:
                raise RuntimeError("no step reported:\n" + "\n".join(output.lines[-40:]))
            time.sleep(0.2)
        [worker] = api.get("/api/v1/nodes/node-1").json()["workers"]
        frozen = int(worker["pid"])
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        query = "/api/v1/events?type=hang&type=worker_heartbeat_lost&job=job"
        while time.monotonic() - stopped < HANG_TIMEOUT_S + SLACK_S + 30:
            items = api.get(query).json()["items"]
            if items:
                return Detection(time.monotonic() - stopped, items[-1]["type"])
            time.sleep(0.1)
        return Detection(None, "none")
    finally:
        _stop(proc, frozen)


def under_torchrun(tmp: Path) -> Detection:
    """torchrun (one node of 2 ranks) of the plain script: whether anything ends within
    TORCHRUN_WAIT_S of rank 1's SIGSTOP."""
    (tmp / "train.py").write_text(PLAIN)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "train.py"]
    proc = subprocess.Popen(
        command,
        cwd=tmp,
        env=_env({}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = _Output(proc)
    frozen: int | None = None
    try:
        frozen = int(output.wait(re.compile(r"pid (\d+) rank 1"), 120).group(1))
        time.sleep(WARM_STEPS * STEP_TIME_S)
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < TORCHRUN_WAIT_S:
            if proc.poll() is not None:
                return Detection(time.monotonic() - stopped, f"exit {proc.returncode}")
            time.sleep(0.5)
        return Detection(None, "none")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _told(d: Detection, bound: float) -> str:
    if d.seconds is None:
        return f"not seen within {bound:.0f} s"
    return f"{d.seconds:.1f} s ({d.what})"


def rows() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as root:
        tmp = Path(root)
        for name in ("plain", "instrumented", "torchrun"):
            (tmp / name).mkdir()
        plain = supervised(tmp / "plain", PLAIN, auto=True)
        instrumented = supervised(tmp / "instrumented", INSTRUMENTED, auto=False)
        torchrun = under_torchrun(tmp / "torchrun")
    bound = HANG_TIMEOUT_S + SLACK_S
    waited = HANG_TIMEOUT_S + SLACK_S + 30
    return [
        Row(
            f"A rank frozen (SIGSTOP), 2 ranks, hang_timeout_s={HANG_TIMEOUT_S:g}: time to "
            "detect, the script unchanged under `supervisor run`",
            _told(plain, waited),
            f"reporting its own steps: {_told(instrumented, waited)}; under torchrun: "
            f"{_told(torchrun, TORCHRUN_WAIT_S)}",
            f"< {bound:g} s",
            verdict(plain.seconds is not None and plain.seconds < bound),
        )
    ]
