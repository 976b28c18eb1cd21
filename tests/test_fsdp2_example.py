"""The FSDP2 example of docs/training.md as a user runs it: saved as `train.py`, started
with `supervisor run --nnodes 2 --spares 1`, a fault injected through the supervisor's API
mid-training (a crashed rank, then a lost node). Every rank resumes from a checkpoint and the
job ends (exit 0) with final weights equal, tensor for tensor, to those of the same script
run without a fault under torchrun, run once for the module."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_run_user_job import Run, saved_example, user_env

#: A pause per step, so that the fault lands mid-run, and the weights' file from the
#: environment, so that the runs of the module do not share one.
EDITS = {
    "import os\n": "import os\nimport time\n",
    "    data.batches += 1\n": "    data.batches += 1\n"
    '    time.sleep(float(os.environ["STEP_TIME_S"]))\n',
    '"final.pt"': 'os.environ["WEIGHTS_FILE"]',
}


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


def test_the_fsdp2_example_is_healed_twice_to_the_weights_of_a_run_without_the_fault(
    tmp_path: Path, reference: Path
) -> None:
    """2 nodes x 1 rank and a spare: rank 1 crashes at step 20 or so (its node's worker
    restarted), then, past step 60, its node is lost (swapped for the spare). One run
    for both faults: each start of torch's processes costs tens of seconds here."""
    fsdp2_example(tmp_path)
    weights = tmp_path / "weights.pt"
    args = ["--nnodes", "2", "--spares", "1", "train.py"]
    run = Run(tmp_path, args, user_env(tmp_path, STEP_TIME_S="0.05", WEIGHTS_FILE=str(weights)))
    try:
        run.wait_step(20)
        run.api("POST", "/api/v1/faults", kind="worker_crash", node="node-1", rank=1)
        run.wait_step(60)
        run.api("POST", "/api/v1/faults", kind="node_down", node="node-1")
        code = run.finish()
    finally:
        run.kill()
    output = "\n".join(run.lines)
    assert code == 0, output
    assert "[supervisor]: restart_in_place node-1 succeeded" in output, output
    assert "[supervisor]: hot_swap node-1 succeeded" in output, output
    # Every rank started three times, resuming its shards from a checkpoint each time,
    # never from the beginning (which would end with the same weights: the data depends
    # only on the step and the rank).
    for rank in range(2):
        found = re.findall(rf"\[rank{rank}\]: rank {rank}: starting after step (\d+)", output)
        resumed = [int(step) for step in found]
        assert len(resumed) == 3 and resumed[0] == 0 < resumed[1] < resumed[2], output
    assert_same_weights(weights, reference)
