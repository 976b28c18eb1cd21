"""MTTR and steps lost per fault, with real processes (`supervisor.local.demo.LocalDemo`).

For each policy, one local cluster (host monitors as nodes, the NumPy training job, the
supervisor on the local backend) is started once; faults are injected one at a time with
POST /api/v1/faults and each is followed to the end:

- injected: when the POST returned (the fault is acted out before the answer);
- detected: the `time` of the first event carrying the fault's id;
- resumed: the job's newest attempt (after the remediation's restart) completed a step
  past the one it resumed from. Read from the job's own all-reduce barrier
  (`RUN_DIR/collective/<attempt>/step-<s>/rank-<r>.bin`, see
  `training/numpy_workload/collective.py`), polled every 50 ms: a rank creates
  `step-<s>` once it finished step s, and `step-<R>` holding every rank's file means
  step R + 1 is done. The supervisor's own view (`last_step`) lags up to a worker report
  interval (0.5 s) plus a heartbeat period, too coarse for steps lost;
- resume step and tier: the new attempt's `resumed step=N tier=T` worker log lines;
- step at the fault: the `terminated by SIGTERM at step=N` line of the surviving workers
  when the restart stopped them: once a peer is gone they are stuck in the next step's
  all-reduce, so N is the step the job had completed when the fault hit.

With the PyTorch workload (`workload="torch"`: DDP on gloo, one node per replica) the
job's progress is read from its workers' log lines instead, one per step
(`start attempt=A ...`, then `step=N/...`), tailed every 50 ms: a step logged by any rank
of an attempt was all-reduced by every rank of it. The step at the fault is the newest
step the old attempt logged.

MTTR = resumed - injected; steps lost = step at the fault - resume step. Between faults:
every action finished, every node back (repaired after `node_repair_s`, uncordoned), the
job trained a few more steps (a seeded random number, the same in every run, so the
faults land at the same variety of checkpoint phases for both policies).
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.mttr_progress import CollectiveProgress, LogProgress, Stuck, WorkerLogs
from resiliency_protocol.faults import RESTART_KINDS, FaultKind
from supervisor.local.demo import LocalDemo
from supervisor.local.demo_options import DemoOptions
from supervisor.local.ports import free_port

DEFAULT_POLICY = "policies.default:DefaultPolicy"
BASELINE_POLICY = "policies.examples.periodic_checkpoints_only:PeriodicCheckpointsOnly"
#: What the default run injects: of the table's RESTART_KINDS, all but worker_hang, which
#: the torch run adds (torchrun_mttr.TORCH_KINDS).
KINDS = tuple(k for k in RESTART_KINDS if k != FaultKind.WORKER_HANG)


@dataclass(frozen=True, slots=True)
class MttrConfig:
    faults_per_kind: int = 5
    kinds: tuple[str, ...] = KINDS
    replicas: int = 2
    nodes_per_dp: int = 2
    spares: int = 2
    step_time_s: float = 0.05
    heartbeat_polling_period_s: float = 0.2
    heartbeat_timeout_s: float = 1.0
    node_repair_s: float = 2.0
    fault_timeout_s: float = 60.0  # injection to resumed training, else a failure
    settle_timeout_s: float = 60.0  # all nodes back and training again, else give up
    policy_budget_s: float = 150.0  # no new fault after this long on one policy
    poll_s: float = 0.05
    warmup_steps: int = 12
    settle_steps: tuple[int, int] = (3, 22)  # extra steps before a fault: uniform in range
    seed: int = 7
    keep_dir: Path | None = None  # keep the run directories (logs) here
    workload: str = "numpy"  # or "torch"
    workload_env: tuple[tuple[str, str], ...] = ()
    in_process: bool = True  # torch: heal in-process with warm standbys (else restart all)
    supervisor_env: tuple[tuple[str, str], ...] = ()  # more of the supervisor's settings
    command: tuple[str, ...] | None = None  # the user's own job (`supervisor run`), not `workload`
    nproc_per_node: int = 1  # workers per node (torchrun's --nproc-per-node)

    @property
    def target_s(self) -> float:
        return self.heartbeat_timeout_s + 5.0


@dataclass(slots=True)
class FaultResult:
    kind: str
    victim: str
    error: str | None = None
    mttr_s: float | None = None
    detection_s: float | None = None
    step_at_fault: int | None = None
    resumed_step: int | None = None
    resumed_tier: str | None = None  # the tiers the ranks loaded it from, joined by "+"
    saved_step: int | None = None  # the emergency checkpoint action's result.step
    actions: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def steps_lost(self) -> int | None:
        if self.step_at_fault is None or self.resumed_step is None:
            return None
        return self.step_at_fault - self.resumed_step


@dataclass(slots=True)
class PolicyRun:
    policy: str
    faults: list[FaultResult] = field(default_factory=list)
    error: str | None = None  # the run stopped early: why
    restarts_by_bench: int = 0  # whole-job restarts the bench made (torchrun baseline)

    def of(self, kind: str) -> list[FaultResult]:
        return [f for f in self.faults if f.kind == kind]


def _try_api(demo: LocalDemo, path: str, **params: Any) -> Any:
    try:
        return demo.api(path, **params)
    except httpx.HTTPError:
        return None


# --- one policy ----------------------------------------------------------------------------


class Runner:
    def __init__(self, demo: LocalDemo, config: MttrConfig) -> None:
        self.demo = demo
        self.config = config
        self.job = demo.options.job
        self.world = config.replicas * config.nodes_per_dp
        self.logs = WorkerLogs(demo.run_dir, self.job)
        self.progress: CollectiveProgress | LogProgress = (
            LogProgress(demo.run_dir, self.job)
            if config.workload == "torch"
            else CollectiveProgress(demo.run_dir)
        )

    def _sleep(self) -> None:
        time.sleep(self.config.poll_s)

    def _pending_actions(self) -> list[dict[str, Any]] | None:
        page = _try_api(self.demo, "/api/v1/actions", limit=1000)
        if page is None:
            return None
        return [a for a in page["items"] if a["status"] not in ("succeeded", "failed")]

    def settle(self, extra_steps: int) -> None:
        """Every node back and idle or training, no action running, then `extra_steps`."""
        demo, cfg = self.demo, self.config
        deadline = time.monotonic() + cfg.settle_timeout_s
        start: tuple[int, int] | None = None
        why = "starting"
        while time.monotonic() < deadline:
            demo.repair_nodes()
            nodes = _try_api(demo, "/api/v1/nodes")
            pending = self._pending_actions()
            dead = [n for n, p in demo.monitors.items() if p.poll() is not None]
            if nodes is None or pending is None:
                why = "the supervisor does not answer"
            elif dead:
                why = f"waiting for the repair of {', '.join(dead)}"
            elif pending:
                why = f"actions still running: {[a['type'] for a in pending]}"
            elif len(nodes) < len(demo.options.nodes) or not all(
                n["alive"] and not n["cordoned"] for n in nodes
            ):
                down = [n["name"] for n in nodes if not n["alive"] or n["cordoned"]]
                why = f"nodes not back yet: {down or 'unregistered'}"
            elif len([n for n in nodes if n["job"] == self.job]) != self.world:
                why = "job placement incomplete"
            else:
                attempt, step = self.progress.current()
                if start is None or attempt != start[0]:
                    start = (attempt, step)
                elif step >= start[1] + extra_steps:
                    return
                why = f"training {step}/{start[1] + extra_steps}"
            self._sleep()
        raise Stuck(f"not healthy within {cfg.settle_timeout_s:g}s: {why}")

    def victim(self, index: int) -> str:
        nodes = self.demo.api("/api/v1/nodes", job=self.job)
        names: list[str] = sorted(n["name"] for n in nodes)
        if not names:
            raise Stuck("the job has no nodes")
        return names[index % len(names)]

    def inject(self, kind: str, node: str) -> tuple[int, float, float]:
        """(fault id, monotonic and wall time when the POST returned)."""
        demo = self.demo
        response = httpx.post(
            f"{demo.url}/api/v1/faults",
            json={"kind": kind, "node": node},
            headers={"Authorization": f"Bearer {demo.operator_token}"},
            timeout=10,
        )
        mono, wall = time.monotonic(), time.time()
        if response.status_code != 201:
            raise Stuck(f"POST /api/v1/faults: {response.status_code} {response.text[:200]}")
        return int(response.json()["id"]), mono, wall

    def fault(self, kind: str, index: int) -> FaultResult:
        demo, cfg = self.demo, self.config
        node = self.victim(index)
        result = FaultResult(kind, node)
        old_attempt, _ = self.progress.current()
        self.logs.mark()
        fault_id, t0, wall0 = self.inject(kind, node)
        deadline = t0 + cfg.fault_timeout_s
        resumed_at: dict[int, float] = {}
        resumes: dict[int, tuple[int, str, int]] = {}
        newest = old_attempt
        done = False
        while time.monotonic() < deadline:
            if time.monotonic() - t0 < cfg.node_repair_s - 0.2:
                # Only starts the dead node's repair clock: it cannot act this early (an
                # uncordon now would wait for the hot-swap's lock and stall this loop).
                demo.repair_nodes()
            resumes, _ = self.logs.parse()
            newest = max(self.progress.attempts(), default=old_attempt)
            now = time.monotonic()
            for attempt, (step, _tier, world) in resumes.items():
                if (
                    attempt > old_attempt
                    and attempt not in resumed_at
                    and self.progress.progressed_past(attempt, step, world)
                ):
                    resumed_at[attempt] = now
            if newest > old_attempt and newest in resumed_at:
                pending = self._pending_actions()
                if pending == []:
                    done = True
                    break
            self._sleep()
        resumes, terminated = self.logs.parse()
        self._collect(result, fault_id, wall0)
        if newest in resumes:
            result.resumed_step, result.resumed_tier, _ = resumes[newest]
        if terminated:
            result.step_at_fault = max(terminated)
        elif (newest_old := self.progress.newest_step(old_attempt)) is not None:
            result.step_at_fault = newest_old
        if done:
            result.mttr_s = resumed_at[newest] - t0
        else:
            state = "no restart" if newest == old_attempt else f"attempt {newest} not training"
            result.error = f"not remediated within {cfg.fault_timeout_s:g}s ({state})"
        failed = [a for a in result.actions if not a.endswith(":succeeded")]
        if failed and result.error is None:
            result.error = f"actions {failed}"
        if result.error is None and result.steps_lost is None:
            result.error = "no resume step or no step at the fault in the worker logs"
        return result

    def _collect(self, result: FaultResult, fault_id: int, wall0: float) -> None:
        """Actions and detection time of the fault, from the API."""
        fault = _try_api(self.demo, f"/api/v1/faults/{fault_id}")
        if fault is None:
            return
        for action_id in sorted(fault["actions"]):
            action = _try_api(self.demo, f"/api/v1/actions/{action_id}")
            if action is not None:
                result.actions.append(f"{action['type']}:{action['status']}")
                if action["type"] == "emergency_checkpoint" and action["result"]:
                    result.saved_step = action["result"].get("step")
                if action["status"] == "failed":
                    result.actions[-1] += f" ({action['error']})"
        times = []
        for event_id in fault["events"]:
            event = _try_api(self.demo, f"/api/v1/events/{event_id}")
            if event is not None:
                times.append(datetime.fromisoformat(event["time"]).timestamp())
        if times:
            result.detection_s = min(times) - wall0


def demo_options(policy: str, config: MttrConfig, root: Path) -> DemoOptions:
    """The cluster of `config` under `policy`, in a directory of `root` named after it."""
    return DemoOptions(
        run_dir=root / policy.rsplit(":", 1)[-1],
        port=free_port(),
        replicas=config.replicas,
        nodes_per_dp=config.nodes_per_dp,
        spares=config.spares,
        total_steps=10_000_000,
        step_time_s=config.step_time_s,
        heartbeat_polling_period_s=config.heartbeat_polling_period_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        node_repair_s=config.node_repair_s,
        policy=policy,
        workload=config.workload,
        workload_env=dict(config.workload_env),
        in_process_restart=config.in_process,
        warm_standby=config.in_process,
        command=None if config.command is None else list(config.command),
        nproc_per_node=config.nproc_per_node,
        supervisor_env={
            "SUPERVISOR_MAX_RESTARTS_IN_WINDOW": "1000",
            "SUPERVISOR_FLAP_MAX_LOSSES": "100",
            "SUPERVISOR_MAX_IN_JOB_RESTARTS": "1000",
            "SUPERVISOR_LOG_LEVEL": "warning",
            **dict(config.supervisor_env),
        },
    )


def run_policy(policy: str, config: MttrConfig, root: Path) -> PolicyRun:
    options = demo_options(policy, config, root)
    run = PolicyRun(policy)
    rng = random.Random(config.seed)
    demo = LocalDemo(options)
    started = time.monotonic()
    try:
        demo.start()
        runner = Runner(demo, config)
        runner.settle(config.warmup_steps)
        for kind in config.kinds:
            for index in range(config.faults_per_kind):
                if time.monotonic() - started > config.policy_budget_s:
                    raise Stuck(f"time budget of {config.policy_budget_s:g}s spent")
                runner.settle(rng.randint(*config.settle_steps))
                run.faults.append(runner.fault(kind, index))
    except (Stuck, RuntimeError, httpx.HTTPError) as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        demo.stop()
    return run


def run_one(policy: str, config: MttrConfig, name: str) -> PolicyRun:
    """One policy on a fresh cluster of its own (kept under `keep_dir/name` if set)."""
    if config.keep_dir is not None:
        config.keep_dir.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=config.keep_dir))
        return run_policy(policy, config, root)
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        return run_policy(policy, config, Path(tmp))


def run(config: MttrConfig) -> tuple[PolicyRun, PolicyRun]:
    """(default policy, periodic checkpoints only), each on its own fresh cluster."""
    if config.keep_dir is not None:
        config.keep_dir.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="mttr-", dir=config.keep_dir))
        return run_policy(DEFAULT_POLICY, config, root), run_policy(BASELINE_POLICY, config, root)
    with tempfile.TemporaryDirectory(prefix="bench-mttr-") as tmp:
        root = Path(tmp)
        return run_policy(DEFAULT_POLICY, config, root), run_policy(BASELINE_POLICY, config, root)
