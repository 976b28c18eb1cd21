"""The PyTorch workload: DDP on gloo, resumed bit-exactly from its tiers.

Its ranks are forked with torchrun's environment (tests/forked_ranks.py): what is checked
is the workload, resumed; torchrun itself starts the user's scripts and the README's
example elsewhere (tests/test_run_cli.py, tests/test_checkpoint_tiers.py), and here each
of its runs started a launcher and every rank as new interpreters, each importing torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.forked_ranks import log_path, start_rank, torchrun_env, wait_all
from tests.test_worker_client import free_port
from tests.timing import scaled

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"D_MODEL": "64", "N_LAYERS": "2", "N_HEADS": "4", "SEQ_LEN": "32", "TOTAL_STEPS": "30"}


@dataclass(frozen=True)
class Run:
    codes: list[int]  # each rank's exit code, in rank order
    stdout: str  # the ranks' logs, in rank order

    @property
    def ok(self) -> bool:
        return self.codes == [0] * len(self.codes)


def run_ranks(tmp: Path, name: str, nproc: int = 2, **env: str) -> Run:
    """The workload's `nproc` ranks on this machine, with the environment torchrun gives
    them, run to their end."""
    base = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))},
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "CHECKPOINT_RAM_DIR": str(tmp / "ram"),
        "CHECKPOINT_DURABLE_DIR": str(tmp / "durable"),
        "IN_MEMORY_CHECKPOINTING_FREQ": "5",
        "S3_CHECKPOINTING_FREQ": "10",
        "OUTPUT_DIR": str(tmp / name),
        **SMALL,
        **env,
    }
    tmp.mkdir(parents=True, exist_ok=True)
    ranks = [
        start_rank("training.torch_workload", {**base, **own}, log_path(tmp / "logs", rank))
        for rank, own in enumerate(torchrun_env(nproc, free_port()))
    ]
    codes = wait_all(ranks, scaled(300))
    return Run(codes, "".join(rank.output() for rank in ranks))


def test_an_interrupted_run_resumes_to_bit_identical_weights(tmp_path: Path) -> None:
    """Over 4 ranks, where a floating-point sum of the gradients changes with its order
    (which DDP's bucket layout sets, and lays out again after each wrapping's first step).
    (Two ranks resume the same way in the test of a smaller world below.)"""
    nproc = 4
    whole = run_ranks(tmp_path / "whole", "out", nproc)
    assert whole.ok, whole.stdout
    reference = (tmp_path / "whole" / "out" / "weights.sha256").read_text()
    first = run_ranks(tmp_path / "cut", "out", nproc, STOP_AFTER_STEP="17")
    assert first.ok, first.stdout
    assert not (tmp_path / "cut" / "out" / "weights.sha256").exists()
    second = run_ranks(tmp_path / "cut", "out", nproc)
    assert second.ok, second.stdout
    for rank in range(nproc):
        resumed = f"rank={rank}: start attempt=0 world_size={nproc}: resumed step=15 tier=ram"
        assert resumed in second.stdout
    assert (tmp_path / "cut" / "out" / "weights.sha256").read_text() == reference


def test_bad_settings_exit_2_naming_the_setting(tmp_path: Path) -> None:
    done = run_ranks(tmp_path, "out", D_MODEL="30")
    assert done.codes == [2, 2], done.stdout
    assert done.stdout.count("D_MODEL=30 must be a multiple of N_HEADS=4") == 2, done.stdout


def test_a_world_smaller_than_the_jobs_trains_on_every_batch_of_a_step(tmp_path: Path) -> None:
    """The job of 2 replicas goes on with 1 (no spare) and grows back to 2: with
    DATA_REPLICAS=2, the one rank left trains each step on both replicas' batches
    (training/torch_workload/elastic.py), and the weights are those of a run on 2 ranks
    throughout."""
    whole = run_ranks(tmp_path / "whole", "out", 2)
    assert whole.ok, whole.stdout
    reference = (tmp_path / "whole" / "out" / "weights.sha256").read_text()
    cut = tmp_path / "cut"
    resumed = {}
    for nproc, stop in ((2, "17"), (1, "24"), (2, "")):
        done = run_ranks(cut, "out", nproc, STOP_AFTER_STEP=stop, DATA_REPLICAS="2")
        assert done.ok, done.stdout
        resumed[nproc] = done.stdout
    assert "world_size=1: resumed step=15" in resumed[1]
    assert "world_size=2: resumed step=20" in resumed[2]
    assert (cut / "out" / "weights.sha256").read_text() == reference


SAY_MANY = """
import sys
from training.torch_workload.config import TorchWorkloadConfig
from training.torch_workload.train import say
cfg = TorchWorkloadConfig(rank=int(sys.argv[1]), world_size=2)
sys.stdin.readline()  # both ranks start writing together
for i in range(3000):
    say(cfg, f"line {i} resumed step={i} tier=memory")
"""


def test_ranks_sharing_an_unbuffered_log_write_whole_lines(tmp_path: Path) -> None:
    """A pod's ranks run `python -u` and share its log file (opened for appending): each
    line the workload says is one write, never interleaved with another rank's."""
    log = tmp_path / "pod.log"
    with log.open("ab") as out:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-u", "-c", SAY_MANY, str(rank)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.PIPE,
                cwd=ROOT,
            )
            for rank in (0, 1)
        ]
        for proc in ranks:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.close()
        for proc in ranks:
            assert proc.wait(120) == 0, proc.stderr.read() if proc.stderr else ""
    lines = log.read_text().splitlines()
    expected = {
        f"torch workload rank={rank}: line {i} resumed step={i} tier=memory"
        for rank in (0, 1)
        for i in range(3000)
    }
    assert len(lines) == len(expected)
    assert set(lines) == expected, [line for line in lines if line not in expected][:5]
