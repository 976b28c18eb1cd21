"""The checkpoint tiers with real torch: DDP on gloo, one process per rank, real files.

Each test runs `tests/torch_jobs/checkpoint_job.py` as separate processes (2 ranks, one
per "node": each rank has its own RAM tier directory, the durable one is shared) and
compares the final weights, by hash, with a run that was never interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from resiliency_protocol.checkpoint_manifest import FORMAT, MANIFEST, FileEntry
from tests.forked_ranks import RankProcess, log_path, start_rank
from tests.test_worker_client import free_port
from training.checkpoint import CheckpointSettings
from training.checkpoint import format as fmt

ROOT = Path(__file__).resolve().parent.parent
STEPS = 24
WORLD = 2


def start_job(
    tmp: Path,
    name: str,
    *,
    steps: int = STEPS,
    stop_at: int = 0,
    ram_dirs: Mapping[int, Path] | None = None,
    extra_env: Mapping[int, Mapping[str, str]] | None = None,
) -> dict[int, RankProcess]:
    """Start the job's WORLD ranks (RAM tier per rank: tmp/ram/node-<rank> by default)."""
    port = free_port()
    out = tmp / name
    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for rank in range(WORLD):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))},
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "JOB_STEPS": str(steps),
            "JOB_STOP_AT": str(stop_at),
            "JOB_RESULT": str(out / f"rank-{rank}.json"),
            "IN_MEMORY_CHECKPOINTING_FREQ": "5",
            "S3_CHECKPOINTING_FREQ": "10",
            "CHECKPOINT_RAM_DIR": str((ram_dirs or {}).get(rank, tmp / "ram" / f"node-{rank}")),
            "CHECKPOINT_DURABLE_DIR": str(tmp / "durable"),
            "SYNC_FILES": "false",
            **((extra_env or {}).get(rank, {})),
        }
        procs[rank] = start_rank("tests.torch_jobs.checkpoint_job", env, log_path(out, rank))
    return procs


#: Each rank's output of the last `run_job`, for a failed assertion to show.
logs: dict[int, str] = {}


def run_job(
    tmp: Path, name: str, *, timeout_s: float = 180, **options: Any
) -> dict[int, dict[str, Any]]:
    """Run the job to its end; {rank: its result}."""
    procs = start_job(tmp, name, **options)
    results: dict[int, dict[str, Any]] = {}
    logs.clear()
    for rank, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{output}"
        results[rank] = json.loads((tmp / name / f"rank-{rank}.json").read_text())
        logs[rank] = output
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final weights of a run never interrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    results = run_job(tmp, "ref")
    digests = {r["weights_sha256"] for r in results.values()}
    assert len(digests) == 1  # DDP: every replica holds the same weights
    assert all(r["restored"] == 0 and r["final_step"] == STEPS for r in results.values())
    return digests.pop()


def final_digest(results: Mapping[int, Mapping[str, Any]]) -> str:
    digests = {r["weights_sha256"] for r in results.values()}
    assert len(digests) == 1, results
    return digests.pop()


def test_resume_from_ram_is_bit_exact(tmp_path: Path, reference: str) -> None:
    first = run_job(tmp_path, "first", stop_at=13)
    assert {r["final_step"] for r in first.values()} == {13}
    # RAM keeps its two newest in a job of several ranks (5 and 10), durable its two
    # newest (10 only: every 10 steps). A DDP state is the same on every rank: rank 0's
    # durable copy serves them all.
    for rank in range(WORLD):
        assert fmt.committed_steps(tmp_path / "ram" / f"node-{rank}", rank) == [5, 10]
    assert fmt.committed_steps(tmp_path / "durable", 0) == [10]
    assert fmt.committed_steps(tmp_path / "durable", 1) == []
    second = run_job(tmp_path, "second")
    assert {(r["restored"], r["tier"]) for r in second.values()} == {(10, "ram")}
    assert {r["samples_seen"] for r in second.values()} == {STEPS * 32}
    assert final_digest(second) == reference


