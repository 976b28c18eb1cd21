"""Sharded PyTorch jobs (FSDP2, HSDP) healed on the local cluster, with real processes.

The torch workload with `PARALLELISM=fsdp` or `hsdp` on host monitors as nodes, the
supervisor with the local backend, faults acted out with real signals. Checked as for the
DDP job (tests/test_local_cluster.py): the fault is detected, the survivors save an
emergency checkpoint of their shards from inside the collective they are stuck in, the
job heals in-process (survivors keep their processes, rebuild the sharded model on the
new world's mesh and load their shards; the replacement loads its own from the tiers),
and the final weights are bit-identical to a run without the fault.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.local.demo import LocalDemo
from supervisor.local.ports import free_port
from tests.forked_ranks import log_path, start_rank
from tests.test_local_cluster import (
    SEED,
    TORCH_ENV,
    assert_healed_in_process,
    demos,
    finished_actions,
    inject,
    job_step,
    output,
    resumed_steps,
    wait_for,
)

pytest.importorskip("torch")

STEPS = 120


@pytest.fixture
def start_demo(tmp_path: Path) -> Iterator[Callable[..., LocalDemo]]:
    # No warm standbys: the sharded paths are checked, not how fast a new rank starts (the
    # standbys' path is test_local_cluster's); each idle one's torch import took the cores.
    for start in demos(tmp_path, "torch"):
        yield functools.partial(start, warm_standby=False)


_references: dict[tuple[int, str, int], str] = {}


def reference(tmp: Path, world: int, parallelism: str, steps: int = STEPS) -> str:
    """The final weights' hash of the same job run without faults (offline ranks); run
    once per layout and length for the session's tests."""
    key = (world, parallelism, steps)
    if key not in _references:
        _references[key] = run_reference(tmp, world, parallelism, steps)
    return _references[key]


def run_reference(tmp: Path, world: int, parallelism: str, steps: int) -> str:
    run = tmp / "reference"
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HOST_MONITOR_", "SUPERVISOR_", "CHECKPOINT_"))
        }
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            SEED=str(SEED),
            TOTAL_STEPS=str(steps),
            OUTPUT_DIR=str(run / "output"),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            CHECKPOINT_RAM_DIR=str(run / f"ram-{rank}"),
            S3_CHECKPOINTING_FREQ="0",
            OMP_NUM_THREADS="1",
            PARALLELISM=parallelism,
            **TORCH_ENV,
        )
        procs.append(start_rank("training.torch_workload", env, log_path(run / "logs", rank)))
    for proc in procs:
        assert proc.wait(300) == 0
    return (run / "output" / "weights.sha256").read_text()


def decisions(demo: LocalDemo) -> list[str]:
    """What the supervisor decided for each event, from its log: in which order it heard
    of the fault's signals."""
    log = demo.run_dir / "logs" / "supervisor.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if "controller.controller: event" in line]


SAVED = re.compile(
    r"^(\S+ \S+) INFO\s+host_monitor\.node: rank (\d+) saved \w+ checkpoint of step (\d+) "
)
LOADED = re.compile(r"^(\S+ \S+) INFO\s+host_monitor\.node: rank \d+ loaded ")


def steps_saved_before_the_heal(demo: LocalDemo) -> dict[int, set[int]]:
    """The steps each rank's host monitor heard it had saved (any tier) before a rank
    first loaded a checkpoint: what the old world left, as its reports say. A save
    reported late only lowers what a test asks of the resume."""
    lines = [
        line
        for log in (demo.run_dir / "logs").glob("host-monitor-*.log")
        for line in log.read_text(errors="replace").splitlines()
    ]
    first_load = min((m[1] for line in lines if (m := LOADED.match(line))), default="~")
    held: dict[int, set[int]] = {}
    for line in lines:
        if (m := SAVED.match(line)) and m[1] < first_load:
            held.setdefault(int(m[2]), set()).add(int(m[3]))
    return held


