"""Emergency checkpoints of the PyTorch workload, from ranks whose peer is gone.

Two ranks of `python -m training.torch_workload` (DDP on gloo), each registered with a
real host monitor of its own. One rank is SIGKILLed (its peer's collective raises) or
SIGSTOPped (its peer's collective hangs); the survivor's host monitor is asked for an
emergency checkpoint over HTTP, as the supervisor's actuator asks. The survivor must save
exactly its last completed step, without a collective, then stop promptly on SIGTERM;
a new world of two ranks resumes from that step (the replaced rank loads the survivor's
durable copy) and ends with weights bit-identical to a run without the fault.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.forked_ranks import RankProcess, log_path, start_rank
from tests.test_host_monitor import WORKER_TOKEN, Agent, Cluster, wait_for
from tests.test_run_user_job import docs_example
from tests.test_worker_client import free_port
from training.checkpoint import format as fmt

ROOT = Path(__file__).resolve().parent.parent
JOB = "torchjob"
SMALL = {"D_MODEL": "64", "N_LAYERS": "2", "N_HEADS": "4", "SEQ_LEN": "32"}
TOTAL = 60


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    (tmp_path / "monitors").mkdir()
    cluster = Cluster(tmp_path / "monitors")
    agents: dict[str, Agent] = {}
    try:
        for name in ("node-a", "node-b"):
            agents[name] = cluster.start_agent(
                None,
                node=name,
                initial_state="running",
                job=JOB,
                checkpoint_root=tmp_path / name / "ram",
                peer_store_dir=tmp_path / name / "peer",
            )
        yield agents
    finally:
        for agent in agents.values():
            agent.close()
            agent.proc.kill()
            agent.proc.wait(10)


def rank_env(tmp: Path, nodes: dict[str, Agent], rank: int, port: int) -> dict[str, str]:
    """What rank `rank` of two (node-a's, node-b's) starts with: registered with its node's
    host monitor, its RAM tier on that node, one durable tier for both."""
    node = ("node-a", "node-b")[rank]
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))},
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HOST_MONITOR_URL": nodes[node].url,
        "HOST_MONITOR_WORKER_TOKEN": WORKER_TOKEN,
        "HOST_MONITOR_JOB": JOB,
        "CHECKPOINT_RAM_DIR": str(tmp / node / "ram" / JOB),
        "CHECKPOINT_DURABLE_DIR": str(tmp / "durable"),
    }


def start_world(
    tmp: Path, nodes: dict[str, Agent], name: str, **env: str
) -> dict[int, RankProcess]:
    port = free_port()
    procs = {}
    for rank in (0, 1):
        full = {
            **rank_env(tmp, nodes, rank, port),
            "IN_MEMORY_CHECKPOINTING_FREQ": "10",
            "S3_CHECKPOINTING_FREQ": "20",
            "ENABLE_PEER_CKPT": "false",
            "SYNC_FILES": "false",
            "TOTAL_STEPS": str(TOTAL),
            "LOG_EVERY_STEPS": "1",
            "OUTPUT_DIR": str(tmp / name),
            **SMALL,
            **env,
        }
        procs[rank] = start_rank("training.torch_workload", full, tmp / f"{name}-rank-{rank}.log")
    return procs


def output(tmp: Path, name: str, rank: int) -> str:
    return (tmp / f"{name}-rank-{rank}.log").read_text()


def last_step(tmp: Path, name: str, rank: int) -> int:
    steps = re.findall(r"step=(\d+)/", output(tmp, name, rank))
    return int(steps[-1]) if steps else 0


def finish(procs: dict[int, RankProcess], tmp: Path, name: str) -> None:
    for rank, proc in procs.items():
        try:
            code = proc.wait(240)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert code == 0, f"rank {rank} exited {code}:\n{output(tmp, name, rank)}"


def fault_free_weights(tmp: Path, total_steps: int) -> str:
    """The weights of a run without a fault (same seed, same steps): two local ranks, no
    host monitor."""
    port = free_port()
    procs = {}
    for rank in (0, 1):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))},
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CHECKPOINT_RAM_DIR": str(tmp / f"ram-{rank}"),
            "S3_CHECKPOINTING_FREQ": "0",
            "TOTAL_STEPS": str(total_steps),
            "OUTPUT_DIR": str(tmp / "out"),
            **SMALL,
        }
        procs[rank] = start_rank("training.torch_workload", env, log_path(tmp / "out", rank))
    for proc in procs.values():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    return (tmp / "out" / "weights.sha256").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fault_free_weights(tmp_path_factory.mktemp("reference"), TOTAL)


def registered(agent: Agent, rank: int) -> bool:
    worker = agent.workers().get(rank)
    return bool(worker and worker.get("host_pid") and worker.get("step"))


def emergency_reports(agent: Agent, step: int) -> list[dict[str, Any]]:
    """The emergency saves of `step` the agent's workers reported."""
    r = agent.api.get("/v1/checkpoints")
    return [
        c["report"]
        for c in r.json()
        if c["report"]["tier"] == "emergency" and c["report"]["step"] == step
    ]


