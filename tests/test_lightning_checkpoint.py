"""The checkpoint tiers in a PyTorch Lightning job (training.checkpoint.lightning).

Real Lightning Trainers (CPU; DDP on gloo with torchrun's environment), killed with
SIGKILL mid-step, then run again: each must resume from the newest step the tiers hold and
end with weights bit-identical to a run without the fault. An emergency save taken from
another thread while Lightning runs the backward inside `optimizer.step()` saves the last
completed step at once (no wait for the step in flight).

The job's processes are forked by a standby that imported Lightning
(tests/forked_ranks.py), as torchrun would have started them: a rank that fails stops the
others. Each of torchrun's launches started the launcher and every rank as new
interpreters, each importing torch and Lightning (about 5 s of CPU each); torchrun itself
starts users' scripts in tests/test_run_cli.py and tests/test_checkpoint_tiers.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from tests.forked_ranks import PRELOAD, log_path, start_script, torchrun_env
from tests.test_worker_client import free_port
from tests.timing import scaled
from training.checkpoint import CheckpointSettings
from training.checkpoint import format as fmt
from training.checkpoint.lightning import TieredCheckpointing

ROOT = Path(__file__).resolve().parent.parent
JOB_SCRIPT = ROOT / "tests" / "fixtures" / "lightning_job.py"
#: What the job imports: the standby that forks its processes imports it once.
LIGHTNING_PRELOAD = (*PRELOAD, "lightning.pytorch", "lightning.pytorch.strategies")
RESUMED = re.compile(r"rank=(\d+) resumed step=(\d+) tier=(\w+)")
TOTAL = 40


@dataclass(frozen=True)
class Finished:
    returncode: int  # the lowest failed rank's (a signal negative), else 0
    output: str  # every process's output, in rank order


def run_job(tmp: Path, ranks: int, output: str | None = None, **env: str) -> Finished:
    """The job on `ranks` processes (`python` for one, torchrun's environment for more),
    run to its end; as torchrun, the first process that fails stops the others."""
    shutil.rmtree(tmp / "resumed", ignore_errors=True)
    (tmp / "resumed").mkdir()
    full = {
        **os.environ,
        "RESUMED_DIR": str(tmp / "resumed"),
        "PYTHONPATH": str(ROOT),
        "CHECKPOINT_RAM_DIR": str(tmp / "ram"),
        "CHECKPOINT_DURABLE_DIR": str(tmp / "durable"),
        "IN_MEMORY_CHECKPOINTING_FREQ": "5",
        "S3_CHECKPOINTING_FREQ": "10",
        "TOTAL_STEPS": str(TOTAL),
        "BATCHES_PER_EPOCH": "8",
        **({"OUTPUT": str(tmp / output)} if output else {}),
        **env,
    }
    # One process: as `python job.py` (Lightning on one device); more: as torchrun's.
    ranks_env = torchrun_env(ranks, free_port()) if ranks > 1 else [{}]
    procs = [
        start_script(
            JOB_SCRIPT, {**full, **own}, log_path(tmp / "logs", rank), tmp, LIGHTNING_PRELOAD
        )
        for rank, own in enumerate(ranks_env)
    ]
    deadline = time.monotonic() + scaled(240)
    stopping = False
    try:
        while any(p.poll() is None for p in procs):
            # Once, as torchrun: a second SIGTERM may cut a rank's own handling of the first.
            if not stopping and any(p.poll() not in (None, 0) for p in procs):
                stopping = True
                for proc in procs:
                    proc.terminate()
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.kill()
    failed = [code for p in procs if (code := p.wait()) != 0]
    return Finished(failed[0] if failed else 0, "".join(p.output() for p in procs))


def resumed(tmp: Path) -> dict[int, tuple[int, str]]:
    """Where each rank of the last run in `tmp` resumed (as it recorded it)."""
    records = (path.read_text() for path in (tmp / "resumed").iterdir())
    found = (RESUMED.fullmatch(record) for record in records)
    return {int(m[1]): (int(m[2]), m[3]) for m in found if m}


@pytest.mark.parametrize(
    ("ranks", "data", "kill_at", "strategy"),
    [
        # A plain DataLoader: the tiers' step 16 is an epoch's end (8 batches an epoch).
        pytest.param(1, "plain", 17, "ddp", id="one-process-epoch-end"),
        # A loader that saves its position: exact in the middle of an epoch.
        pytest.param(1, "stateful", 22, "ddp", id="one-process-mid-epoch"),
        pytest.param(2, "stateful", 22, "ddp", id="ddp-two-ranks-mid-epoch"),
        # Lightning's ModelParallelStrategy, the module sharded with FSDP2.
        pytest.param(2, "stateful", 22, "fsdp2", id="fsdp2-two-ranks-mid-epoch"),
    ],
)
def test_a_killed_lightning_job_resumes_to_the_same_weights(
    tmp_path: Path, request: pytest.FixtureRequest, ranks: int, data: str, kill_at: int,
    strategy: str,
) -> None:  # fmt: skip
    freq = {"IN_MEMORY_CHECKPOINTING_FREQ": "8", "S3_CHECKPOINTING_FREQ": "16"}
    tiers = {**(freq if data == "plain" else {}), "STRATEGY": strategy}
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    if (ranks, data, strategy) == (1, "stateful", "ddp"):
        # The module's reference is this very run (the tiers' settings change no weight).
        expected = request.getfixturevalue("stateful_reference")
    else:
        expected = reference_weights(tmp_path / "reference", ranks, DATA=data, **tiers)

    killed = run_job(
        job_dir, ranks, DATA=data, KILL_AT_STEP=str(kill_at), KILL_RANK=str(ranks - 1), **tiers
    )
    assert killed.returncode != 0, "the job was meant to be killed"
    rerun = run_job(job_dir, ranks, "weights", DATA=data, **tiers)
    assert rerun.returncode == 0, rerun.output[-3000:]
    where = resumed(job_dir)
    assert set(where) == set(range(ranks)), rerun.output[-3000:]
    steps = {step for step, _ in where.values()}
    assert len(steps) == 1, where  # the ranks agreed
    (step,) = steps
    assert 0 < step <= kill_at
    assert {tier for _, tier in where.values()} <= {"ram", "durable"}
    assert (job_dir / "weights").read_text() == expected
    assert expected.startswith(f"{TOTAL} ")


def test_with_its_ram_tier_lost_the_job_resumes_from_durable(
    tmp_path: Path, stateful_reference: str
) -> None:
    killed = run_job(tmp_path, 1, DATA="stateful", KILL_AT_STEP="27")
    assert killed.returncode != 0
    shutil.rmtree(tmp_path / "ram")  # the node's RAM is gone (a reboot, a new node)
    rerun = run_job(tmp_path, 1, "weights", DATA="stateful")
    assert rerun.returncode == 0, rerun.output[-3000:]
    ((step, tier),) = resumed(tmp_path).values()
    assert tier == "durable" and step in (10, 20)
    assert (tmp_path / "weights").read_text() == stateful_reference


def reference_weights(tmp: Path, ranks: int, **env: str) -> str:
    """The weights of a run of `ranks` without a fault, which resumed from nothing."""
    tmp.mkdir()
    reference = run_job(tmp, ranks, "weights", **env)
    assert reference.returncode == 0, reference.output[-3000:]
    assert resumed(tmp) == dict.fromkeys(range(ranks), (0, "None")), reference.output[-3000:]
    return (tmp / "weights").read_text()


@pytest.fixture(scope="module")
def stateful_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The weights of one process with the resumable loader, run without a fault."""
    return reference_weights(tmp_path_factory.mktemp("reference") / "run", 1, DATA="stateful")


@pytest.mark.parametrize(
    ("point", "saved"),
    [("before", 22), ("inside", 23), ("after", 23)],
)
def test_an_emergency_save_at_each_point_of_a_step_resumes_to_the_same_weights(
    tmp_path: Path, stateful_reference: str, point: str, saved: int
) -> None:
    """An emergency save asked after global step 22, before the backward, inside the
    optimizer's step or after it (tests/fixtures/lightning_job.py's EMERGENCY_AT), then
    the process killed: the save holds step 22 (nothing of step 23 applied yet) or waits
    for step 23's end and holds it, never half of it, and the job run again resumes from
    it to the weights of a run without the fault."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    out = job_dir / "emergency"
    killed = run_job(
        job_dir, 1, DATA="stateful", EMERGENCY_AT=f"22:{point}", EMERGENCY_OUT=str(out)
    )
    assert killed.returncode == -signal.SIGKILL, killed.output[-3000:]
    assert out.read_text() == str(saved)
    rerun = run_job(job_dir, 1, "weights", DATA="stateful")
    assert rerun.returncode == 0, rerun.output[-3000:]
    assert resumed(job_dir) == {0: (saved, "ram")}
    assert (job_dir / "weights").read_text() == stateful_reference


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4
        )


class _EmergencyDuringBackward(Callback):
    """At step `at`, after the backward and before the parameter update (inside Lightning's
    `optimizer.step()`), asks for an emergency save from another thread and waits for it:
    with the update marked at `optimizer.step()`'s start it would wait for this step to
    finish, which waits for it."""

    def __init__(self, tiers: TieredCheckpointing, at: int) -> None:
        self.tiers, self.at = tiers, at
        self.saved: list[Any] = []

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self.at:
            return
        checkpointer = self.tiers.checkpointer
        assert checkpointer is not None

        def save() -> None:
            try:
                self.saved.append(checkpointer.emergency_save())
            except Exception as exc:  # reported below
                self.saved.append(exc)

        thread = threading.Thread(target=save)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the emergency save waited for the step in flight"


def test_an_emergency_save_during_lightnings_backward_saves_the_last_step(
    tmp_path: Path,
) -> None:
    settings = CheckpointSettings(
        ram_dir=str(tmp_path / "ram"),
        durable_dir=str(tmp_path / "durable"),
        in_memory_checkpointing_freq=100,
        s3_checkpointing_freq=100,
        emergency_checkpoint_timeout_s=60,
    )
    tiers = TieredCheckpointing(settings=settings, emergency=True)
    probe = _EmergencyDuringBackward(tiers, at=7)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=10,
        callbacks=[tiers, probe],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Tiny())
    assert probe.saved == [7]
    assert 7 in fmt.committed_steps(tmp_path / "ram", 0)
    assert 7 in fmt.committed_steps(tmp_path / "durable", 0)


def test_more_than_one_optimizer_is_refused_by_name(tmp_path: Path) -> None:
    class TwoOptimizers(_Tiny):
        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1)] * 2

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

    settings = CheckpointSettings(ram_dir=str(tmp_path / "ram"), durable_dir=str(tmp_path / "d"))
    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[TieredCheckpointing(settings=settings)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    model = TwoOptimizers()
    model.automatic_optimization = False
    with pytest.raises(ValueError, match="one optimizer; the module configures 2"):
        trainer.fit(model)
