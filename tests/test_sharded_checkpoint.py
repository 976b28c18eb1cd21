"""Sharded training states (FSDP2, HSDP) through the checkpoint tiers, with real torch.

Each test runs `tests/torch_jobs/sharded_job.py` as separate processes on gloo (one
process per rank, each rank its own RAM tier directory as on a node of its own, the
durable one shared) and compares hashes of the full, unsharded model and optimizer state:
after a resume with a run never interrupted, after a resharded restore with the state
that was saved.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.forked_ranks import log_path, start_rank  # noqa: E402
from tests.test_checkpoint_tiers import on_nodes, peer_monitors, wait_pushed  # noqa: E402
from tests.test_worker_client import free_port  # noqa: E402
from training.checkpoint import format as fmt  # noqa: E402
from training.checkpoint import global_view  # noqa: E402

STEPS = 20


def run_job(
    tmp: Path,
    name: str,
    world: int,
    *,
    steps: int = STEPS,
    stop_at: int = 0,
    env: Mapping[str, str] | None = None,
    extra_env: Mapping[int, Mapping[str, str]] | None = None,
    ram_dirs: Mapping[int, Path] | None = None,
    timeout_s: float = 240,
) -> dict[int, dict[str, Any]]:
    """Run the job's `world` ranks to their end; {rank: its result}."""
    port = free_port()
    out = tmp / name
    out.mkdir(parents=True, exist_ok=True)
    procs = {}
    for rank in range(world):
        procs[rank] = start_rank(
            "tests.torch_jobs.sharded_job",
            {
                **{
                    k: v
                    for k, v in os.environ.items()
                    if not k.startswith(("CHECKPOINT_", "HOST_", "JOB_"))
                },
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
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
                **(env or {}),
                **((extra_env or {}).get(rank, {})),
            },
            log_path(out, rank),
        )
    outputs: dict[int, str] = {}
    for rank, proc in procs.items():
        try:
            outputs[rank], _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
    # Every rank's output: the one that failed first may not be the first to say so.
    failed = {rank: p.returncode for rank, p in procs.items() if p.returncode != 0}
    assert not failed, "\n".join(f"rank {r} exited {c}:\n{outputs[r]}" for r, c in failed.items())
    results: dict[int, dict[str, Any]] = {}
    for rank in procs:
        results[rank] = json.loads((out / f"rank-{rank}.json").read_text())
        assert not [s for s in results[rank]["saves"] if s[2]], results[rank]["saves"]
    return results


def one(results: Mapping[int, Mapping[str, Any]], key: str) -> Any:
    values = {json.dumps(r[key]) for r in results.values()}
    assert len(values) == 1, {rank: r[key] for rank, r in results.items()}
    return json.loads(values.pop())


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The full state at the end of a 2-rank FSDP2 run never interrupted."""
    results = run_job(tmp_path_factory.mktemp("reference"), "ref", 2)
    return str(one(results, "full_sha256"))


def test_fsdp2_resume_from_ram_is_bit_exact(tmp_path: Path, fsdp_reference: str) -> None:
    first = run_job(tmp_path, "first", 2, stop_at=13)
    # Every rank keeps its own shards: each writes durable storage too, not rank 0 alone.
    for rank in range(2):
        assert fmt.committed_steps(tmp_path / "ram" / f"node-{rank}", rank) == [
            5,
            10,
        ]  # two: a state in pieces
        assert fmt.committed_steps(tmp_path / "durable", rank) == [10]
    assert one(first, "final_step") == 13
    second = run_job(tmp_path, "second", 2)
    assert {(r["restored"], r["tier"]) for r in second.values()} == {(10, "ram")}
    assert {rank: r["sources"] for rank, r in second.items()} == {
        0: {"0": "ram"},
        1: {"1": "ram"},
    }
    assert one(second, "samples_seen") == STEPS * 8
    assert one(second, "full_sha256") == fsdp_reference


def test_no_step_every_rank_can_load_starts_as_fresh_as_a_run_never_interrupted(
    tmp_path: Path, fsdp_reference: str
) -> None:
    """Rank 1's shards are gone from every tier, rank 0's are there: listing them reads a
    state dict, which makes AdamW's state; starting from step 0 must find it fresh."""
    run_job(tmp_path, "first", 2, stop_at=13)
    shutil.rmtree(tmp_path / "ram" / "node-1")
    for step in fmt.committed_steps(tmp_path / "durable", 1):
        fmt.remove_step(tmp_path / "durable", step, 1)
    assert fmt.committed_steps(tmp_path / "durable", 0) == [10]
    second = run_job(tmp_path, "second", 2)
    assert {r["restored"] for r in second.values()} == {0}
    assert one(second, "full_sha256") == fsdp_reference


