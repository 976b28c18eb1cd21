"""The whole loop on one machine, with real processes: host monitors as nodes, the demo
training job on them, the supervisor with the local backend, faults acted out with
real signals. Checks what a user of `make demo` would look for: the fault is detected,
the healthy replica saves an emergency checkpoint, the work moves, training resumes
losing at most one step, and the final weights are exactly those of a run without the
fault. Each test runs on both workloads: the NumPy one and the PyTorch one (DDP on gloo,
where a survivor sits inside a collective when its peer dies or freezes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from supervisor.local.demo import LocalDemo, leftover_processes
from supervisor.local.demo_options import DemoOptions
from supervisor.local.ports import free_port
from tests.forked_ranks import RankProcess, log_path, start_rank
from tests.forked_services import start_local_process
from tests.http import http
from tests.timing import scaled

SEED = 3
STEPS = 150  # of the job, unless a test says otherwise
RESUMED = re.compile(r"resumed step=(\d+) tier=(\w+)")


# The torch workload, small enough for four ranks on two cores: one layer (FSDP still
# shards it and the root apart), since each layer's tensors add to every step's hooks and
# every save's records (the sharded clusters' ranks took 14% less CPU than with two).
TORCH_ENV = {"D_MODEL": "64", "N_LAYERS": "1", "N_HEADS": "4", "SEQ_LEN": "32"}


@pytest.fixture(params=["numpy", "torch"])
def workload(request: pytest.FixtureRequest) -> str:
    if request.param == "torch":
        pytest.importorskip("torch")
    name: str = request.param
    return name


_references: dict[tuple[int, int, int, str], Any] = {}


def reference_weights(
    tmp: Path, replicas: int, nodes_per_dp: int, steps: int, workload: str = "numpy"
) -> Any:
    """Final weights of an uninterrupted run (offline workers, no monitor): the shards
    (numpy), or the weights' hash (torch). Deterministic: run once per job shape for
    every test of the session."""
    key = (replicas, nodes_per_dp, steps, workload)
    if key not in _references:
        _references[key] = run_reference(tmp, replicas, nodes_per_dp, steps, workload)
    return _references[key]


def run_reference(tmp: Path, replicas: int, nodes_per_dp: int, steps: int, workload: str) -> Any:
    run = tmp / "reference"
    world = replicas * nodes_per_dp
    port = free_port()
    procs: list[RankProcess | subprocess.Popen[bytes]] = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HOST_MONITOR_", "SUPERVISOR_", "CHECKPOINT_"))
        }
        env.update(
            RANK=str(rank),
            NUM_DP_REPLICAS=str(replicas),
            NUM_NODES_PER_DP=str(nodes_per_dp),
            WORLD_SIZE=str(world),
            SEED=str(SEED),
            TOTAL_STEPS=str(steps),
            STEP_TIME_S="0",
            RUN_DIR=str(run / "job"),
            LOCAL_CKPT_DIR=str(run / f"local-{rank}"),
            DURABLE_CKPT_DIR=str(run / "durable"),
            OUTPUT_DIR=str(run / "output"),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            CHECKPOINT_RAM_DIR=str(run / f"ram-{rank}"),
            S3_CHECKPOINTING_FREQ="0",
            OMP_NUM_THREADS="1",
            **TORCH_ENV,
        )
        module = f"training.{workload}_workload"
        if workload == "torch":  # forked with torch imported (tests/forked_ranks.py)
            procs.append(start_rank(module, env, log_path(run / "logs", rank)))
        else:
            procs.append(
                subprocess.Popen([sys.executable, "-m", module], env=env, stdout=subprocess.DEVNULL)
            )
    for proc in procs:
        assert proc.wait(240) == 0
    return final_weights(run / "output", workload, nodes_per_dp)


def final_weights(directory: Path, workload: str, nodes_per_dp: int) -> Any:
    """What the job wrote at its end (None before): numpy's shards, torch's hash."""
    if workload == "torch":
        path = directory / "weights.sha256"
        return path.read_text() if path.exists() else None
    paths = [directory / f"shard-{k}.npy" for k in range(nodes_per_dp)]
    if not all(p.exists() for p in paths):
        return None
    return [np.load(p) for p in paths]


def assert_same_weights(got: Any, want: Any) -> None:
    if isinstance(want, str):
        assert got == want  # bit-identical torch weights
        return
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)


@pytest.fixture
def start_demo(tmp_path: Path, workload: str) -> Iterator[Callable[..., LocalDemo]]:
    yield from demos(tmp_path, workload)


def demos(tmp_path: Path, workload: str) -> Iterator[Callable[..., LocalDemo]]:
    """A fixture's body: a function that starts a local cluster (2 replicas of one node, a
    spare, 150 steps), and stops every cluster it started at the end."""
    demos: list[LocalDemo] = []

    def start(**overrides: Any) -> LocalDemo:
        options = DemoOptions(
            run_dir=tmp_path / "run",
            port=free_port(),
            replicas=2,
            nodes_per_dp=1,
            spares=1,
            seed=SEED,
            total_steps=STEPS,
            # The NumPy job's steps cost next to no CPU: slower ones keep it training
            # until its fault even when a loaded machine takes 15 s to start the
            # supervisor (which starts after the job: local/demo.py).
            step_time_s=0.04 if workload == "torch" else 0.12,
            heartbeat_polling_period_s=0.2,
            heartbeat_timeout_s=1.0,
            node_repair_s=3600,
            workload=workload,
            workload_env=dict(TORCH_ENV, OMP_NUM_THREADS="1") if workload == "torch" else {},
        )
        # The torch job's in-process heal waits for a fresh rank's torch import, tens of
        # seconds on a loaded 2-core machine: the tests check the path, not its speed.
        patient = {"SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "60"}
        options.supervisor_env = {**patient, **overrides.pop("supervisor_env", {})}
        for key, value in overrides.items():
            setattr(options, key, value)
        demo = LocalDemo(options, start_local_process)
        demos.append(demo)
        demo.start()
        return demo

    yield start
    for demo in demos:
        demo.stop()
        # A forked service's environment is not the one /proc shows (its standby's): the
        # run's marker finds what its processes started, their exits the services.
        assert leftover_processes(demo.run_dir) == [], "processes left behind"
        services = [demo.supervisor, *demo.monitors.values()]
        assert all(p is None or p.poll() is not None for p in services), "services left"


#: Each poll is an HTTP request the service answers from its store: four a second is fine
#: enough for every wait here; ten took CPU the jobs need on a 2-core machine.
POLL_S = 0.25


def wait_for(predicate: Callable[[], Any], within: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + scaled(within)
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def job_step(demo: LocalDemo) -> int:
    step = demo.api(f"/api/v1/jobs/{demo.options.job}")["last_step"]
    return -1 if step is None else int(step)


def finished_actions(demo: LocalDemo, count: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = demo.api("/api/v1/actions")["items"][::-1]
    done = [a for a in items if a["status"] in ("succeeded", "failed")]
    return items if len(done) >= count and len(done) == len(items) else []


def resumed_steps(demo: LocalDemo) -> list[tuple[int, str]]:
    found = []
    # The workers' logs only: a walk of the whole run folder meets the peer stores'
    # directories, which come and go while host monitors still copy checkpoints.
    for log in (demo.run_dir / "nodes").glob("*/*.log"):
        found += [(int(m[1]), m[2]) for m in RESUMED.finditer(log.read_text(errors="replace"))]
    return found


def output(demo: LocalDemo) -> Any:
    o = demo.options
    return final_weights(demo.run_dir / "output", o.workload, o.nodes_per_dp)


def assert_healed_in_process(action: dict[str, Any], workload: str) -> None:
    """The torch workload heals in-process: the survivors kept their processes."""
    if workload == "torch":
        assert action["result"]["path"] == "in_process", action["result"]
        assert action["result"]["rejoined"] and action["result"]["started"]
    else:
        assert "path" not in action["result"]  # the NumPy workload restarts every rank


def node_known(demo: LocalDemo, node: str) -> bool:
    response = http.get(
        f"{demo.url}/api/v1/nodes/{node}",
        headers={"Authorization": f"Bearer {demo.operator_token}"},
        timeout=5,
    )
    return response.status_code == 200


def inject(demo: LocalDemo, **body: Any) -> dict[str, Any]:
    if body.get("node") is not None:
        # The job can be 10 steps in before a slow host monitor's first heartbeat (it
        # backs off while the supervisor starts): a fault needs its node known.
        wait_for(lambda: node_known(demo, body["node"]), what=f"{body['node']} known")
    response = http.post(
        f"{demo.url}/api/v1/faults",
        json=body,
        headers={"Authorization": f"Bearer {demo.operator_token}"},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    result: dict[str, Any] = response.json()
    return result


def test_node_down_is_healed_by_hot_swap_with_one_step_lost_at_most(
    start_demo: Callable[..., LocalDemo], tmp_path: Path, workload: str
) -> None:
    # The reference first: run beside the job, it could let the job finish before the
    # fault on a loaded machine.
    expected = reference_weights(tmp_path, 2, 1, STEPS, workload)
    demo = start_demo()
    # Up once the supervisor knows every node: the spare too, before any fault.
    assert {n["name"] for n in demo.api("/api/v1/nodes")} == set(demo.options.nodes)
    wait_for(lambda: job_step(demo) >= 20, what="training to reach step 20")
    victim = demo.options.nodes[0]
    step_before = job_step(demo)
    fault = inject(demo, kind="node_down", node=victim)

    actions = wait_for(lambda: finished_actions(demo, 2), what="the remediation")
    lost = demo.api("/api/v1/events", type="host_heartbeat_lost")["items"]
    assert [(e["node"], e["fault_id"]) for e in lost] == [(victim, fault["id"])]
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        ("hot_swap", "succeeded"),
    ], actions
    saved = actions[0]["result"]["step"]
    assert actions[1]["result"]["replaced"] == victim
    assert actions[1]["result"]["by"] == demo.options.nodes[2]
    assert_healed_in_process(actions[1], workload)
    # The dead node left the job, the spare joined it: as the API and `get` list them.
    spare = demo.options.nodes[2]
    wait_for(
        lambda: spare in demo.api(f"/api/v1/jobs/{demo.options.job}")["nodes"],
        what=f"{spare} in the job's nodes (its first heartbeat with the job)",
    )
    assert victim not in demo.api(f"/api/v1/jobs/{demo.options.job}")["nodes"]
    (node,) = [n for n in demo.api("/api/v1/nodes") if n["name"] == victim]
    assert node["job"] is None and node["cordoned"], node

    weights = wait_for(lambda: output(demo), within=120, what="the job to finish")
    # Resumed at the emergency checkpoint's step: the step the healthy replica was at.
    # (Where that step also has a periodic checkpoint, ranks may load that same copy.)
    resumes = resumed_steps(demo)
    assert resumes and {step for step, _ in resumes} == {saved}, (
        resumes,
        demo.api("/api/v1/actions")["items"],
        demo.api("/api/v1/events", limit=1000)["items"],
    )
    if workload == "torch":  # the survivor trained on from the state it held
        assert "memory" in {tier for _, tier in resumes}, resumes
    # Nothing was lost beyond the step in flight: the survivors were blocked in that
    # step's all-reduce, so they saved the last step completed, not an older periodic one.
    assert saved >= step_before
    assert_same_weights(weights, expected)


CRASH = ({"kind": "worker_crash"}, "worker_exited", "restart_in_place")
HANG = ({"kind": "worker_hang"}, "worker_heartbeat_lost", "restart_in_place")
XID = ({"kind": "xid", "code": 79}, "gpu_xid", "hot_swap")


# The torch job under DDP with the crash; its hang and XID heal the same way as the
# FSDP2 job's in tests/test_sharded_local_cluster.py, which runs them.
@pytest.mark.parametrize(
    ("workload", "fault", "event", "remedy"),
    [
        pytest.param("numpy", *CRASH, id="numpy-crash"),
        pytest.param("numpy", *HANG, id="numpy-hang"),
        pytest.param("numpy", *XID, id="numpy-xid"),
        pytest.param("torch", *CRASH, id="torch-crash"),
    ],
    indirect=["workload"],
)
def test_worker_and_gpu_faults_are_healed_exactly(
    start_demo: Callable[..., LocalDemo],
    tmp_path: Path,
    fault: dict[str, Any],
    event: str,
    remedy: str,
    workload: str,
) -> None:
    # The reference first: run beside the job, it could let the job finish before the
    # fault on a loaded machine.
    expected = reference_weights(tmp_path, 2, 1, STEPS, workload)
    demo = start_demo()
    wait_for(lambda: job_step(demo) >= 20, what="training to reach step 20")
    if remedy == "hot_swap":
        # The swap needs the spare heartbeating: on a loaded machine its host monitor can
        # be slower to start than the job's first 20 steps (then the remedy scales down).
        spare = demo.options.nodes[-1]
        wait_for(lambda: node_known(demo, spare), within=60, what=f"spare {spare} known")
    victim = demo.options.nodes[0]
    step_before = job_step(demo)
    injected = inject(demo, node=victim, **fault)

    actions = wait_for(lambda: finished_actions(demo, 2), what="the remediation")
    events = demo.api("/api/v1/events", type=event)["items"]
    assert [(e["node"], e["fault_id"]) for e in events] == [(victim, injected["id"])]
    if fault["kind"] == "worker_crash":
        assert events[0]["details"]["exit_code"] in (-9, 137)
    if fault["kind"] == "xid":
        assert events[0]["details"]["code"] == 79  # read back from the kernel log line
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        (remedy, "succeeded"),
    ], actions
    assert all(a["fault_id"] == injected["id"] for a in actions)
    saved = actions[0]["result"]["step"]
    assert saved >= step_before
    assert_healed_in_process(actions[1], workload)

    weights = wait_for(lambda: output(demo), within=120, what="the job to finish")
    resumes = resumed_steps(demo)
    [resumed] = {step for step, _ in resumes} or {None}
    if fault["kind"] == "xid":
        # No rank is dead or stuck, so the job trains on between the emergency checkpoint
        # and the hot-swap's stop; it may reach a newer periodic checkpoint on every rank
        # (seen on a loaded machine), and then resumes from that one.
        assert resumed is not None and resumed >= saved, resumes
    elif fault["kind"] == "worker_hang":
        # A hung rank blocks the others in the step's all-reduce, so the emergency
        # checkpoint is the step they completed; but the stop continues the stopped rank
        # (SIGTERM, then SIGCONT), and one stopped after it sent its part of the step may
        # complete that step with the others, and save it, before it stops (seen once in
        # CI: saved 29, every rank resumed from its RAM save of 30).
        assert resumed in (saved, saved + 1), (resumes, actions)
    else:
        # A dead rank blocks the others in the step's all-reduce: the emergency
        # checkpoint is the newest step any rank holds.
        assert resumed == saved, (resumes, actions, demo.api("/api/v1/events")["items"][:12])
    assert_same_weights(weights, expected)


#: Long enough to scale down and back up before the end (back up by step 75 here).
SCALE_STEPS = 300


def test_no_spare_scales_down_then_back_up_when_the_node_returns(
    start_demo: Callable[..., LocalDemo], tmp_path: Path, workload: str
) -> None:
    """With the torch job, the one replica left trains on both replicas' batches
    (training/torch_workload/elastic.py): the weights are those of a run that never
    lost a node."""
    expected = (
        reference_weights(tmp_path, 2, 1, SCALE_STEPS, workload) if workload == "torch" else None
    )
    # The NumPy job's steps take their 0.04 s whatever the load, its 300 twelve seconds:
    # under both sessions' load the scale-down, the repair and the scale-up took longer
    # once. Its weights are not compared: it trains on, as long as the test needs.
    steps = SCALE_STEPS if workload == "torch" else 100_000
    demo = start_demo(spares=0, node_repair_s=2.0, total_steps=steps)
    wait_for(lambda: job_step(demo) >= 10, what="training to reach step 10")
    victim = demo.options.nodes[0]
    inject(demo, kind="node_down", node=victim)

    down = wait_for(lambda: finished_actions(demo, 2), what="the scale-down")
    assert [(a["type"], a["status"]) for a in down] == [
        ("emergency_checkpoint", "succeeded"),
        ("scale_down", "succeeded"),
    ], down
    assert down[1]["params"] == {"to_replicas": 1, "exclude_node": victim}
    job = demo.api("/api/v1/jobs/demo")
    assert job["num_dp_replicas"] == 1
    resumed_at = job_step(demo)
    wait_for(lambda: job_step(demo) > resumed_at + 3, what="training on one replica")

    # The node is repaired: back as a spare, and the job grows back to two replicas.
    wait_for(lambda: demo.repair_nodes() == [victim], within=30, what="the repair")
    up = wait_for(
        lambda: [a for a in finished_actions(demo, 5) if a["type"] == "scale_up"],
        within=60,
        what="the scale-up",
    )
    assert [(a["status"], a["params"]) for a in up] == [("succeeded", {"to_replicas": 2})]
    recovered = demo.api("/api/v1/events", type="node_recovered")["items"]
    assert [e["node"] for e in recovered] == [victim]
    assert demo.api("/api/v1/jobs/demo")["num_dp_replicas"] == 2
    step = job_step(demo)
    assert step < steps, "the job finished before it grew back"
    wait_for(lambda: job_step(demo) > step + 3, what="training on two replicas again")
    if workload == "torch":
        weights = wait_for(lambda: output(demo), within=180, what="the job to finish")
        assert_same_weights(weights, expected)


@pytest.mark.parametrize("workload", ["numpy"], indirect=True)
def test_a_job_whose_last_resort_restart_failed_starts_again_once_its_node_is_back(
    start_demo: Callable[..., LocalDemo], workload: str
) -> None:
    """One replica, no spare: its node goes down, and the last resort, a restart on that
    node, fails. Once the node is repaired and back as a spare, the job is started again
    on it; nothing else would ever start it."""
    demo = start_demo(replicas=1, spares=0, total_steps=100_000)
    wait_for(lambda: job_step(demo) >= 10, what="training to reach step 10")
    victim = demo.options.nodes[0]
    inject(demo, kind="node_down", node=victim)
    failed = wait_for(lambda: finished_actions(demo, 2), within=120, what="the last resort")
    assert [(a["type"], a["status"]) for a in failed][-1] == ("restart_workload", "failed")
    step = job_step(demo)
    demo.options.node_repair_s = 0.0
    wait_for(lambda: demo.repair_nodes() == [victim], within=30, what="the repair")
    restarted = wait_for(
        lambda: [
            a
            for a in finished_actions(demo, len(failed) + 1)[len(failed) :]
            if a["type"] == "restart_workload"
        ],
        within=60,
        what="the restart once the node is back",
    )
    assert [a["status"] for a in restarted] == ["succeeded"], restarted
    assert "since its last remedy failed" in restarted[0]["reason"]
    wait_for(lambda: job_step(demo) > step + 3, what="training again")


# The FSDP2 job's: tests/test_sharded_local_cluster.py.
@pytest.mark.parametrize("workload", ["numpy"], indirect=True)
def test_supervisor_killed_mid_remediation_takes_over_and_repeats_nothing(
    start_demo: Callable[..., LocalDemo], tmp_path: Path, workload: str
) -> None:
    # The reference first: run beside the job, it could let the job finish before the
    # fault on a loaded machine.
    expected = reference_weights(tmp_path, 2, 1, STEPS, workload)
    demo = start_demo()
    wait_for(lambda: job_step(demo) >= 20, what="training to reach step 20")
    injected = inject(demo, kind="worker_crash", node=demo.options.nodes[1])
    # Kill the supervisor as soon as the policy's decision is recorded.
    wait_for(lambda: demo.api("/api/v1/actions")["items"], what="a recorded action")
    demo.kill_supervisor()
    demo.start_supervisor()
    demo.wait_ready(f"{demo.url}/readyz")

    actions = wait_for(lambda: finished_actions(demo, 2), what="the remediation")
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        ("restart_in_place", "succeeded"),
    ], actions
    exited = demo.api("/api/v1/events", type="worker_exited")["items"]
    assert [(e["node"], e["fault_id"]) for e in exited] == [(demo.options.nodes[1], injected["id"])]
    weights = wait_for(lambda: output(demo), within=120, what="the job to finish")
    assert_same_weights(weights, expected)
    # One decision, carried out once: the job was restarted a single time.
    state = json.loads((demo.run_dir / "cluster.json").read_text())
    assert state["job"]["attempt"] == 2  # the boot, then the one restart


def test_a_fault_schedule_injects_on_the_local_cluster(tmp_path: Path) -> None:
    """`{"schedule": "worker_crash,1"}` on the local backend: its faults reach the host
    monitors (which refused them before, for the `schedule` link in their params) and
    each one's consequence is linked to it."""
    starting = demos(tmp_path, "numpy")
    start = next(starting)
    try:
        demo = start(total_steps=100_000)
        wait_for(lambda: job_step(demo) >= 10, what="training to reach step 10")
        schedule = inject(demo, schedule="worker_crash,1", job=demo.options.job)

        def linked_exit() -> list[tuple[dict[str, Any], dict[str, Any]]]:
            children = {
                f["id"]: f
                for f in demo.api("/api/v1/faults")
                if f["params"].get("schedule") == schedule["id"]
            }
            exits = demo.api("/api/v1/events", type="worker_exited")["items"]
            return [(children[e["fault_id"]], e) for e in exits if e["fault_id"] in children]

        [(child, event), *_] = wait_for(linked_exit, what="a scheduled crash and its exit")
        assert child["kind"] == "worker_crash" and event["node"] == child["node"]
        # A crash happens once: the fault is over (once acted out), its consequence
        # linked all the same.
        over = wait_for(
            lambda: next(f for f in demo.api("/api/v1/faults") if f["id"] == child["id"])[
                "ended_at"
            ],
            what="the crash's fault to end",
        )
        assert over is not None
        response = http.delete(
            f"{demo.url}/api/v1/faults/{schedule['id']}",
            headers={"Authorization": f"Bearer {demo.operator_token}"},
            timeout=10,
        )
        assert response.status_code == 200 and response.json()["active"] is False
    finally:
        next(starting, None)