def test_lost_ram_restores_from_durable(tmp_path: Path, reference: str) -> None:
    run_job(tmp_path, "first", stop_at=17)  # RAM: steps 10 and 15; durable: step 10
    shutil.rmtree(tmp_path / "ram" / "node-1")
    second = run_job(tmp_path, "second")
    # Rank 1 can load only step 10 (durable): both agree on it, rank 0 from its RAM.
    assert {r["restored"] for r in second.values()} == {10}
    assert {rank: r["tier"] for rank, r in second.items()} == {0: "ram", 1: "durable"}
    assert final_digest(second) == reference


def test_kill_during_save_leaves_nothing_that_looks_complete(
    tmp_path: Path, reference: str
) -> None:
    # Rank 1 is SIGKILLed while the files of step 15 are written, before the commit; its
    # peer then fails in a collective and is stopped as a supervisor would stop it.
    procs = start_job(tmp_path, "killed", extra_env={1: {"JOB_KILL_IN_SAVE_AT": "15"}})
    procs[1].communicate(timeout=120)
    assert procs[1].returncode == -9
    procs[0].kill()
    procs[0].communicate(timeout=30)
    ram1 = tmp_path / "ram" / "node-1"
    assert fmt.committed_steps(ram1, 1) == [5, 10]
    leftovers = [p.name for p in (ram1 / "step-0000000015").iterdir()]
    assert leftovers and all(name.startswith(".tmp-rank-1-") for name in leftovers)
    second = run_job(tmp_path, "second")
    # Never step 15, whose files rank 1 was killed writing: step 10, or step 20 where
    # rank 0 trained on to it and committed it while rank 1's save of 15 was still being
    # written in the background (a loaded machine, once): the state is replicated, so
    # every rank loads rank 0's copy of 20.
    assert {r["restored"] for r in second.values()} in ({10}, {20})
    assert final_digest(second) == reference
    # The leftovers were removed at start (step 15 was then saved again, and is kept).
    assert not any((ram1 / "step-0000000015" / name).exists() for name in leftovers)


def test_corrupted_shard_is_skipped_for_another_source(tmp_path: Path, reference: str) -> None:
    run_job(tmp_path, "first", stop_at=12)  # RAM and durable: step 10
    shard = tmp_path / "ram" / "node-0" / "step-0000000010" / "rank-0" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    second = run_job(tmp_path, "second")
    assert second[0]["restored"] == 10 and second[0]["tier"] == "durable"
    assert second[1]["restored"] == 10 and second[1]["tier"] == "ram"
    assert final_digest(second) == reference


def test_a_step_no_source_can_serve_is_dropped_by_every_rank(
    tmp_path: Path, reference: str
) -> None:
    run_job(tmp_path, "first", stop_at=17)  # RAM: 15; durable: 10
    shard = tmp_path / "ram" / "node-1" / "step-0000000015" / "rank-1" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    second = run_job(tmp_path, "second")
    # Rank 1 found step 15 listed but corrupt; both ranks fall back to step 10, saying so.
    assert {r["restored"] for r in second.values()} == {10}
    said = "step 15 could not be loaded by ranks [1]: agreeing again"
    assert all(said in logs[rank] for rank in second), logs
    assert final_digest(second) == reference


def test_ranks_that_cannot_agree_after_a_load_stop_rather_than_start_fresh(
    tmp_path: Path,
) -> None:
    no_durable = {rank: {"S3_CHECKPOINTING_FREQ": "0"} for rank in range(WORLD)}
    run_job(tmp_path, "first", stop_at=7, extra_env=no_durable)  # RAM only: step 5
    shard = tmp_path / "ram" / "node-1" / "step-0000000005" / "rank-1" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Rank 0 loads step 5, rank 1 cannot: step 0 would leave rank 0 with step 5's weights.
    procs = start_job(tmp_path, "second", extra_env=no_durable)
    for proc in procs.values():
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert "no step is left that every rank can load" in output