def test_a_committed_step_is_a_standard_dcp_checkpoint(tmp_path: Path) -> None:
    run_job(tmp_path, "first", 2, stop_at=10)
    step = fmt.step_dir(tmp_path / "durable", 10)
    assert (step / global_view.METADATA).is_file()  # published by the last rank to commit
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 8)
    )
    state = {"model": model.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=str(step))  # no process group, no package of ours
    assert state["step"] == 10
    out = tmp_path / "full.pt"
    dcp_to_torch_save(str(step), str(out))
    full = torch.load(out, weights_only=False)
    assert full["step"] == 10
    for key, tensor in state["model"].items():
        assert full["model"][key].shape == tensor.shape  # whole tensors, not one shard
        assert torch.equal(full["model"][key], tensor)
    # A step whose last rank never published (an emergency save) is merged after.
    ram_step = fmt.step_dir(tmp_path / "ram" / "node-1", 10)
    assert not (ram_step / global_view.METADATA).exists()  # rank 0's half is elsewhere
    merged = tmp_path / "merged" / "step-0000000010"
    merged.mkdir(parents=True)
    for rank in range(2):
        shutil.copytree(
            fmt.rank_dir(tmp_path / "ram" / f"node-{rank}", 10, rank), merged / f"rank-{rank}"
        )
    assert global_view.consolidate(merged) == [0, 1]
    again = {"model": model.state_dict()}
    dcp.load(again, checkpoint_id=str(merged))
    assert all(torch.equal(again["model"][k], v) for k, v in state["model"].items())


def test_fsdp2_reshards_from_4_ranks_to_2_and_back(tmp_path: Path) -> None:
    shutil.rmtree(tmp_path / "ram", ignore_errors=True)
    four = run_job(tmp_path, "four", 4, stop_at=10)
    saved = one(four, "full_sha256")
    two = run_job(tmp_path, "two", 2, stop_at=STEPS)
    assert one(two, "restored") == 10
    assert one(two, "restored_sha256") == saved  # the same full tensors, resharded
    # Rank 1 of 2 holds what ranks 2 and 3 of 4 held: it reads their files.
    assert set(two[1]["sources"]) >= {"2", "3"}
    again = run_job(tmp_path, "again", 4, steps=30, stop_at=STEPS)
    assert one(again, "restored") == STEPS
    assert one(again, "restored_sha256") == one(two, "full_sha256")


def test_hsdp_reshards_from_2x2_to_1x2_and_back(tmp_path: Path) -> None:
    hsdp = {"JOB_PARALLELISM": "hsdp"}
    four = run_job(tmp_path, "four", 4, stop_at=10, env=hsdp)
    two = run_job(tmp_path, "two", 2, stop_at=STEPS, env={**hsdp, "JOB_REPLICAS": "1"})
    assert one(two, "restored") == 10
    assert one(two, "restored_sha256") == one(four, "full_sha256")
    again = run_job(tmp_path, "again", 4, steps=30, stop_at=STEPS, env=hsdp)
    assert one(again, "restored") == STEPS
    assert one(again, "restored_sha256") == one(two, "full_sha256")


def test_hsdp_shard_lost_with_its_node_is_read_from_the_other_replica(tmp_path: Path) -> None:
    hsdp = {"JOB_PARALLELISM": "hsdp"}
    first = run_job(tmp_path, "first", 4, stop_at=12, env=hsdp)
    # Rank 1's node is gone with its RAM, and its durable copy with it: rank 3 (the same
    # shard, in the other replica group) still has that shard.
    shutil.rmtree(tmp_path / "ram" / "node-1")
    shutil.rmtree(fmt.rank_dir(tmp_path / "durable", 10, 1))
    second = run_job(tmp_path, "second", 4, stop_at=12, env=hsdp)
    assert one(second, "restored") == 10
    assert second[1]["sources"] == {"0": "durable", "3": "durable"}
    assert second[0]["tier"] == "ram"
    # Not the state at step 12 (RAM keeps step 10), but step 10's: rerun to 12 and compare.
    assert one(second, "full_sha256") == one(first, "full_sha256")


def test_a_corrupted_shard_is_read_from_another_tier(tmp_path: Path, fsdp_reference: str) -> None:
    run_job(tmp_path, "first", 2, stop_at=12)
    second = resume_with_rank_1s_ram_copy_damaged(tmp_path)
    assert one(second, "full_sha256") == fsdp_reference


