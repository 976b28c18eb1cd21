"""torchrun's own elastic restart of the PyTorch workload, without the supervisor: the
baseline of the torch MTTR rows.

Two torchrun agents on this machine stand for two nodes, by default one worker each
(`--nnodes=1:2 --nproc-per-node=1`; `TorchrunConfig.nnodes` and `nproc_per_node` give
other flags, e.g. `--nnodes=2 --nproc-per-node=2`), c10d rendezvous on 127.0.0.1,
`--max-restarts` high enough for every fault of the run, running `python -m
training.torch_workload` with the model, step time and checkpoint frequencies of the
supervised job (a RAM tier per node, a shared durable tier, no host monitor). The same
faults, acted out with the same signals the host monitors send:

- worker_crash: SIGKILL one worker of a node. The agent sees it exit and restarts the
  worker group, which resumes from the newest checkpoint every rank holds.
- node_down: SIGKILL one node's agent and its workers; the node comes back (a new agent)
  `node_repair_s` later, as the local cluster repairs its nodes. The survivor's workers
  fail in their collective and its agent re-rendezvouses, with one node or two (with
  `--nnodes=2` it waits for the repaired node). The c10d store lives in the first agent:
  when that node dies the other agent cannot rendezvous at all, and the job is lost
  (then started again from its checkpoints to go on; the fault counts as not recovered).
- worker_hang: SIGSTOP one worker of a node. torchrun has no heartbeat of its own: the
  fault counts as not detected and not recovered once `fault_timeout_s` has passed; the
  stopped worker is then SIGKILLed so that the run can go on.

Progress comes from the workers' log lines (the agents' output, which every worker of an
agent writes to a whole line at a time: `start attempt=... resumed step=R`, then one
`step=N/...` line per step), tailed every 50 ms. Detected: an agent logs that its worker
group FAILED. Resumed: a worker of a new worker group logs a step past the one it
resumed from. The step at the fault: the newest step logged before the new group
started.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.mttr import FaultResult, PolicyRun
from bench.mttr_progress import read_lines
from resiliency_protocol import worker_env
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.faults import RESTART_KINDS, FaultKind
from resiliency_protocol.shared_settings import HOST_MONITOR_ENV_PREFIX
from supervisor.local.ports import free_port

START = re.compile(
    r"start attempt=\S+ world_size=(\d+): (?:resumed step=(\d+) tier=(\w+)|starting)"
)
STEP_LINE = re.compile(r" step=(\d+)/\d+ ")
FAILED = re.compile(r"Worker group (FAILED|UNHEALTHY)")
NODES = ("node-0", "node-1")
# The torch workload of the MTTR rows, under the supervisor and under torchrun: small
# enough for four ranks' worth of processes on two cores, one log line per step (progress
# is read from them).
TORCH_MTTR_ENV = (
    ("D_MODEL", "64"),
    ("N_LAYERS", "2"),
    ("N_HEADS", "4"),
    ("SEQ_LEN", "32"),
    ("LOG_EVERY_STEPS", "1"),
    ("OMP_NUM_THREADS", "1"),
)
TORCH_KINDS: tuple[str, ...] = RESTART_KINDS


@dataclass(frozen=True, slots=True)
class TorchrunConfig:
    faults_per_kind: int = 5
    kinds: tuple[str, ...] = TORCH_KINDS
    step_time_s: float = 0.05
    in_memory_checkpointing_freq: int = 10
    s3_checkpointing_freq: int = 20
    node_repair_s: float = 2.0
    fault_timeout_s: float = 30.0
    settle_timeout_s: float = 120.0
    warmup_steps: int = 12
    settle_steps: tuple[int, int] = (3, 22)
    seed: int = 7
    poll_s: float = 0.05
    workload_env: tuple[tuple[str, str], ...] = ()
    keep_dir: Path | None = None
    nnodes: str = "1:2"  # torchrun's --nnodes: "1:2" goes on with one node, "2" waits for two
    nproc_per_node: int = 1  # torchrun's --nproc-per-node: workers per agent

    @property
    def world_size(self) -> int:
        return len(NODES) * self.nproc_per_node


class Lost(Exception):
    """Both agents are gone: the job cannot go on by itself."""


@dataclass
class LogTail:
    """New complete lines of one agent's log, with the time they were first seen."""

    path: Path
    offset: int = 0
    lines: list[tuple[float, str]] = field(default_factory=list)

    def read(self) -> list[tuple[float, str]]:
        got = read_lines(self.path, self.offset)
        if got is None:
            return []
        self.offset, lines = got
        now = time.monotonic()
        new = [(now, line) for line in lines]
        self.lines += new
        return new


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (from /proc), children first."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out += [child, *descendants(child)]
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every process under it, stopped ones included."""
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(target, signal.SIGCONT)
            os.killpg(target, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


class TorchrunJob:
    """The two agents, their logs, and what their workers logged."""

    def __init__(self, root: Path, config: TorchrunConfig) -> None:
        self.root = root
        self.config = config
        self.port = free_port()
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.tails: dict[str, LogTail] = {}
        self.down_since: dict[str, float] = {}
        self.logs: list[object] = []

    def env(self, node: str) -> dict[str, str]:
        c = self.config
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith((HOST_MONITOR_ENV_PREFIX, "CHECKPOINT_", "SUPERVISOR_"))
        }
        return {
            **base,
            **dict(c.workload_env),
            "LOGLEVEL": "INFO",
            "TOTAL_STEPS": "10000000",
            "STEP_TIME_S": str(c.step_time_s),
            "LOG_EVERY_STEPS": "1",
            "IN_MEMORY_CHECKPOINTING_FREQ": str(c.in_memory_checkpointing_freq),
            "S3_CHECKPOINTING_FREQ": str(c.s3_checkpointing_freq),
            worker_env.CHECKPOINT_RAM_DIR: str(self.root / node / Tier.RAM),
            worker_env.CHECKPOINT_DURABLE_DIR: str(self.root / Tier.DURABLE),
            worker_env.OUTPUT_DIR: str(self.root / "output"),
        }

    def start_agent(self, node: str) -> None:
        path = self.root / f"{node}.log"
        log = path.open("ab")
        self.logs.append(log)
        self.agents[node] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={self.config.nnodes}",
                f"--nproc-per-node={self.config.nproc_per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}",
                "--rdzv-id=bench",
                "--max-restarts=1000",
                "--monitor-interval=0.1",
                "-m",
                "training.torch_workload",
            ],
            env=self.env(node),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.tails.setdefault(node, LogTail(path))
        self.down_since.pop(node, None)

    def start(self) -> None:
        for node in NODES:
            self.start_agent(node)

    def worker_pid(self, node: str) -> int:
        """One of the agent's workers: its first child process."""
        agent = self.agents[node].pid
        try:
            children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        except OSError:
            children = []
        if not children:
            raise Lost(f"{node}: the agent has no worker")
        return int(children[0])

    def kill_node(self, node: str) -> None:
        """The machine goes: its agent and every process under it. torchrun starts its
        workers in sessions of their own, so the agent's process group alone would leave
        them running (holding their peers in a collective, and their memory)."""
        kill_tree(self.agents[node].pid)
        self.agents[node].wait(10)
        self.down_since[node] = time.monotonic()

    def repair(self) -> None:
        for node, since in list(self.down_since.items()):
            if time.monotonic() - since >= self.config.node_repair_s:
                self.start_agent(node)

    def alive(self) -> list[str]:
        return [n for n, p in self.agents.items() if p.poll() is None]

    def read(self) -> dict[str, list[tuple[float, str]]]:
        return {node: tail.read() for node, tail in self.tails.items()}

    def stop(self) -> None:
        for proc in self.agents.values():
            kill_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for log in self.logs:
            with contextlib.suppress(Exception):
                log.close()  # type: ignore[attr-defined]

    def restart_all(self) -> None:
        self.stop()
        self.port = free_port()
        self.start()


