"""A chaos run: random faults on the local cluster for N minutes, then an account of them.

One local cluster (`supervisor.local.demo.LocalDemo`: host monitors as nodes, the NumPy
training job of 2 replicas x 2 nodes, or the PyTorch job of 2 replicas of one node, 2
spares, the supervisor on the local backend with the default policy). Once the job
trains, a fault schedule `{"schedule": "random,<mean>"}` (worker crashes, worker hangs,
node losses, drawn by the supervisor itself) runs for
`minutes`; lost nodes are "repaired" after `node_repair_s` and come back as spares. Then
the schedule is deleted and the job is left to finish. Its final weights are compared
with those of an uninterrupted run of the same job, seed and steps, computed beforehand
by the same workers without a supervisor.

The job's length is what it would train in the window without a fault, so that it is
still training when the last fault lands.

Per fault the schedule injected (`GET /api/v1/faults`, the children of the schedule):
- refused: the node refused it (its worker was already down, being restarted): ended at
  once, nothing caused;
- remediated: it caused at least one event, no action taken for its events is still
  open, and it was healed as bench/chaos_judge.py judges (its last remedy succeeded, or a
  later remedy of the job did soon after; which one is listed). A fault whose consequence
  another fault's restart already healed has its actions skipped, or none: it counts as
  remediated;
- not remediated: no event within its window (undetected), an action still open, or its
  last remedy failed and no later one healed the job.
An emergency checkpoint that did not commit (none of the job's workers between worlds had
anything to save, or a rank could not) does not make the fault's remedy fail: it is listed
apart, each with its error, for the operator.
Also: actions still open after the job finished (stuck), processes left after the
cluster is stopped (orphans), and whether the final weights match bit for bit.

A job that stalls (no new step for several hang timeouts while it is not finished,
bench/stall.py) fails the run at once, with what the supervisor said of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.chaos_judge import judge
from bench.chaos_network import NetworkChaos, NetworkFault
from bench.stall import Stalled, StallWatch
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.shared_settings import HOST_MONITOR_ENV_PREFIX
from supervisor.local.demo import LocalDemo, leftover_processes
from supervisor.local.demo_options import DemoOptions
from supervisor.local.ports import free_port

SEED = 7
#: The torch workload, small enough for two ranks on two cores.
TORCH_ENV = {"D_MODEL": "64", "N_LAYERS": "2", "N_HEADS": "4", "SEQ_LEN": "32"}
Output = list[np.ndarray[Any, Any]] | str  # the NumPy job's shards, the torch job's hash


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    minutes: float = 2.0
    mean_interval_s: float = 15.0  # between faults, exponential
    replicas: int = 2
    nodes_per_dp: int = 2
    spares: int = 2
    step_time_s: float = 0.05
    heartbeat_polling_period_s: float = 0.2
    heartbeat_timeout_s: float = 1.0
    node_repair_s: float = 10.0
    #: After the window, the job has this long to finish: at least 10 minutes, and three
    #: times the window (a loaded machine trains slower than step_time_s says).
    finish_timeout_s: float = 600.0
    #: `numpy` or `torch` (then nodes_per_dp is 1: each node holds one rank).
    workload: str = "numpy"
    #: The torch job's layout: `ddp`, or `hsdp` (FSDP2 on a 2-D mesh: replicas / 2
    #: replica groups of 2 shards each, so that every shard has a copy on another node).
    parallelism: str = "ddp"
    #: No new step for this many hang timeouts, unfinished: the run fails (stalled).
    stall_hang_timeouts: float = 3.0
    #: Every host on a network of its own, cut at random as well (bench/chaos_network.py),
    #: a fault every `network_mean_interval_s` on average.
    network_faults: bool = False
    network_mean_interval_s: float = 30.0
    #: Scale down when no spare is left, back up later. Off for a job whose weights
    #: depend on its world (HSDP: its ranks' gradients are reduced in another order in
    #: another world), so that its final weights can be compared bit for bit: every
    #: remedy keeps its layout (a hot-swap, else a restart once its nodes are back).
    scaling: bool = True

    @property
    def title(self) -> str:
        if self.parallelism == "ddp":
            return self.workload
        return f"{self.workload} {self.parallelism.upper()} {self.replicas // 2}x2"

    @property
    def finish_within_s(self) -> float:
        return max(self.finish_timeout_s, 3 * self.minutes * 60)

    @property
    def total_steps(self) -> int:
        return max(50, int(self.minutes * 60 / self.step_time_s))


@dataclass
class ChaosResult:
    injected: int = 0
    refused: int = 0
    remediated: int = 0
    not_remediated: list[str] = field(default_factory=list)  # "kind on node: why"
    #: Emergency checkpoints that did not commit: "kind on node: error".
    checkpoints_not_committed: list[str] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)
    #: Faults whose own remedy failed, healed by a later one: "kind on node: by type #id".
    healed_later: list[str] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)  # "type status" -> count
    stuck_actions: int = 0
    orphans: int = 0
    weights_match: bool | None = None  # None: the job did not finish
    final_step: int | None = None
    error: str | None = None
    #: The job stalled: for how long, at which step, and what the supervisor said.
    stalled: str | None = None
    #: The network faults drawn (with network_faults), and what the supervisor refused or
    #: dropped of an older world's reports ("report outcome" -> count).
    network: list[NetworkFault] = field(default_factory=list)
    network_error: str | None = None
    stale_reports: dict[str, float] = field(default_factory=dict)
    #: Where the logs and records of a run that went wrong were kept, for a post-mortem.
    kept: str | None = None


def reference_weights(run: Path, config: ChaosConfig) -> Output:
    """The uninterrupted run's output: the job's workers, offline (no host monitor, no
    supervisor), no step time."""
    world = config.replicas * config.nodes_per_dp
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith((HOST_MONITOR_ENV_PREFIX, "SUPERVISOR_", "CHECKPOINT_"))
        }
        env.update(
            RANK=str(rank),
            NUM_DP_REPLICAS=str(config.replicas),
            NUM_NODES_PER_DP=str(config.nodes_per_dp),
            WORLD_SIZE=str(world),
            SEED=str(SEED),
            TOTAL_STEPS=str(config.total_steps),
            STEP_TIME_S="0",
            RUN_DIR=str(run / "job"),
            LOCAL_CKPT_DIR=str(run / f"local-{rank}"),
            DURABLE_CKPT_DIR=str(run / Tier.DURABLE),
            OUTPUT_DIR=str(run / "output"),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        if config.workload == "torch":
            env.update(
                CHECKPOINT_RAM_DIR=str(run / f"ram-{rank}"),
                S3_CHECKPOINTING_FREQ="0",
                OMP_NUM_THREADS="1",
                PARALLELISM=config.parallelism,
                **TORCH_ENV,
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", f"training.{config.workload}_workload"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    for proc in procs:
        if proc.wait(600) != 0:
            raise RuntimeError(f"the reference run's rank exited {proc.returncode}")
    output = _output(run / "output", config)
    if output is None:
        raise RuntimeError("the reference run wrote no output")
    return output


def _output(directory: Path, config: ChaosConfig) -> Output | None:
    """What the job wrote at its end (None before)."""
    if config.workload == "torch":
        path = directory / "weights.sha256"
        return path.read_text() if path.exists() else None
    paths = [directory / f"shard-{k}.npy" for k in range(config.nodes_per_dp)]
    if not all(p.exists() for p in paths):
        return None
    return [np.load(p) for p in paths]


def _api(demo: LocalDemo, path: str, **params: Any) -> Any:
    try:
        return demo.api(path, **params)
    except (httpx.HTTPError, ValueError):
        return None  # the supervisor may be busy: ask again later


def run(config: ChaosConfig) -> ChaosResult:
    result = ChaosResult()
    with tempfile.TemporaryDirectory(prefix="bench-chaos-", dir=_tmp_root()) as tmp:
        root = Path(tmp)
        expected = reference_weights(root / "reference", config)
        options = DemoOptions(
            run_dir=root / "run",
            port=free_port(),
            replicas=config.replicas,
            nodes_per_dp=config.nodes_per_dp,
            spares=config.spares,
            seed=SEED,
            total_steps=config.total_steps,
            step_time_s=config.step_time_s,
            heartbeat_polling_period_s=config.heartbeat_polling_period_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            node_repair_s=config.node_repair_s,
            workload=config.workload,
            parallelism=config.parallelism,
            workload_env=(
                dict(TORCH_ENV, OMP_NUM_THREADS="1") if config.workload == "torch" else {}
            ),
            # A fault every few seconds is far more than the restart budget is meant for
            # (30 disruptive actions an hour, or 3 remedies in a row not followed by
            # progress, then the job is given up as broken: a 10-minute run was, the next
            # fault landing before the job stepped again), and than the flap rule is (3
            # losses of a node in 5 minutes: each node loses its heartbeats that often
            # here, and a 10-minute run stalled with all four out of the pool as
            # flapping). The run measures healing, so these are out of its way.
            supervisor_env={
                "SUPERVISOR_MAX_RESTARTS_IN_WINDOW": "100000",
                "SUPERVISOR_MAX_NO_PROGRESS_RESTARTS": "100000",
                "SUPERVISOR_FLAP_MAX_LOSSES": "100000",
                "SUPERVISOR_ENABLE_WORKLOAD_SCALING": str(config.scaling).lower(),
                # Four ranks and six host monitors on two cores: room for the in-process
                # join of a sharded job (as the HSDP MTTR rows give it).
                **(
                    {"SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "60"}
                    if config.parallelism != "ddp"
                    else {}
                ),
            },
        )
        network = None
        if config.network_faults:
            network = NetworkChaos(options.nodes, config.network_mean_interval_s, SEED)
            options.hosts = network.hosts()
            # gloo would advertise the address its host name resolves to (loopback).
            options.workload_env["GLOO_SOCKET_IFNAME"] = "eth0"
        demo = LocalDemo(options)
        try:
            demo.start()
            _chaos(demo, config, result, network)
        except Stalled as exc:
            result.stalled = str(exc)
        except (RuntimeError, httpx.HTTPError, TimeoutError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if network is not None:
                _account_network(demo, network, result)
            demo.stop()
            time.sleep(1.0)
            result.orphans = len(leftover_processes(demo.run_dir))
            if network is not None:
                network.close()
        got = _output(demo.run_dir / "output", config)
        if got is not None:
            result.weights_match = _same(got, expected)
        if result.weights_match is not True or result.error or result.stalled:
            result.kept = _keep(demo.run_dir)
    return result


def _account_network(demo: LocalDemo, network: NetworkChaos, result: ChaosResult) -> None:
    network.stop()
    result.network = network.faults
    result.network_error = network.error
    try:
        network.account(demo)
        result.stale_reports = network.stale_reports(demo)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result.network_error = f"the account: {type(exc).__name__}: {exc}"


def _keep(run_dir: Path) -> str:
    """The run's logs and the supervisor's database, copied out of the run's temporary
    directory (sockets and the tiers' checkpoints left behind)."""
    kept = Path(tempfile.mkdtemp(prefix="bench-chaos-kept-"))
    for log in run_dir.rglob("*.log"):  # the supervisor's, each host monitor's and worker's
        (kept / log.relative_to(run_dir)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, kept / log.relative_to(run_dir))
    for db in run_dir.glob("supervisor.db*"):
        shutil.copy2(db, kept / db.name)
    return str(kept)


def _same(got: Output, expected: Output) -> bool:
    if isinstance(got, str) or isinstance(expected, str):
        return got == expected  # the torch job's weights, hashed
    return all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def _tmp_root() -> str | None:
    # The RAM tiers and the collective's files are many small writes: tmpfs when there.
    return (
        "/dev/shm"
        if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 1 << 30
        else None
    )


def _chaos(
    demo: LocalDemo, config: ChaosConfig, result: ChaosResult, network: NetworkChaos | None
) -> None:
    job = demo.options.job
    _until(lambda: (_step(demo) or 0) >= 10, 120, "the job to train")
    response = httpx.post(
        f"{demo.url}/api/v1/faults",
        json={"schedule": f"random,{config.mean_interval_s:g}", "job": job},
        headers={"Authorization": f"Bearer {demo.operator_token}"},
        timeout=10,
    )
    response.raise_for_status()
    schedule = response.json()["id"]
    watch = StallWatch(
        lambda path, **params: _api(demo, path, **params),
        job,
        hang_timeouts=config.stall_hang_timeouts,
    )
    window_ends = time.monotonic() + config.minutes * 60
    if network is not None:
        network.start(demo)
    try:
        while time.monotonic() < window_ends:
            demo.repair_nodes()
            if network is not None:
                network.repair_cordoned(demo, config.node_repair_s)
            watch.check()
            time.sleep(0.5)
    except Stalled:
        result.final_step = _step(demo)
        _account(demo, schedule, result)
        raise
    finally:
        if network is not None:
            network.stop()  # no more cuts; the last one heals
    httpx.delete(
        f"{demo.url}/api/v1/faults/{schedule}",
        headers={"Authorization": f"Bearer {demo.operator_token}"},
        timeout=10,
    ).raise_for_status()

    def finished() -> bool:
        demo.repair_nodes()
        if network is not None:
            network.repair_cordoned(demo, config.node_repair_s)
        watch.check()
        return _output(demo.run_dir / "output", config) is not None

    try:
        _until(finished, config.finish_within_s, "the job to finish")
        # The last actions settle (a scale-up after a repair, say) before the account.
        _until(lambda: _open_actions(demo) == 0, 60, "the last actions", fail=False)
    finally:  # what happened to the faults is told even when the job did not finish
        result.final_step = _step(demo)
        _account(demo, schedule, result)


def _step(demo: LocalDemo) -> int | None:
    job = _api(demo, f"/api/v1/jobs/{demo.options.job}")
    return job.get("last_step") if isinstance(job, dict) else None


def _open_actions(demo: LocalDemo) -> int:
    items = _actions(demo)
    return sum(1 for a in items if a["status"] not in ("succeeded", "failed"))


def _actions(demo: LocalDemo) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = _api(demo, "/api/v1/actions", limit=500, **({"cursor": cursor} if cursor else {}))
        if not isinstance(page, dict):
            return items
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def _account(demo: LocalDemo, schedule: int, result: ChaosResult) -> None:
    faults = [
        f for f in (_api(demo, "/api/v1/faults") or []) if f["params"].get("schedule") == schedule
    ]
    actions = {a["id"]: a for a in _actions(demo)}
    for a in actions.values():
        key = f"{a['type']} {a['status']}"
        result.actions[key] = result.actions.get(key, 0) + 1
    result.stuck_actions = sum(
        1 for a in actions.values() if a["status"] not in ("succeeded", "failed")
    )
    for fault in faults:
        fault = _api(demo, f"/api/v1/faults/{fault['id']}") or fault
        what = f"{fault['kind']} on {fault['node']}"
        if not fault["events"]:
            if _refused(fault):
                result.refused += 1
                continue
            result.injected += 1
            result.by_kind[fault["kind"]] = result.by_kind.get(fault["kind"], 0) + 1
            result.not_remediated.append(f"{what}: no event (undetected)")
            continue
        result.injected += 1
        result.by_kind[fault["kind"]] = result.by_kind.get(fault["kind"], 0) + 1
        mine = [actions[i] for i in sorted(fault["actions"]) if i in actions]
        verdict = judge(mine, list(actions.values()))
        result.checkpoints_not_committed += [
            f"{what}: {error}" for error in verdict.checkpoints_not_committed
        ]
        if not verdict.healed:
            result.not_remediated.append(f"{what}: {verdict.why_not}")
            continue
        result.remediated += 1
        if verdict.healed_by is not None:
            result.healed_later.append(f"{what}: by {verdict.healed_by}")


def _refused(fault: dict[str, Any]) -> bool:
    """Ended within a second of its creation with nothing caused: the node refused it."""
    if fault["ended_at"] is None:
        return False
    created = datetime.fromisoformat(fault["created_at"])
    ended = datetime.fromisoformat(fault["ended_at"])
    return (ended - created).total_seconds() < 1.0


def _until(predicate: Any, within_s: float, what: str, *, fail: bool = True) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    if fail:
        raise TimeoutError(f"waited {within_s:g} s for {what}")
