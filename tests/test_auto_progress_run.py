"""A plain DDP script, which imports nothing of this project, under the real `supervisor
run` (2 nodes x 1 rank): its optimizer steps are its progress (training.auto_progress), so
that a rank frozen with SIGSTOP is detected as hung within the hang timeout and healed,
and the run ends with exit code 0. Without the automatic count the job reports no step,
and only exits are watched."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_run_user_job import Run, user_env
from tests.timing import scaled

#: Nothing of this project: torch only, as a user writes it for torchrun.
DDP_SCRIPT = """\
import os, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {rank}: attempt {attempt}", flush=True)
for step in range(int(os.environ["STEPS"])):
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    if attempt == 0:  # paced until the freeze; the healed attempt runs to its end at once
        time.sleep(float(os.environ["STEP_TIME_S"]))
dist.destroy_process_group()
print(f"rank {rank}: done", flush=True)
"""
#: The product's timeouts, scaled with the machine's margins: they are short only so that
#: the test sees the freeze soon, and a loaded machine (CI: four sessions on two cores)
#: left a healed rank over 3 s between its last optimizer step and its exit, which a
#: 3 s worker heartbeat timeout took for a second hang.
HANG_TIMEOUT_S = scaled(4.0)
WORKER_HEARTBEAT_TIMEOUT_S = scaled(3.0)
#: What detecting the frozen rank may take besides: the heartbeats' periods, the sensor's.
SLACK_S = scaled(6.0)


def detections(run: Run) -> list[dict[str, Any]]:
    """The job's hang events, and its workers' lost heartbeats (a frozen worker's own
    reports stop: the host monitor says so first)."""
    query = "/api/v1/events?type=hang&type=worker_heartbeat_lost&job=job"
    items: list[dict[str, Any]] = run.api("GET", query)["items"]
    return items


def test_a_frozen_rank_of_a_plain_ddp_script_is_detected_and_healed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text(DDP_SCRIPT)
    args = ["--nnodes", "2", "--nproc-per-node", "1"]
    args += ["--heartbeat-timeout-s", f"{WORKER_HEARTBEAT_TIMEOUT_S:g}"]
    args += ["--set", f"hang_timeout_s={HANG_TIMEOUT_S:g}", "train.py"]
    # 30 s of training in the first attempt: the job starts first, the supervisor after
    # it, and on a loaded machine the supervisor took 10 s to be up, by when 150 steps had
    # all run.
    run = Run(tmp_path, args, user_env(tmp_path, STEPS="600", STEP_TIME_S="0.05"))
    frozen: int | None = None
    try:
        run.wait_step(20, within=90)
        assert detections(run) == []
        [worker] = run.api("GET", "/api/v1/nodes/node-1")["workers"]
        frozen = int(worker["pid"])
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while not (seen := detections(run)):
            assert time.monotonic() - stopped_at < HANG_TIMEOUT_S + SLACK_S, run.lines
            time.sleep(0.2)
        detected_after = time.monotonic() - stopped_at
        code = run.finish(180)
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)
        run.kill()
    output = "\n".join(run.lines)
    assert code == 0, output
    assert detected_after < HANG_TIMEOUT_S + SLACK_S
    assert {e["node"] for e in seen if e["type"] == "worker_heartbeat_lost"} <= {"node-1"}
    assert re.search(r"\[supervisor\]: \w+ node-1 succeeded", output), output
    # Healed: every rank started again, and this time ran to its end.
    for rank in range(2):
        attempts = re.findall(rf"\[rank{rank}\]: rank {rank}: attempt (\d+)", output)
        assert attempts == ["0", "1"], output
        assert f"[rank{rank}]: rank {rank}: done" in output
