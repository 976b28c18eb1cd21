"""A DDP job of the user's own (the example of docs/training.md) stopped and resumed over
3 and 4 ranks ends with the weights of a run that never stopped, bit for bit, whatever it
does between `optimizer.step()` and `step_done`. Without the bucket layout kept across
the resume (training/checkpoint/ddp_order.py), the first step after it sums the
gradients in another order and the weights differ.

The ranks are forked with torchrun's environment (tests/forked_ranks.py): what is checked
is the script, resumed; torchrun itself starts the user's scripts elsewhere
(tests/test_run_cli.py, tests/test_checkpoint_tiers.py), and here each of the three runs
started a launcher and every rank as new interpreters, each importing torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.forked_ranks import log_path, start_script, torchrun_env, wait_all
from tests.test_run_user_job import WEIGHTS_OUT, saved_example, user_env
from tests.test_worker_client import free_port
from tests.timing import scaled

pytest.importorskip("torch")

#: After its step_done, a rank stops at STOP_AFTER (its RAM save committed), as a job
#: that loses every process at once; a busy pause between the optimizer and step_done.
EDITS = {
    "import os\n": "import hashlib\nimport os\nimport time\n",
    "    data.batches += 1\n": "    data.batches += 1\n    time.sleep(0.002)\n",
    "    ckpt.step_done(step)  # saves when a tier is due; returns once the state is copied\n": (
        "    ckpt.step_done(step)\n"
        '    if step == int(os.environ.get("STOP_AFTER", "0")):\n'
        "        ckpt.close()\n"
        "        os._exit(0)\n"
    ),
    "ckpt.close()  # reports": WEIGHTS_OUT + "  # reports",
}


def run(tmp: Path, script: Path, nproc: int, tiers: str, **env: str) -> str:
    """The script's `nproc` ranks, with the environment `torchrun --standalone` gives them,
    run to their end: the hash of the final weights, or the ranks' output without one."""
    weights = tmp / f"{tiers}.sha256"
    environment = user_env(
        tmp,
        WEIGHTS_FILE=str(weights),
        CHECKPOINT_RAM_DIR=str(tmp / tiers / "ram"),
        CHECKPOINT_DURABLE_DIR=str(tmp / tiers / "durable"),
        **env,
    )
    ranks = [
        start_script(script, {**environment, **own}, log_path(tmp / "logs" / tiers, rank))
        for rank, own in enumerate(torchrun_env(nproc, free_port()))
    ]
    codes = wait_all(ranks, scaled(150))
    output = "".join(rank.output() for rank in ranks)
    assert codes == [0] * nproc, output
    return weights.read_text() if weights.exists() else output


@pytest.mark.parametrize("nproc", [3])
def test_a_resumed_ddp_job_ends_with_the_weights_of_one_that_never_stopped(
    tmp_path: Path, nproc: int
) -> None:
    script = saved_example(tmp_path, "# example: checkpoint tiers", EDITS)
    want = run(tmp_path, script, nproc, "uninterrupted")
    stopped = run(tmp_path, script, nproc, "resumed", STOP_AFTER="40")
    assert "starting after step 0" in stopped
    assert not (tmp_path / "resumed.sha256").exists()
    got = run(tmp_path, script, nproc, "resumed")
    assert got == want, "the resumed run's weights differ from the uninterrupted run's"
