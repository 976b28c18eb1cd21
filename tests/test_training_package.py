"""The training side stands alone: it imports neither the supervisor nor the host
monitor, the worker client needs no torch and no NumPy, and the service needs no NumPy.
What a training script imports comes from `training` itself, each name on first use."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import training

ROOT = Path(__file__).resolve().parent.parent


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_training_side_imports_nothing_of_the_service_or_the_agent() -> None:
    done = run(
        "import sys, training.worker_client, training.numpy_workload.train\n"
        "from training.checkpoint import Checkpointer\n"
        "from training.checkpoint.lightning import TieredCheckpointing\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('supervisor', 'host_monitor')]\n"
        "assert not bad, bad\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_worker_client_works_without_torch_and_numpy() -> None:
    done = run(
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['numpy'] = None  # as if not installed\n"
        "from training.worker_client import WorkerClient\n"
        "client = WorkerClient.from_env({'RANK': '3'})\n"
        "assert client.rank == 3 and not client.online and not client.register()\n"
        "client.report_step(5); client.close()\n"
        "from training.checkpoint import CheckpointSettings, format  # stdlib only\n"
        "CheckpointSettings(s3_checkpointing_freq=0)\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_service_and_the_agent_need_no_numpy_and_no_torch() -> None:
    done = run(
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "import supervisor.api.app, supervisor.cli, supervisor.local.demo, host_monitor.agent\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_checkpoint_tiers_need_no_lightning(tmp_path: Path) -> None:
    done = run(
        "import sys\n"
        "sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = None\n"
        "import torch\n"
        "from training.checkpoint import Checkpointer, CheckpointSettings\n"
        f"settings = CheckpointSettings(ram_dir={str(tmp_path)!r}, s3_checkpointing_freq=0)\n"
        "Checkpointer(torch.nn.Linear(2, 2), settings=settings).close()\n"
    )
    assert done.returncode == 0, done.stderr


def test_every_exported_name_is_the_object_of_its_home_module() -> None:
    for name in training.__all__:
        home = importlib.import_module(training._HOMES[name])
        assert getattr(training, name) is getattr(home, name), name
    assert sorted(training.__all__) == sorted(training._HOMES)


def test_an_unknown_name_is_refused_by_name() -> None:
    with pytest.raises(AttributeError, match="Checkpointr"):
        getattr(training, "Checkpointr")  # noqa: B009


def test_the_package_and_its_worker_client_import_no_torch() -> None:
    done = run(
        "import json, sys\n"
        "import training\n"
        "before = 'torch' in sys.modules\n"
        "from training import WorkerClient, CheckpointSettings\n"
        "print(json.dumps([before, 'torch' in sys.modules, 'numpy' in sys.modules]))\n"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [False, False, False]
