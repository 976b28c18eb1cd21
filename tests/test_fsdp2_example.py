"""The FSDP2 example of docs/training.md as a user runs it: saved as `train.py`, started
with `supervisor run --nnodes 2 --spares 1`, three faults injected through the supervisor's
API while both ranks are held at a point of a step (a crashed rank, a lost node, a crashed
rank). Every rank resumes from a checkpoint and the job ends (exit 0) with final weights
equal, tensor for tensor, to those of the same script run without a fault under torchrun,
run once for the module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.step_points import EDITS as POINT_EDITS
from tests.step_points import FaultAt, assert_saved_and_resumed, env_of, inject_at_points
from tests.test_run_user_job import Run, saved_example, user_env

#: The points of a step where the test holds the ranks (tests/step_points.py), and the
#: weights' file from the environment, so that the runs of the module do not share one.
EDITS = {**POINT_EDITS, '"final.pt"': 'os.environ["WEIGHTS_FILE"]'}


def fsdp2_example(tmp: Path) -> Path:
    return saved_example(tmp, "# example: fsdp2", EDITS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The final weights of the example's 2 ranks under torchrun, without a fault."""
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("reference")
    script = fsdp2_example(tmp)
    weights = tmp / "reference.pt"
    env = user_env(
        tmp,
        STEP_TIME_S="0",
        WEIGHTS_FILE=str(weights),
        CHECKPOINT_RAM_DIR=str(tmp / "ram"),
        CHECKPOINT_DURABLE_DIR=str(tmp / "durable"),
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*command, "--nproc-per-node", "2", str(script)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return weights


def assert_same_weights(got: Path, want: Path) -> None:
    import torch

    mine = torch.load(got, weights_only=True)
    theirs = torch.load(want, weights_only=True)
    assert sorted(mine) == sorted(theirs)
    differ = [name for name in theirs if not torch.equal(mine[name], theirs[name])]
    assert not differ, f"weights differ from the run without a fault: {differ}"


#: The survivor saves the step it holds; the rank that failed has its own shards only
#: at the RAM tier's steps (every 10; the lost node's from its partner's peer copy), so
#: every rank resumes from the newest of those: never more than the RAM interval back.
FSDP2_FAULTS = [
    FaultAt(23, "before", {"kind": "worker_crash", "node": "node-1", "rank": 1},
            "restart_in_place node-1", (0,), 22),
    FaultAt(47, "inside", {"kind": "node_down", "node": "node-1"}, "hot_swap node-1", (0,), 47),
    FaultAt(74, "after", {"kind": "worker_crash", "node": "node-0", "rank": 0},
            "restart_in_place node-0", (1,), 74),
]  # fmt: skip


def test_the_fsdp2_example_is_healed_from_faults_at_every_point_of_a_step_to_exact_weights(
    tmp_path: Path, reference: Path
) -> None:
    """2 nodes x 1 rank and a spare, three faults injected through the API while both ranks
    are held at a point of a step (tests/step_points.py): rank 1 crashed before the
    optimizer's step, its node lost inside it (swapped for the spare), rank 0 crashed after
    it. One run for the three: each start of torch's processes costs tens of seconds
    here."""
    fsdp2_example(tmp_path)
    weights = tmp_path / "weights.pt"
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    extra = {"STEP_TIME_S": "0.02", "WEIGHTS_FILE": str(weights), **env_of(pauses, FSDP2_FAULTS)}
    args = ["--nnodes", "2", "--spares", "1", "train.py"]
    run = Run(tmp_path, args, user_env(tmp_path, **extra))
    try:
        inject_at_points(run, pauses, FSDP2_FAULTS, ranks=2)
        code = run.finish()
    finally:
        run.kill()
    output = "\n".join(run.lines)
    assert code == 0, output
    assert_saved_and_resumed(output, FSDP2_FAULTS, 2, [20, 40, 70])
    assert_same_weights(weights, reference)