def heal(
    start_demo: Callable[..., LocalDemo],
    tmp_path: Path,
    *,
    parallelism: str,
    replicas: int,
    fault: dict[str, Any],
    remedy: str,
) -> tuple[LocalDemo, list[dict[str, Any]]]:
    expected = reference(tmp_path, replicas, parallelism)
    demo = start_demo(
        replicas=replicas,
        total_steps=STEPS,
        parallelism=parallelism,
        # A rank left waiting in a collective of another group than the failed one fails
        # after this (see training/torch_workload/parallel.py).
        workload_env=dict(TORCH_ENV, OMP_NUM_THREADS="1", COLLECTIVE_TIMEOUT_S="8"),
        # Four ranks and five host monitors on two cores: room for the in-process join.
        supervisor_env={"SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "60"},
        in_memory_checkpointing_freq=5,
        s3_checkpointing_freq=10,
    )
    wait_for(lambda: job_step(demo) >= 15, within=120, what="training to reach step 15")
    victim = demo.options.nodes[0]
    injected = inject(demo, node=victim, **fault)
    actions = wait_for(lambda: finished_actions(demo, 2), within=120, what="the remediation")
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        (remedy, "succeeded"),
    ], "\n".join([f"actions: {actions}", "decisions:", *decisions(demo)])  # a str: not cut
    assert all(a["fault_id"] == injected["id"] for a in actions)
    assert_healed_in_process(actions[1], "torch")
    weights = wait_for(lambda: output(demo), within=300, what="the job to finish")
    assert weights == expected  # bit-identical to the run without the fault
    return demo, actions


def test_fsdp_worker_crash_is_healed_in_process_bit_exactly(
    start_demo: Callable[..., LocalDemo], tmp_path: Path
) -> None:
    demo, actions = heal(
        start_demo,
        tmp_path,
        parallelism="fsdp",
        replicas=2,
        fault={"kind": "worker_crash"},
        remedy="restart_in_place",
    )
    saved = actions[0]["result"]["step"]
    resumes = resumed_steps(demo)
    # Without replicas, the crashed rank's shard of the step the survivor saved exists
    # nowhere: the ranks agree on the newest step every shard has (a periodic save). That
    # is not always the last periodic step: a save is written in the background, and the
    # crash can land while the crashed rank's newest is still being written (seen beside
    # two CPU burners: rank 0 killed with step 20 in flight, the ranks resumed from 15).
    held = steps_saved_before_the_heal(demo)
    assert sorted(held) == [0, 1], held
    every_shard = max(held[0] & held[1])
    steps = {step for step, _ in resumes}
    assert len(steps) == 1 and every_shard <= steps.pop() <= saved, (saved, resumes, held)


@pytest.mark.parametrize(
    ("fault", "remedy"),
    [
        ({"kind": "worker_hang"}, "restart_in_place"),
        ({"kind": "xid", "code": 79}, "hot_swap"),
    ],
    ids=["hang", "xid"],
)
def test_fsdp_hang_and_xid_are_healed_in_process_bit_exactly(
    start_demo: Callable[..., LocalDemo], tmp_path: Path, fault: dict[str, Any], remedy: str
) -> None:
    heal(start_demo, tmp_path, parallelism="fsdp", replicas=2, fault=fault, remedy=remedy)


def test_hsdp_node_down_loses_no_step(start_demo: Callable[..., LocalDemo], tmp_path: Path) -> None:
    demo, actions = heal(
        start_demo,
        tmp_path,
        parallelism="hsdp",
        replicas=4,
        fault={"kind": "node_down"},
        remedy="hot_swap",
    )
    saved = actions[0]["result"]["steps"]
    resumes = resumed_steps(demo)
    steps = {step for step, _ in resumes}
    if len(saved) == 1:
        # Every shard of the step the survivors saved exists in the whole replica group:
        # the job resumes from it, the replacement reading its shard from the other
        # replica's.
        assert steps == set(saved), (saved, resumes)
    else:
        # The fault split a step: a survivor's all-reduce with the lost rank failed while
        # its shard peer's, with a live replica, went through (seen: 16 and 17). The shard
        # of the newer step exists only on the ranks ahead, the other one's only on the
        # rank behind: the job resumes from the newest step every shard has, the periodic
        # save at or before the older one (in_memory_checkpointing_freq = 5).
        oldest = min(saved)
        assert steps == {oldest - oldest % 5} or steps == {oldest}, (saved, resumes)