def emergency(agent: Agent, request_id: str, timeout_s: float = 30) -> dict[str, Any]:
    r = agent.api.post(
        "/v1/emergency-checkpoint",
        json={"request_id": request_id, "timeout_s": timeout_s},
        timeout=timeout_s + 10,
    )
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_survivor_saves_its_last_completed_step_and_the_job_resumes_bit_exactly(
    tmp_path: Path, nodes: dict[str, Agent], reference: str, fault: str
) -> None:
    procs = start_world(tmp_path, nodes, "first", STEP_TIME_S="0.05", PEER_LOSS_WAIT_S="60")
    try:
        wait_for(lambda: registered(nodes["node-a"], 0), 60, "rank 0 registered and training")
        # Past the periodic saves at 10 and 20, so the emergency one is newer than both.
        wait_for(lambda: last_step(tmp_path, "first", 0) >= 23, 120, "rank 0 at step 23")
        victim = procs[1]
        if fault == "sigkill":
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            # The survivor's collective raises; it holds its step for the checkpoint.
            wait_for(lambda: "holding step=" in output(tmp_path, "first", 0), 60, "holding")
        else:
            victim.send_signal(signal.SIGSTOP)
            time.sleep(1.0)  # rank 0 is now blocked in the all-reduce of the next step
        held = last_step(tmp_path, "first", 0)
        result = emergency(nodes["node-a"], f"ec-{fault}")
        ack = result["acked"]["0"]
        assert ack["ok"], result
        # Exactly the last completed step: nothing lost, nothing half-applied.
        assert ack["step"] == held, (ack, output(tmp_path, "first", 0))
        ram = tmp_path / "node-a" / "ram" / JOB
        assert fmt.committed_steps(ram, 0)[-1] == held
        assert held in fmt.committed_steps(tmp_path / "durable", 0)
        assert held not in fmt.committed_steps(tmp_path / "durable", 1)
        # Asked again with the same id: the same answer, no second save.
        assert emergency(nodes["node-a"], f"ec-{fault}")["acked"]["0"]["step"] == held
        # Stopped on SIGTERM promptly, although its main thread may sit in a collective.
        started = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(30) in (-signal.SIGTERM, 128 + signal.SIGTERM)
        stop_s = time.monotonic() - started
        assert stop_s < 20, stop_s
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
    # A new world: rank 0 from its own RAM, rank 1 (its RAM holds step 20) from rank 0's
    # durable copy of the emergency checkpoint, as the replacement of a lost node would.
    second = start_world(tmp_path, nodes, "second")
    finish(second, tmp_path, "second")
    for rank in (0, 1):
        assert f"resumed step={held}" in output(tmp_path, "second", rank)
    assert f"resumed step={held} tier=ram" in output(tmp_path, "second", 0)
    assert f"resumed step={held} tier=durable" in output(tmp_path, "second", 1)
    assert (tmp_path / "second" / "weights.sha256").read_text() == reference

    reported = partial(emergency_reports, nodes["node-a"], held)
    (report,) = wait_for(reported, 10, "the emergency save reported")
    assert report["bytes"] > 0