def resume_with_rank_1s_ram_copy_damaged(
    tmp_path: Path, env: Mapping[str, str] | None = None
) -> dict[int, dict[str, Any]]:
    """Damage rank 1's RAM copy of step 10, then run the job again: rank 1 reads its
    shards from durable storage, rank 0 from its RAM. The second run's results."""
    shard = fmt.rank_dir(tmp_path / "ram" / "node-1", 10, 1) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    second = run_job(tmp_path, "second", 2, env=env)
    assert one(second, "restored") == 10
    assert second[1]["sources"] == {"1": "durable"}
    assert second[0]["sources"] == {"0": "ram"}
    return second


@pytest.fixture
def monitors(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with peer_monitors(tmp_path) as found:
        yield found


def test_fsdp_rank_on_an_empty_spare_reads_its_shard_from_the_partners_copy(
    tmp_path: Path, fsdp_reference: str, monitors: dict[str, Any]
) -> None:
    """No durable tier: a lost node's shard exists only in its partner's copy (real host
    monitors, the peer tier on). The spare that takes its rank fetches it; both ranks
    agree on that step and the run ends as one never interrupted."""
    second = resume_on_an_empty_spare(tmp_path, monitors)
    assert one(second, "full_sha256") == fsdp_reference


def resume_on_an_empty_spare(
    tmp_path: Path, monitors: dict[str, Any], env: Mapping[str, str] | None = None
) -> dict[int, dict[str, Any]]:
    """Run the job on node-a and node-b with no durable tier, then again with node-b's
    rank on the spare node-s: it reads its shards from node-b's copy on its partner. The
    second run's results."""
    ram_only = {**(env or {}), "S3_CHECKPOINTING_FREQ": "0"}
    placed = on_nodes(tmp_path, monitors, ["node-a", "node-b"])
    run_job(tmp_path, "first", 2, stop_at=17, env=ram_only, **placed)
    wait_pushed(monitors, "node-b", 1, 15)
    moved = on_nodes(tmp_path, monitors, ["node-a", "node-s"])  # node-b is gone
    second = run_job(tmp_path, "second", 2, env=ram_only, **moved)
    assert one(second, "restored") == 15
    assert second[1]["sources"] == {"1": "peer"}
    assert second[0]["sources"] == {"0": "ram"}
    return second


def test_tensor_parallel_resumes_bit_exactly_and_reshards_from_2_ranks_to_4(
    tmp_path: Path,
) -> None:
    """Tensor parallel (column-wise then row-wise Linear: shards along both dimensions)."""
    tp = {"JOB_PARALLELISM": "tp"}
    reference = one(run_job(tmp_path / "ref", "ref", 2, env=tp), "full_sha256")
    run_job(tmp_path, "first", 2, stop_at=13, env=tp)
    second = run_job(tmp_path, "second", 2, env=tp)
    assert {(r["restored"], r["tier"]) for r in second.values()} == {(10, "ram")}
    assert one(second, "full_sha256") == reference
    shutil.rmtree(tmp_path / "ram")
    four = run_job(tmp_path, "four", 4, steps=30, stop_at=STEPS, env=tp)
    assert one(four, "restored") == STEPS
    assert one(four, "restored_sha256") == reference  # the same full tensors, resharded


def test_a_load_reads_only_the_rank_directories_its_plan_needs(tmp_path: Path) -> None:
    """Which saving ranks' files DCP's plan reads, from their metadata alone: a rank in the
    layout it saved with needs its own directory only (a bucket's others stay where they
    are); items every rank wrote come from the rank given first."""
    from torch.distributed.checkpoint import save

    dirs = {rank: tmp_path / f"rank-{rank}" for rank in (0, 1)}
    save({"a": torch.zeros(4), "step": 7}, checkpoint_id=str(dirs[0]), no_dist=True)
    save({"b": torch.ones(4), "step": 7}, checkpoint_id=str(dirs[1]), no_dist=True)
    a, b = {"a": torch.empty(4)}, {"b": torch.empty(4)}
    assert global_view.ranks_read(dirs, 0, a) == {0}
    assert global_view.ranks_read(dirs, 1, b) == {1}
    assert global_view.ranks_read(dirs, 0, {**a, **b}) == {0, 1}
    assert global_view.ranks_read(dirs, 1, {"step": 0}) == {1}
    assert global_view.ranks_read(dirs, 0, {**b, "step": 0}) == {0, 1}
