"""The FSDP2 example of docs/training.md as a user runs it: saved as `train.py`, started
with `supervisor run --nnodes 2 --spares 3`, a lost node and a crashed rank injected through
the supervisor's API at each point of a step while both ranks are held there. Every rank
resumes from a checkpoint and the job ends (exit 0) with final weights
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


#: Each kind of fault at each point of a step (three lost nodes: three spares). The
#: survivor saves the step it holds; the rank that failed has its own shards only at the
#: RAM tier's steps (every 10; a lost node's from its partner's peer copy), so every rank
#: resumes from the newest of those: never more than the RAM interval back.
FSDP2_FAULTS = [
    FaultAt(13, "before", "node_down", 1, (0,), 12),
    FaultAt(27, "inside", "worker_crash", 0, (1,), 27),
    FaultAt(44, "after", "node_down", 0, (1,), 44),
    FaultAt(58, "before", "worker_crash", 1, (0,), 57),
    FaultAt(73, "inside", "node_down", 1, (0,), 73),
    FaultAt(88, "after", "worker_crash", 0, (1,), 88),
]


def test_the_fsdp2_example_is_healed_from_faults_at_every_point_of_a_step_to_exact_weights(
    tmp_path: Path, reference: Path
) -> None:
    """2 nodes x 1 rank and 3 spares, a lost node and a crashed rank injected through the
    API at each point of a step while both ranks are held there (tests/step_points.py).
    One run for the six: each start of torch's processes costs seconds here."""
    fsdp2_example(tmp_path)
    weights = tmp_path / "weights.pt"
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    extra = {"STEP_TIME_S": "0.02", "WEIGHTS_FILE": str(weights), **env_of(pauses, FSDP2_FAULTS)}
    args = ["--nnodes", "2", "--spares", "3", "train.py"]
    run = Run(tmp_path, args, user_env(tmp_path, **extra))
    try:
        remedies = inject_at_points(run, pauses, FSDP2_FAULTS, ranks=2)
        code = run.finish()
    finally:
        run.kill()
    output = "\n".join(run.lines)
    assert code == 0, output
    assert all(line in output for line in remedies), remedies
    assert_saved_and_resumed(output, FSDP2_FAULTS, 2, [f.step // 10 * 10 for f in FSDP2_FAULTS])
    assert_same_weights(weights, reference)