def test_fsdp_job_scales_down_and_back_up_resharding_its_state(
    start_demo: Callable[..., LocalDemo],
) -> None:
    """No spare: the FSDP job of 2 ranks shrinks to 1 (its state resharded onto one rank)
    and grows back to 2 once the node is repaired (resharded again), training on."""
    demo = start_demo(
        spares=0,
        node_repair_s=2.0,
        total_steps=100_000,
        parallelism="fsdp",
        in_memory_checkpointing_freq=5,
        s3_checkpointing_freq=5,
        workload_env=dict(TORCH_ENV, OMP_NUM_THREADS="1", COLLECTIVE_TIMEOUT_S="8"),
    )
    wait_for(lambda: job_step(demo) >= 12, within=120, what="training to reach step 12")
    victim = demo.options.nodes[0]
    inject(demo, kind="node_down", node=victim)
    down = wait_for(lambda: finished_actions(demo, 2), within=120, what="the scale-down")
    assert [(a["type"], a["status"]) for a in down] == [
        ("emergency_checkpoint", "succeeded"),
        ("scale_down", "succeeded"),
    ], down
    assert demo.api("/api/v1/jobs/demo")["num_dp_replicas"] == 1
    resumed_at = job_step(demo)
    wait_for(lambda: job_step(demo) > resumed_at + 3, within=120, what="training on one rank")
    one_rank = [r for r in resumed_steps(demo) if r[0] > 0]
    assert one_rank, "the single rank resumed from no checkpoint"

    wait_for(lambda: demo.repair_nodes() == [victim], within=30, what="the repair")
    up = wait_for(
        lambda: [a for a in finished_actions(demo, 5) if a["type"] == "scale_up"],
        within=120,
        what="the scale-up",
    )
    assert [a["status"] for a in up] == ["succeeded"]
    assert demo.api("/api/v1/jobs/demo")["num_dp_replicas"] == 2
    step = job_step(demo)
    wait_for(lambda: job_step(demo) > step + 3, within=120, what="training on two ranks again")
    # Both resizes resumed from a checkpoint, none from step 0.
    assert all(s > 0 for s, _ in resumed_steps(demo)), resumed_steps(demo)


def test_fsdp_supervisor_killed_mid_remediation_takes_over_and_repeats_nothing(
    start_demo: Callable[..., LocalDemo], tmp_path: Path
) -> None:
    """The supervisor is SIGKILLed as soon as the remedy of a crashed FSDP rank is
    recorded; the one started again takes the action over from its database, the job
    heals once, and its weights are those of a run without the fault."""
    expected = reference(tmp_path, 2, "fsdp")
    demo = start_demo(
        replicas=2,
        total_steps=STEPS,
        parallelism="fsdp",
        workload_env=dict(TORCH_ENV, OMP_NUM_THREADS="1", COLLECTIVE_TIMEOUT_S="8"),
        supervisor_env={"SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "60"},
        in_memory_checkpointing_freq=5,
        s3_checkpointing_freq=10,
    )
    wait_for(lambda: job_step(demo) >= 15, within=120, what="training to reach step 15")
    injected = inject(demo, kind="worker_crash", node=demo.options.nodes[1])
    wait_for(lambda: demo.api("/api/v1/actions")["items"], what="a recorded action")
    demo.kill_supervisor()
    demo.start_supervisor()
    demo.wait_ready(f"{demo.url}/readyz")

    actions = wait_for(lambda: finished_actions(demo, 2), within=120, what="the remediation")
    assert [(a["type"], a["status"]) for a in actions] == [
        ("emergency_checkpoint", "succeeded"),
        ("restart_in_place", "succeeded"),
    ], actions
    assert all(a["fault_id"] == injected["id"] for a in actions)
    weights = wait_for(lambda: output(demo), within=300, what="the job to finish")
    assert weights == expected
    # One decision, carried out once: a single new world after the boot.
    state = json.loads((demo.run_dir / "cluster.json").read_text())
    assert state["job"]["attempt"] == 2, state["job"]