def test_settings_are_refused_with_the_names_of_the_settings(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"s3_checkpointing_freq=15 .*in_memory_checkpointing_freq=10"
    ):
        CheckpointSettings(
            in_memory_checkpointing_freq=10, s3_checkpointing_freq=15, durable_dir=tmp_path
        )
    with pytest.raises(ValueError, match="needs durable_dir"):
        CheckpointSettings(s3_checkpointing_freq=20)
    with pytest.raises(ValueError, match="ckpt_threads_per_rank must be an integer >= 1"):
        CheckpointSettings(ckpt_threads_per_rank=0, s3_checkpointing_freq=0)
    with pytest.raises(ValueError, match="topk_ckpt"):
        CheckpointSettings(topk_ckpt=0, s3_checkpointing_freq=0)
    with pytest.raises(ValueError, match="IN_MEMORY_CHECKPOINTING_FREQ must be an integer"):
        CheckpointSettings.from_env({"IN_MEMORY_CHECKPOINTING_FREQ": "ten"})
    with pytest.raises(ValueError, match="overlap"):
        CheckpointSettings(ram_dir=tmp_path, durable_dir=tmp_path / "d")
    env = {
        "IN_MEMORY_CHECKPOINTING_FREQ": "5",
        "S3_CHECKPOINTING_FREQ": "20",
        "CHECKPOINT_DURABLE_DIR": str(tmp_path / "durable"),
        "ENABLE_ASYNC_CKPT": "false",
        "CKPT_THREADS_PER_RANK": "4",
        "TOPK_CKPT": "3",
    }
    settings = CheckpointSettings.from_env(env)
    assert (settings.s3_checkpointing_freq, settings.ckpt_threads_per_rank) == (20, 4)
    assert settings.enable_async_ckpt is False and settings.topk_ckpt == 3


def test_settings_refused_in_a_job_stop_it_with_the_message(tmp_path: Path) -> None:
    procs = start_job(tmp_path, "bad", extra_env={0: {"S3_CHECKPOINTING_FREQ": "7"}, 1: {}})
    output, _ = procs[0].communicate(timeout=120)
    procs[1].kill()
    procs[1].communicate(timeout=30)
    assert procs[0].returncode != 0
    assert "s3_checkpointing_freq=7 must be a multiple of in_memory_checkpointing_freq=5" in output