def test_a_straggler_is_detected_and_its_node_swapped_for_the_spare(tmp_path: Path) -> None:
    """A worker slowed without its cooperation (SIGSTOP, SIGCONT ten times a second) among
    three ranks: its compute time per step stands out, `straggler` is raised after the
    window, and the default policy moves the job off its node to the spare.

    The NumPy workload only: three torch ranks on this machine's two cores differ in
    forward time by up to 2x from CPU contention alone (rank 0 most), which the scorer
    rightly calls a straggler; on GPUs each rank computes on its own device."""
    starting = demos(tmp_path, "numpy")
    try:
        demo = next(starting)(
            replicas=3,
            total_steps=100_000,
            heartbeat_timeout_s=2.0,
            supervisor_env={"SUPERVISOR_STRAGGLER_WINDOW_S": "2"},
        )
        wait_for(lambda: job_step(demo) >= 20, what="training to reach step 20")
        victim = demo.options.nodes[1]
        fault = inject(demo, node=victim, kind="straggler", slowdown=1.0)

        def straggler() -> list[dict[str, Any]]:
            items: list[dict[str, Any]] = demo.api("/api/v1/events", type="straggler")["items"]
            return items

        [event] = wait_for(straggler, within=60, what="the straggler event")
        assert event["node"] == victim and event["job"] == demo.options.job
        assert event["details"]["score"] >= 1.2, event
        assert event["fault_id"] == fault["id"]
        actions = wait_for(lambda: finished_actions(demo, 2), within=60, what="the swap")
        assert [(a["type"], a["status"]) for a in actions] == [
            ("emergency_checkpoint", "succeeded"),
            ("hot_swap", "succeeded"),
        ], actions
        assert actions[1]["node"] == victim and actions[1]["event_id"] == event["id"]
        resumed = job_step(demo)
        wait_for(lambda: job_step(demo) >= resumed + 20, what="training to go on")
    finally:
        next(starting, None)  # stops the cluster
