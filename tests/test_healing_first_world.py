"""`InProcessHealing` with WORLD_WAIT_S: the first world comes from the host monitor.

As in the pods of a JobSet that heals in-process: a user's script, two ranks started
without MASTER_ADDR or MASTER_PORT, each registering with its POD_UID to a real host
monitor; the test assigns each pod its world as the Kubernetes backend does (POST
/v1/workers/world with the actuator's token), and the ranks join it and all-reduce.
A rank that no world reaches within WORLD_WAIT_S ends with `NoNewWorld`, saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_host_monitor import WORKER_TOKEN, Agent, Cluster
from tests.test_worker_client import free_port
from tests.timing import scaled

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
JOB = "pretrain"

SCRIPT = """\
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from training.healing import InProcessHealing
from training.worker_client import WorkerClient

client = WorkerClient.from_env()
timeout = os.environ.get("COLLECTIVE_TIMEOUT_S")
healing = InProcessHealing(
    client, backend="gloo", timeout=timeout and timedelta(seconds=float(timeout))
)
for world in healing.worlds():
    with world.train():
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        print(json.dumps({"attempt": world.attempt, "rank": dist.get_rank(),
                          "size": dist.get_world_size(), "sum": total.item()}), flush=True)
dist.destroy_process_group()
client.close()
"""


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    cluster = Cluster(tmp_path)
    try:
        yield cluster.start_agent(None, node="gpu-3")
    finally:
        cluster.teardown()


def start_rank(
    tmp: Path, agent: Agent, rank: int, wait_s: float, **extra: str
) -> subprocess.Popen[str]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MASTER_", "HOST_MONITOR_", "WORKLOAD_", "WORLD_"))
    }
    env.update(
        PYTHONPATH=str(ROOT),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
        HOST_MONITOR_URL=agent.url,
        HOST_MONITOR_WORKER_TOKEN=WORKER_TOKEN,
        HOST_MONITOR_JOB=JOB,
        POD_UID=f"pod-{rank}",
        WORLD_WAIT_S=str(wait_s),
        **extra,
    )
    return subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assign(agent: Agent, rank: int, world: dict[str, str]) -> None:
    """The world of `rank`'s pod, as the Kubernetes backend hands it."""
    body = {
        "request_id": f"world-4-rank-{rank}",
        "job": JOB,
        "rank": rank,
        "instance": f"pod-{rank}",
        "attempt": "4",
        "env": world,
    }
    r = agent.api.post("/v1/workers/world", json=body)
    assert r.status_code == 200, r.text


def world_of_two() -> dict[str, str]:
    port = str(free_port())
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "WORLD_SIZE": "2",
        "WORKLOAD_ATTEMPT": "4",
    }


def said_by(ranks: list[subprocess.Popen[str]]) -> list[dict[str, object]]:
    said = []
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        said.append(json.loads(out.strip().splitlines()[-1]))
    return said


def test_each_pod_joins_the_world_the_supervisor_assigns_it(tmp_path: Path, agent: Agent) -> None:
    ranks = [start_rank(tmp_path, agent, rank, 60) for rank in (0, 1)]
    world = world_of_two()
    for rank in (0, 1):
        assign(agent, rank, world)
    assert said_by(ranks) == [
        {"attempt": "4", "rank": 0, "size": 2, "sum": 3.0},
        {"attempt": "4", "rank": 1, "size": 2, "sum": 3.0},
    ]


def test_a_pod_no_world_reaches_ends_saying_so(tmp_path: Path, agent: Agent) -> None:
    proc = start_rank(tmp_path, agent, 1, 1.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and not out
    assert "NoNewWorld: rank 1: no world assigned within WORLD_WAIT_S=1.5s" in err, err


def test_rank_0_waits_for_a_late_rank_past_its_collectives_timeout(
    tmp_path: Path, agent: Agent
) -> None:
    """Collectives time out after 2 s, but rank 0 waits for its world's other rank as
    long as it waits for a world (WORLD_WAIT_S): a replacement joins after its process
    started and imported torch, which a short collective timeout did not allow for (rank
    0's store gave up on it, and the heal fell back to a full restart)."""
    ranks = [start_rank(tmp_path, agent, rank, 60, COLLECTIVE_TIMEOUT_S="2") for rank in (0, 1)]
    world = world_of_two()
    assign(agent, 0, world)
    address = (world["MASTER_ADDR"], int(world["MASTER_PORT"]))
    deadline = time.monotonic() + scaled(60)
    while True:  # rank 0's store listens: it waits for rank 1 from now on
        assert ranks[0].poll() is None, ranks[0].communicate()[1]
        assert time.monotonic() < deadline, "rank 0 never opened its store"
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=1.0):
            break
        time.sleep(0.05)
    time.sleep(6.0)  # three times the collectives' timeout: rank 1 is late
    assign(agent, 1, world)
    assert [(s["rank"], s["sum"]) for s in said_by(ranks)] == [(0, 3.0), (1, 3.0)]
