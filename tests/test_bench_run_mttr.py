"""The `supervisor run` MTTR rows' set-up (bench/run_mttr_rows.py) and the progress they
read with two ranks per node: the cluster is the one `supervisor run --nnodes 2
--nproc-per-node 2` starts, and the per-rank worker logs of four ranks on two nodes give
the job's attempts, steps and resume points as one job's."""

from __future__ import annotations

import sys
from pathlib import Path

from bench import mttr, run_mttr_rows, torchrun_mttr


def test_the_cluster_is_the_one_supervisor_run_starts(tmp_path: Path) -> None:
    opts = run_mttr_rows.run_options()
    config = run_mttr_rows.mttr_config(opts, 2, None)
    demo = mttr.demo_options(opts.policy, config, tmp_path)
    assert demo.command == [sys.executable, "-u", "-m", "training.torch_workload"]
    assert (demo.replicas, demo.nproc_per_node, demo.spares) == (2, 2, 2)
    spec = demo.job_spec(demo.nodes[:2])
    assert spec.world_size == 4 and list(spec.ranks_of(1)) == [2, 3]
    # As `supervisor run` leaves it: every rank restarts, the job keeps its shape.
    assert not spec.in_process_restart and not spec.standby_preload
    assert demo.supervisor_env["SUPERVISOR_ENABLE_WORKLOAD_SCALING"] == "false"
    assert demo.supervisor_env["SUPERVISOR_MIN_NUM_DP_REPLICAS"] == "2"
    env = dict(spec.env)
    assert env["STEP_TIME_S"] == "0.05" and env["IN_MEMORY_CHECKPOINTING_FREQ"] == "10"
    base = torchrun_mttr.TorchrunConfig(nnodes="2", nproc_per_node=2)
    assert base.world_size == 4


def write(path: Path, *lines: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(f"{line}\n" for line in lines)


def rank_log(run_dir: Path, rank: int) -> Path:
    node = f"node-{rank // 2}"
    return run_dir / "nodes" / node / f"{node}.job.rank{rank}.log"


def say(rank: int, message: str) -> str:
    return f"torch workload rank={rank}: {message}"


def test_four_ranks_on_two_nodes_read_as_one_job(tmp_path: Path) -> None:
    for rank in range(4):
        write(
            rank_log(tmp_path, rank),
            say(rank, "start attempt=1 world_size=4: starting from step=0 (no checkpoint)"),
            *(say(rank, f"step={s}/10000000 loss=5.0000") for s in range(1, 8 - rank)),
        )
    progress = mttr.LogProgress(tmp_path, "job")
    assert progress.current() == (1, 7)  # the newest step any rank logged
    logs = mttr.WorkerLogs(tmp_path, "job")
    logs.mark()
    # A worker crash: every rank restarts, each resuming step 5 (two from the RAM tier,
    # the swapped-in node's from the durable one).
    for rank in range(4):
        tier = "durable" if rank >= 2 else "local"
        write(
            rank_log(tmp_path, rank),
            say(rank, f"start attempt=2 world_size=4: resumed step=5 tier={tier}"),
        )
    assert not progress.progressed_past(2, 5, 4)
    write(rank_log(tmp_path, 3), say(3, "step=6/10000000 loss=4.9000"))
    assert progress.progressed_past(2, 5, 4)
    assert progress.current() == (2, 6) and progress.attempts() == [1, 2]
    assert progress.newest_step(1) == 7
    resumed, terminated = logs.parse()
    assert resumed == {2: (5, "local+durable", 4)} and terminated == []


def test_torchrun_with_two_workers_per_agent_counts_the_whole_world(tmp_path: Path) -> None:
    config = torchrun_mttr.TorchrunConfig(nnodes="2", nproc_per_node=2)
    runner = torchrun_mttr.Runner(torchrun_mttr.TorchrunJob(tmp_path, config), config)
    lines = {
        node: [
            (0.0, say(r, "start attempt=0 world_size=4: resumed step=10 tier=local"))
            for r in (2 * i, 2 * i + 1)
        ]
        + [(0.0, say(2 * i, "step=11/10000000 loss=5.0"))]
        for i, node in enumerate(torchrun_mttr.NODES)
    }
    runner._track(lines)
    assert runner.world == {"node-0": 4, "node-1": 4} and runner.step == 11
    assert all(runner.world[n] == config.world_size for n in torchrun_mttr.NODES)