def test_the_readme_example_runs_under_torchrun_and_resumes(tmp_path: Path) -> None:
    readme = (ROOT / "docs" / "training.md").read_text()
    start = readme.index("# example: checkpoint tiers")
    code = readme[start : readme.index("```", start)]
    script = tmp_path / "train.py"
    script.write_text(code)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))},
        "CHECKPOINT_RAM_DIR": str(tmp_path / "ram"),
        "CHECKPOINT_DURABLE_DIR": str(tmp_path / "durable"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    for start in (0, 100):  # the second run resumes from step 100: nothing left to do
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout + done.stderr
        for rank in range(2):
            assert f"rank {rank}: starting after step {start}" in done.stdout
    for rank in range(2):
        assert fmt.committed_steps(tmp_path / "ram", rank) == [80, 90, 100]  # 3: two ranks
    # DDP: one durable copy, rank 0's, serves every rank.
    assert fmt.committed_steps(tmp_path / "durable", 0) == [50, 100]
    assert fmt.committed_steps(tmp_path / "durable", 1) == []


# --- one process: the save path itself -----------------------------------------------


def small_checkpointer(tmp: Path, **settings: Any) -> Any:
    import torch

    from training.checkpoint import Checkpointer
    from training.checkpoint.peer import PeerTier

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    config = CheckpointSettings(
        **{
            "in_memory_checkpointing_freq": 1,
            "s3_checkpointing_freq": 2,
            "ram_dir": tmp / "ram",
            "durable_dir": tmp / "durable",
            "sync_files": False,
            **settings,
        }
    )
    return Checkpointer(
        model, optimizer, settings=config, peer=PeerTier(None, None, 0, fetch_timeout_s=1)
    )


def test_a_save_due_while_the_last_is_written_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from training.checkpoint import saver

    release = threading.Event()
    writing = threading.Event()
    real_save = saver.dcp_save

    def held_save(*args: Any, **kwargs: Any) -> Any:
        writing.set()
        assert release.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(saver, "dcp_save", held_save)
    ckpt = small_checkpointer(tmp_path)
    ckpt.step_done(1)  # returns while its write is held: the save is asynchronous
    assert writing.wait(10) and ckpt._saver.busy
    assert fmt.committed_steps(tmp_path / "ram", 0) == []
    second_returned = threading.Event()
    worker = threading.Thread(target=lambda: (ckpt.step_done(2), second_returned.set()))
    worker.start()
    # Step 2 is due while step 1 is still being written: it waits (it does not skip, and
    # does not overwrite the buffers step 1 is being written from).
    assert not second_returned.wait(0.3)
    release.set()
    worker.join(30)
    assert second_returned.is_set()
    ckpt.close()
    assert [(r.step, r.tier) for r in ckpt.save_results] == [(1, "ram"), (2, "ram"), (2, "durable")]
    assert all(r.error is None for r in ckpt.save_results)
    # The wait is counted as blocking: most of the 0.3 s it was held (the worker thread may
    # start its clock a moment after ours).
    assert ckpt.blocking[1] >= 0.25
    assert fmt.committed_steps(tmp_path / "ram", 0) == [2]  # ram_topk_ckpt = 1


def test_a_synchronous_save_is_committed_when_it_returns(tmp_path: Path) -> None:
    ckpt = small_checkpointer(tmp_path, enable_async_ckpt=False, topk_ckpt=2)
    for step in range(1, 7):
        ckpt.step_done(step)
        assert step in fmt.committed_steps(tmp_path / "ram", 0)
    ckpt.close()
    assert fmt.committed_steps(tmp_path / "durable", 0) == [4, 6]  # topk_ckpt = 2
    manifest = fmt.read_manifest(fmt.rank_dir(tmp_path / "durable", 6, 0), step=6, rank=0)
    fmt.verify(fmt.rank_dir(tmp_path / "durable", 6, 0), manifest)
    assert manifest.total_bytes == sum(
        f.stat().st_size
        for f in fmt.rank_dir(tmp_path / "durable", 6, 0).iterdir()
        if f.name != MANIFEST
    )


# --- the peer tier: real host monitors ------------------------------------------------

PEER_JOB = "torchjob"


@pytest.fixture
def monitors(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with peer_monitors(tmp_path) as found:
        yield found


@contextlib.contextmanager
def peer_monitors(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Host monitors node-a, node-b (partners of each other) and a spare, node-s, whose
    partner is node-a (it takes node-b's place)."""
    from tests.test_host_monitor import WORKER_TOKEN, Cluster
    from tests.test_host_monitor_peer import PEER_TOKEN

    (tmp_path / "monitors").mkdir()
    cluster = Cluster(tmp_path / "monitors")
    agents = {}
    try:
        for name in ("node-a", "node-b", "node-s"):
            agents[name] = cluster.start_agent(
                None,
                node=name,
                env={"HOST_MONITOR_PEER_TOKEN": PEER_TOKEN},
                initial_state="running",
                job=PEER_JOB,
                checkpoint_root=tmp_path / name / "ram",
                peer_store_dir=tmp_path / name / "peer",
                peer_timeout_s=20,
            )
        for name, partner in (("node-a", "node-b"), ("node-b", "node-a"), ("node-s", "node-a")):
            body = {"node": partner, "url": agents[partner].url}
            assert agents[name].api.put("/v1/checkpoint-peer", json=body).status_code == 200
        yield {"agents": agents, "token": WORKER_TOKEN}
    finally:
        for agent in agents.values():
            agent.close()
        cluster_close = getattr(cluster, "close", None)
        if cluster_close is not None:
            cluster_close()
        for agent in agents.values():
            agent.proc.kill()
            agent.proc.wait(10)


def on_nodes(tmp: Path, monitors: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    """start_job options placing rank r on host monitor nodes[r]."""
    agents = monitors["agents"]
    env = {
        rank: {
            "HOST_MONITOR_URL": agents[node].url,
            "HOST_MONITOR_WORKER_TOKEN": monitors["token"],
            "HOST_MONITOR_JOB": PEER_JOB,
        }
        for rank, node in enumerate(nodes)
    }
    ram = {rank: tmp / node / "ram" / PEER_JOB for rank, node in enumerate(nodes)}
    return {"extra_env": env, "ram_dirs": ram}


def wait_pushed(monitors: dict[str, Any], node: str, rank: int, step: int) -> None:
    from tests.test_host_monitor import wait_for

    agent = monitors["agents"][node]

    def done() -> bool:
        state = agent.worker_api.get(f"/v1/workers/{rank}/checkpoints/replicate").json()
        assert state["state"] != "failed", state
        return bool(state["step"] == step and state["state"] == "done")

    wait_for(done, 30, f"{node} pushed rank {rank} step {step}")


def reports(monitors: dict[str, Any], node: str) -> list[dict[str, Any]]:
    """The checkpoint reports the node's workers sent (GET /v1/checkpoints)."""
    r = monitors["agents"][node].api.get("/v1/checkpoints")
    assert r.status_code == 200, r.text
    return [record["report"] for record in r.json()]


def test_lost_ram_of_one_node_restores_from_its_partner(
    tmp_path: Path, reference: str, monitors: dict[str, Any]
) -> None:
    placed = on_nodes(tmp_path, monitors, ["node-a", "node-b"])
    run_job(tmp_path, "first", stop_at=17, **placed)  # RAM and peer: 15; durable: 10
    wait_pushed(monitors, "node-b", 1, 15)
    wait_pushed(monitors, "node-a", 0, 15)
    shutil.rmtree(tmp_path / "node-b" / "ram" / PEER_JOB)
    second = run_job(tmp_path, "second", **placed)
    assert (second[0]["restored"], second[0]["tier"]) == (15, "ram"), logs
    assert (second[1]["restored"], second[1]["tier"]) == (15, "peer"), logs  # not durable's
    assert final_digest(second) == reference
    # Every save and load was reported with its tier and size, the peer copies too.
    from tests.test_host_monitor import wait_for

    def loaded_from_peer() -> list[dict[str, Any]]:
        return [
            r
            for r in reports(monitors, "node-b")
            if r["event"] == "loaded" and r["tier"] == "peer" and r["step"] == 15
        ]

    (load,) = wait_for(loaded_from_peer, 10, "the peer load reported")
    assert load["bytes"] > 0 and load["total_s"] >= load["duration_s"] >= 0
    saved = {r["tier"] for r in reports(monitors, "node-a") if r["event"] == "saved"}
    assert saved == {"ram", "durable"}  # the peer copy is reported by the host monitor
    assert all(r["bytes"] > 0 for r in reports(monitors, "node-a"))


def test_an_empty_spare_restores_from_the_peer_copy(
    tmp_path: Path, reference: str, monitors: dict[str, Any]
) -> None:
    run_job(tmp_path, "first", stop_at=17, **on_nodes(tmp_path, monitors, ["node-a", "node-b"]))
    wait_pushed(monitors, "node-b", 1, 15)
    # node-b is gone; the spare node-s (empty RAM, partner node-a) takes rank 1.
    second = run_job(tmp_path, "second", **on_nodes(tmp_path, monitors, ["node-a", "node-s"]))
    assert (second[1]["restored"], second[1]["tier"]) == (15, "peer")
    newest = STEPS // 5 * 5
    assert fmt.committed_steps(tmp_path / "node-s" / "ram" / PEER_JOB, 1) == [newest - 5, newest]
    assert final_digest(second) == reference


def test_a_node_lost_before_its_newest_step_reached_its_partner_resumes_from_the_step_before(
    tmp_path: Path, reference: str, monitors: dict[str, Any]
) -> None:
    """node-b is lost while its newest step (15) is still on its way to node-a: its rank,
    on a spare, can load only the partner's older copy (10), so node-a's rank must still
    hold step 10 in its RAM for the two to agree on it, rather than both start from
    nothing (no durable tier here)."""
    no_durable = {"S3_CHECKPOINTING_FREQ": "0"}
    placed = on_nodes(tmp_path, monitors, ["node-a", "node-b"])
    extra = {rank: {**env, **no_durable} for rank, env in placed["extra_env"].items()}
    run_job(tmp_path, "first", stop_at=12, extra_env=extra, ram_dirs=placed["ram_dirs"])
    wait_pushed(monitors, "node-b", 1, 10)
    # Steps 11 to 17 with no host monitor: step 15 reaches each node's RAM, not the partner.
    on = {rank: no_durable for rank in range(WORLD)}
    run_job(tmp_path, "on", stop_at=17, extra_env=on, ram_dirs=placed["ram_dirs"])
    assert fmt.committed_steps(placed["ram_dirs"][0], 0) == [5, 10, 15]
    shutil.rmtree(placed["ram_dirs"][1])
    spare = on_nodes(tmp_path, monitors, ["node-a", "node-s"])
    extra = {rank: {**env, **no_durable} for rank, env in spare["extra_env"].items()}
    second = run_job(tmp_path, "second", extra_env=extra, ram_dirs=spare["ram_dirs"])
    assert {rank: (r["restored"], r["tier"]) for rank, r in second.items()} == {
        0: (10, "ram"),
        1: (10, "peer"),
    }
    assert final_digest(second) == reference


def test_both_ram_copies_lost_restores_from_durable(
    tmp_path: Path, reference: str, monitors: dict[str, Any]
) -> None:
    placed = on_nodes(tmp_path, monitors, ["node-a", "node-b"])
    run_job(tmp_path, "first", stop_at=17, **placed)
    wait_pushed(monitors, "node-b", 1, 15)
    shutil.rmtree(tmp_path / "node-b" / "ram" / PEER_JOB)  # node-b's own RAM ...
    shutil.rmtree(tmp_path / "node-a" / "peer")  # ... and the copy its partner held
    second = run_job(tmp_path, "second", **placed)
    # Rank 1 can load only durable's step 10; rank 0 still holds it in its RAM.
    assert {r["restored"] for r in second.values()} == {10}
    assert {rank: r["tier"] for rank, r in second.items()} == {0: "ram", 1: "durable"}
    # Each rank's log says what was left out, and which rank lacked it.
    said = "step 10 is the newest every rank can load; newer steps held: {0: [15]}; ranks "
    assert all(f"{said}with none newer: [1]" in logs[rank] for rank in second), logs
    assert final_digest(second) == reference


def test_the_copy_during_the_next_step_saves_the_state_of_the_step_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import torch

    from training.checkpoint import Checkpointer

    release = threading.Event()
    real_finish = Checkpointer._finish_staging

    def slow_finish(self: Checkpointer, state: dict[str, Any], ready: Any) -> dict[str, Any]:
        assert release.wait(30)  # the copy is still running when the next step arrives
        return real_finish(self, state, ready)

    monkeypatch.setattr(Checkpointer, "_finish_staging", slow_finish)
    ckpt = small_checkpointer(tmp_path, s3_checkpointing_freq=0)
    model, optimizer = ckpt.state.model, ckpt.state.optimizer
    assert ckpt.settings.stage_during_next_step
    at_step_1 = {k: v.clone() for k, v in model.state_dict().items()}
    adam_at_1 = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    ckpt.step_done(1)
    # The next step: forward and backward run while the copy is held; optimizer.step()
    # waits until it is released.
    model(torch.randn(4, 64)).sum().backward()
    threading.Timer(0.3, release.set).start()
    optimizer.step()
    assert release.is_set()
    # The wait in optimizer.step() counts as blocking: the 0.3 s hold, less the step's
    # own start before its wait.
    assert ckpt.blocking[0] >= 0.25
    assert not torch.equal(model.weight, at_step_1["weight"])  # the step did change them
    ckpt.close()
    assert ckpt.save_results[0].blocking_s == ckpt.blocking[0]
    # What was saved is step 1's state, not the one after the next optimizer step.
    fresh = small_checkpointer(tmp_path, s3_checkpointing_freq=0)
    assert fresh.restore() == 1
    for key, value in fresh.state.model.state_dict().items():
        assert torch.equal(value, at_step_1[key]), key
    assert torch.equal(fresh.state.optimizer.state_dict()["state"][0]["exp_avg"], adam_at_1)
    fresh.close()


def test_the_direct_reader_restores_every_dtype_exactly(tmp_path: Path) -> None:
    import torch

    from training.checkpoint import Checkpointer
    from training.checkpoint.peer import PeerTier
    from training.checkpoint.reader import DirectReader

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(8, 32)).sum().backward()
        optimizer.step()
    model[2].to(torch.bfloat16)  # a bf16 layer; BatchNorm brings an int64 buffer
    settings = CheckpointSettings(
        in_memory_checkpointing_freq=1, s3_checkpointing_freq=0, ram_dir=tmp_path
    )
    no_peer = PeerTier(None, None, 0, fetch_timeout_s=1)
    saver = Checkpointer(model, optimizer, settings=settings, peer=no_peer)
    saver.save(1)
    saver.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_adam = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
        model[1].num_batches_tracked.add_(5)
    optimizer.state[model[0].weight]["exp_avg"].zero_()
    direct = DirectReader.direct
    loader = Checkpointer(model, optimizer, settings=settings, peer=no_peer)
    assert loader.restore() == 1
    assert DirectReader.direct > direct  # the large tensors took the direct path
    got = model.state_dict()
    assert {k: (v.dtype, torch.equal(v, want[k])) for k, v in got.items()} == {
        k: (v.dtype, True) for k, v in want.items()
    }
    got_adam = optimizer.state_dict()["state"][0]
    assert all(torch.equal(got_adam[k], v) for k, v in want_adam.items())


def test_a_checkpointer_given_its_tiers_and_options_saves_to_each_tier_and_restores(
    tmp_path: Path,
) -> None:
    """The constructor's objects (settings, tiers, options) in place of its keywords: the
    tiers opened once are what the saver writes to, tier by tier, and what a restore
    reads from; options and their keywords together, or `peer` beside `tiers`, are
    refused by name."""
    import torch

    from resiliency_protocol.checkpoint_reports import Tier
    from training import Checkpointer, CheckpointerOptions, Tiers
    from training.checkpoint.peer import PeerTier

    settings = CheckpointSettings(
        in_memory_checkpointing_freq=2,
        s3_checkpointing_freq=4,
        ram_dir=tmp_path / "ram",
        durable_dir=tmp_path / "durable",
        enable_async_ckpt=False,
        sync_files=False,
    )
    no_peer = PeerTier(None, None, 0, fetch_timeout_s=1)
    options = CheckpointerOptions(rank=0, world_size=1, job="objects")

    def open_tiers() -> Tiers:
        return Tiers.open(settings, rank=0, job="objects", peer=no_peer)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tiers = open_tiers()
    assert [tier.kind for tier in tiers] == [Tier.RAM, Tier.PEER, Tier.DURABLE]
    ckpt = Checkpointer(model, optimizer, settings=settings, tiers=tiers, options=options)
    for step in range(1, 5):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        ckpt.step_done(step)
    ckpt.close()
    saved = [(r.tier, r.step) for r in ckpt.save_results if r.error is None]
    assert saved == [(Tier.RAM, 2), (Tier.RAM, 4), (Tier.DURABLE, 4)]
    assert [tier.steps(0) for tier in tiers.stored] == [[4], [4]]  # RAM keeps 1
    want = model.weight.detach().clone()

    shutil.rmtree(tmp_path / "ram")  # a new node: the durable tier alone holds step 4
    fresh = torch.nn.Linear(4, 2)
    again = Checkpointer(
        fresh,
        torch.optim.SGD(fresh.parameters()),
        settings=settings,
        tiers=open_tiers(),
        options=options,
    )
    assert again.restore() == 4
    assert again.last_restore is not None and again.last_restore.tier == Tier.DURABLE
    assert torch.equal(fresh.weight, want)
    again.close()

    with pytest.raises(TypeError, match="rank"):
        Checkpointer(model, settings=settings, options=options, rank=0)
    with pytest.raises(TypeError, match="peer"):
        Checkpointer(model, settings=settings, tiers=open_tiers(), peer=no_peer)
    with pytest.raises(TypeError, match="ranks"):
        Checkpointer(model, settings=settings, ranks=2)  # type: ignore[call-arg]


def test_files_are_summed_as_written_and_as_read(tmp_path: Path) -> None:
    """The manifest's sums come from the bytes as they were written, and a load checks
    each shard as it reads it: no second pass over the files, and a flipped byte inside a
    tensor is still caught."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from training.checkpoint.reader import DirectReader
    from training.checkpoint.writer import SummingFileSystemWriter

    state = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    writer = SummingFileSystemWriter(tmp_path, thread_count=2, sync_files=False)
    dcp_save(state, storage_writer=writer, no_dist=True)
    from_writes = fmt.build_manifest(
        tmp_path, step=1, rank=0, world_size=1, job=None, known=writer.sums
    )
    from_disk = fmt.build_manifest(tmp_path, step=1, rank=0, world_size=1, job=None)
    assert set(writer.sums) == set(from_disk.files)  # .metadata too, after its rename
    assert from_writes.files == from_disk.files

    sums = {name: (e.size, e.checksum) for name, e in from_disk.files.items()}
    shards = sorted(n for n in sums if n.endswith(".distcp"))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = DirectReader(tmp_path, thread_count=2, sums=sums, checksum=from_disk.checksum)
    dcp_load(target, storage_reader=reader, no_dist=True)
    assert sorted(reader.summed) == shards and reader.corrupt == []
    assert all(torch.equal(target[k], v) for k, v in state.items())

    shard = tmp_path / shards[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 4] ^= 0x01  # inside the first tensor: the load itself succeeds
    shard.write_bytes(bytes(data))
    reader = DirectReader(tmp_path, thread_count=2, sums=sums, checksum=from_disk.checksum)
    dcp_load(target, storage_reader=reader, no_dist=True)
    assert len(reader.corrupt) == 1 and shards[0] in reader.corrupt[0]
    with pytest.raises(fmt.CheckpointCorrupt):
        fmt.verify(tmp_path, from_disk)


def test_a_checkpoint_of_the_previous_format_restores_and_is_checked(tmp_path: Path) -> None:
    """Checkpoints taken before an upgrade (format 1: zlib crc32 per file) still restore,
    and a flipped byte in one is still caught."""
    import zlib

    import torch

    from training.checkpoint import Checkpointer
    from training.checkpoint.peer import PeerTier

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    settings = CheckpointSettings(
        in_memory_checkpointing_freq=1,
        s3_checkpointing_freq=0,
        ram_dir=tmp_path / "ram",
        sync_files=False,
    )
    saver = Checkpointer(
        model, optimizer, settings=settings, peer=PeerTier(None, None, 0, fetch_timeout_s=1)
    )
    saver.save(3)
    saver.wait()
    saver.close()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    directory = fmt.rank_dir(tmp_path / "ram", 3, 0)
    current = fmt.read_manifest(directory, step=3, rank=0)
    assert current.format == FORMAT
    sums = {n: zlib.crc32((directory / n).read_bytes()) for n in current.files}
    old = current.model_copy(
        update={
            "format": "resiliency-checkpoint/1",
            "files": {n: FileEntry(size=e.size, crc32=sums[n]) for n, e in current.files.items()},
        }
    )
    text = old.to_json()
    assert '"crc32"' in text and '"crc32c"' not in text
    (directory / MANIFEST).write_text(text)

    def restored() -> int:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        loader = Checkpointer(
            model, optimizer, settings=settings, peer=PeerTier(None, None, 0, fetch_timeout_s=1)
        )
        try:
            step = loader.restore()
        finally:
            loader.close()
        return step

    assert restored() == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    shard = next(directory.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert restored() == 0  # the only source is damaged: nothing loaded as if it were good