def test_a_rank_whose_collective_raised_saves_its_last_step_at_exit(
    tmp_path: Path, nodes: dict[str, Agent]
) -> None:
    """The DDP example of docs/training.md, unchanged but for a pause per step: its loop
    does not catch the error its all-reduce raises once the peer is SIGKILLed, so the rank
    exits before any emergency request can reach it. Its last completed step is saved on
    the way out, to both tiers, and reported."""
    script = docs_example(tmp_path)
    port = free_port()
    procs = {}
    for rank in (0, 1):
        env = {
            **rank_env(tmp_path, nodes, rank, port),
            "STEP_TIME_S": "0.05",
            "WEIGHTS_FILE": str(tmp_path / "weights.sha256"),
        }
        log = (tmp_path / f"exit-rank-{rank}.log").open("w")
        procs[rank] = subprocess.Popen(
            [sys.executable, str(script)], cwd=tmp_path, env=env, stdout=log, stderr=log
        )
    ram = tmp_path / "node-a" / "ram" / JOB
    try:
        wait_for(lambda: 10 in fmt.committed_steps(ram, 0), 120, "rank 0's RAM save of step 10")
        time.sleep(0.3)  # a few steps more: the step saved at exit is not a periodic one
        procs[1].send_signal(signal.SIGKILL)
        assert procs[0].wait(120) != 0, "the example does not catch its collective's error"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    out = (tmp_path / "exit-rank-0.log").read_text()
    saved = re.findall(
        r"emergency checkpoint at exit: the training loop raised after step (\d+)", out
    )
    assert len(saved) == 1, out
    step = int(saved[0])
    assert step > 10, out
    assert fmt.committed_steps(ram, 0)[-1] == step
    assert step in fmt.committed_steps(tmp_path / "durable", 0)

    wait_for(partial(emergency_reports, nodes["node-a"], step), 10, "the save at exit reported")


# --- one process: what an emergency save reads -------------------------------------------


def test_a_request_during_an_optimizer_step_waits_for_its_step_done(tmp_path: Path) -> None:
    import threading

    import torch

    from training.checkpoint import Checkpointer, CheckpointSettings
    from training.checkpoint.checkpointer import EmergencyCheckpointError
    from training.checkpoint.peer import PeerTier

    def make() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        settings = CheckpointSettings(
            in_memory_checkpointing_freq=100,
            s3_checkpointing_freq=0,
            ram_dir=tmp_path / "ram",
            sync_files=False,
            emergency_checkpoint_timeout_s=2.0,
        )
        peer = PeerTier(None, None, 0, fetch_timeout_s=1)
        ckpt = Checkpointer(model, optimizer, settings=settings, peer=peer, emergency=True)
        return model, optimizer, ckpt

    model, optimizer, ckpt = make()
    with pytest.raises(EmergencyCheckpointError, match="no completed step"):
        ckpt.emergency_save()  # before restore: there is no state to save yet
    assert ckpt.restore() == 0

    def forward_backward() -> None:
        model(torch.randn(4, 16)).sum().backward()

    forward_backward()
    optimizer.step()
    ckpt.step_done(1)
    # Step 2's optimizer.step() is held half way by a hook registered after the
    # Checkpointer's.
    in_step, release = threading.Event(), threading.Event()

    def hold(*_: Any) -> None:
        in_step.set()
        release.wait(30)

    optimizer.register_step_pre_hook(hold)
    at_step_2: dict[str, Any] = {}

    def step_2() -> None:
        forward_backward()
        optimizer.step()
        ckpt.step_done(2)
        at_step_2["params"] = [p.detach().clone() for p in model.parameters()]
        at_step_2["buffers"] = [b.detach().clone() for b in model.buffers()]
        at_step_2["rng"] = torch.get_rng_state()

    trainer = threading.Thread(target=step_2)
    trainer.start()
    assert in_step.wait(10)
    with pytest.raises(EmergencyCheckpointError, match="not saving half a step"):
        ckpt.emergency_save()
    assert fmt.committed_steps(tmp_path / "ram", 0) == []
    # Asked again while the step is held; the step then finishes: step 2 is saved, whole.
    result: dict[str, int] = {}
    saver = threading.Thread(target=lambda: result.setdefault("step", ckpt.emergency_save()))
    saver.start()
    time.sleep(0.2)
    assert "step" not in result
    release.set()
    trainer.join(30)
    saver.join(30)
    assert result == {"step": 2}
    # The next step's forward changes the RNG and BatchNorm's running statistics; a save
    # now still holds step 2's.
    forward_backward()
    assert not torch.equal(torch.get_rng_state(), at_step_2["rng"])
    assert ckpt.emergency_save() == 2
    ckpt.close()

    model2, _, ckpt2 = make()
    assert ckpt2.restore() == 2
    for got, want in zip(model2.parameters(), at_step_2["params"], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(model2.buffers(), at_step_2["buffers"], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), at_step_2["rng"])
    ckpt2.close()