class Runner:
    def __init__(self, job: TorchrunJob, config: TorchrunConfig) -> None:
        self.job = job
        self.config = config
        # Per node: the world size of its newest worker group, and the newest step.
        self.world: dict[str, int] = {}
        self.step = -1
        #: Times the bench started the whole job again because torchrun could not.
        self.restarts_by_bench = 0

    def _track(self, new: dict[str, list[tuple[float, str]]]) -> None:
        for node, lines in new.items():
            for _, line in lines:
                if m := START.search(line):
                    self.world[node] = int(m[1])
                elif m := STEP_LINE.search(line):
                    self.step = max(self.step, int(m[1]))

    def settle(self, extra_steps: int) -> None:
        """Both nodes up and in one world of both nodes' workers, then `extra_steps` more
        steps."""
        job, cfg = self.job, self.config
        deadline = time.monotonic() + cfg.settle_timeout_s
        start: int | None = None
        unhealthy_since = time.monotonic()
        while time.monotonic() < deadline:
            job.repair()
            self._track(job.read())
            stuck = time.monotonic() - unhealthy_since > cfg.fault_timeout_s
            if not job.alive() or stuck:
                # The job was lost, or its rendezvous keeps failing: start it again from
                # its checkpoints, as the scheduler above torchrun would.
                job.restart_all()
                self.restarts_by_bench += 1
                unhealthy_since = time.monotonic()
                start = None
            healthy = len(job.alive()) == 2 and all(
                self.world.get(n) == cfg.world_size for n in NODES
            )
            if not healthy:
                start = None
            elif start is None:
                start = self.step
            elif self.step >= start + extra_steps:
                return
            if start is not None and self.step > start:
                unhealthy_since = time.monotonic()
            time.sleep(cfg.poll_s)
        raise Lost(
            f"torchrun did not get back to two nodes training within {cfg.settle_timeout_s:g}s"
        )

    def fault(self, kind: str, index: int) -> FaultResult:
        job, cfg = self.job, self.config
        node = NODES[index % 2]
        result = FaultResult(kind, node)
        self._track(job.read())
        step_before = self.step
        injected = time.monotonic()
        if kind == FaultKind.WORKER_CRASH:
            os.kill(job.worker_pid(node), signal.SIGKILL)
        elif kind == FaultKind.WORKER_HANG:
            hung = job.worker_pid(node)
            os.kill(hung, signal.SIGSTOP)
        elif kind == FaultKind.NODE_DOWN:
            job.kill_node(node)
        else:
            raise ValueError(kind)
        detected: float | None = None
        resumed_from: int | None = None
        tiers: set[str] = set()
        newest_old = step_before
        while time.monotonic() - injected < cfg.fault_timeout_s:
            job.repair()
            new = job.read()
            for lines in new.values():
                for seen, line in lines:
                    if detected is None and FAILED.search(line):
                        detected = seen
                    if m := START.search(line):
                        if resumed_from is None or int(m[2] or 0) != resumed_from:
                            resumed_from = int(m[2] or 0)
                            tiers = set()
                        tiers.add(m[3] or "none")
                    elif m := STEP_LINE.search(line):
                        step = int(m[1])
                        if resumed_from is None:
                            newest_old = max(newest_old, step)
                        elif step > resumed_from and result.mttr_s is None:
                            result.mttr_s = seen - injected
            self._track(new)
            if result.mttr_s is not None:
                break
            if not job.alive():
                result.error = "job lost: every torchrun agent exited"
                break
            time.sleep(cfg.poll_s)
        if detected is not None:
            result.detection_s = detected - injected
        result.step_at_fault = newest_old
        result.resumed_step = resumed_from
        result.resumed_tier = "+".join(sorted(tiers)) if tiers else None
        if result.mttr_s is None and result.error is None:
            what = "not detected" if detected is None else "detected, not resumed"
            result.error = f"{what} within {cfg.fault_timeout_s:g}s"
        if kind == FaultKind.WORKER_HANG and result.mttr_s is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)  # let the run go on
        return result


def run(config: TorchrunConfig) -> PolicyRun:
    out = PolicyRun("torchrun --max-restarts")
    rng = random.Random(config.seed)
    if config.keep_dir is not None:
        config.keep_dir.mkdir(parents=True, exist_ok=True)
        context: contextlib.AbstractContextManager[str] = contextlib.nullcontext(
            tempfile.mkdtemp(prefix="torchrun-", dir=config.keep_dir)
        )
    else:
        context = tempfile.TemporaryDirectory(prefix="bench-torchrun-")
    with context as tmp:
        job = TorchrunJob(Path(tmp), config)
        runner = Runner(job, config)
        try:
            job.start()
            runner.settle(config.warmup_steps)
            for kind in config.kinds:
                for index in range(config.faults_per_kind):
                    runner.settle(rng.randint(*config.settle_steps))
                    out.faults.append(runner.fault(kind, index))
        except (Lost, OSError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        finally:
            job.stop()
        out.restarts_by_bench = runner.restarts_by_bench
    return out
