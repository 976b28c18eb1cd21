"""FSDP1 (`FullyShardedDataParallel`, its sharded state dict) through the checkpoint tiers.

Each rank a process on gloo (tests/torch_jobs/sharded_job.py), as in
tests/test_sharded_checkpoint.py: without a device mesh FSDP1's state dict holds
ShardedTensors, with one DTensors. Its state dict is a collective that returns copies, so
every rank reads it together (saves, restores), and an emergency save, which must not
need a collective, stands on the newest periodic save and says so when there is none.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.test_checkpoint_tiers import peer_monitors  # noqa: E402
from tests.test_sharded_checkpoint import (  # noqa: E402
    STEPS,
    one,
    resume_on_an_empty_spare,
    resume_with_rank_1s_ram_copy_damaged,
    run_job,
)
from training.checkpoint import format as fmt  # noqa: E402
from training.checkpoint import global_view  # noqa: E402

LAYOUTS = [
    pytest.param({"JOB_PARALLELISM": "fsdp1"}, id="sharded-tensors"),
    pytest.param({"JOB_PARALLELISM": "fsdp1-mesh"}, id="dtensors"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp1_resumes_bit_exactly_and_a_corrupt_shard_is_read_from_durable(
    tmp_path: Path, layout: dict[str, str]
) -> None:
    reference = one(run_job(tmp_path / "reference", "ref", 2, env=layout), "full_sha256")
    first = run_job(tmp_path, "first", 2, stop_at=13, env=layout)
    for rank in range(2):  # each rank saved its own shards
        assert fmt.committed_steps(tmp_path / "ram" / f"node-{rank}", rank) == [5, 10]
        assert fmt.committed_steps(tmp_path / "durable", rank) == [10]
    assert one(first, "final_step") == 13
    # Rank 1's RAM copy is damaged: it reads durable storage while rank 0 reads its RAM,
    # and both then apply the step together (a collective for FSDP1).
    second = resume_with_rank_1s_ram_copy_damaged(tmp_path, layout)
    assert one(second, "full_sha256") == reference


def test_fsdp1_reshards_from_4_ranks_to_2_and_is_a_standard_dcp_checkpoint(
    tmp_path: Path,
) -> None:
    layout = {"JOB_PARALLELISM": "fsdp1"}
    four = run_job(tmp_path, "four", 4, stop_at=10, env=layout)
    shutil.rmtree(tmp_path / "ram")  # from durable storage, where every rank's shards are
    two = run_job(tmp_path, "two", 2, stop_at=STEPS, env=layout)
    assert one(two, "restored") == 10
    assert one(two, "restored_sha256") == one(four, "full_sha256")  # the same, resharded
    assert set(two[1]["sources"]) >= {"2", "3"}
    # The committed step is one DCP checkpoint that DCP itself reads whole.
    step = fmt.step_dir(tmp_path / "durable", 10)
    assert (step / global_view.METADATA).is_file()
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 8)
    )
    state = {"model": model.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=str(step))
    assert state["step"] == 10
    assert all(tensor.abs().sum() > 0 for tensor in state["model"].values())


def test_fsdp1_emergency_save_stands_on_the_newest_periodic_save(tmp_path: Path) -> None:
    layout = {"JOB_PARALLELISM": "fsdp1"}
    # Saved every 5 steps: step 13's state cannot be taken without a collective.
    sparse = run_job(
        tmp_path / "sparse", "run", 2, stop_at=13, env={**layout, "JOB_EMERGENCY_AT": "13"}
    )
    for result in sparse.values():
        assert "FSDP1 makes its state dict with a collective" in result["emergency"], result
        assert "in_memory_checkpointing_freq=1" in result["emergency"]
    # Saved to RAM every step: the emergency save is the last completed step, at once.
    every = {**layout, "JOB_EMERGENCY_AT": "13", "IN_MEMORY_CHECKPOINTING_FREQ": "1"}
    dense = run_job(tmp_path / "dense", "run", 2, stop_at=13, env=every)
    assert one(dense, "emergency") == 13
    for rank in range(2):
        assert 13 in fmt.committed_steps(tmp_path / "dense" / "durable", rank)


@pytest.fixture
def monitors(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with peer_monitors(tmp_path) as found:
        yield found


def test_fsdp1_rank_on_an_empty_spare_reads_its_shard_from_the_partners_copy(
    tmp_path: Path, monitors: dict[str, Any]
) -> None:
    """No durable tier, real host monitors with the peer tier: the spare that takes a lost
    node's rank fetches its shards from the partner's copy."""
    layout = {"JOB_PARALLELISM": "fsdp1"}
    reference = one(run_job(tmp_path / "reference", "ref", 2, env=layout), "full_sha256")
    second = resume_on_an_empty_spare(tmp_path, monitors, layout)
    assert one(second, "full_sha256") == reference
