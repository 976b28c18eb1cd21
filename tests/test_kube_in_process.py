"""A PyTorch JobSet that heals in-process, end to end on the Kubernetes backend, on the real
control plane (tests/control_plane.py) with real processes: `supervisor serve` (the
Kubernetes backend as the chart's ServiceAccount, the default policy, SQLite), the real
JobSet, Job and node lifecycle controllers and scheduler, a real host monitor per node
with the peer checkpoint tier on, and the chart's example PyTorch JobSet
(helm/.../jobset-pytorch.yaml: annotated to heal in-process, its Jobs replacing a lost pod
alone) whose pods the test kubelet runs as `python -m training.torch_workload` (DDP on
gloo, 2 ranks): tests/kube_real_in_process.py.

A node dies, or a worker crashes: only that pod is replaced; the surviving pod keeps its
process and its state and meets the replacement in a new world that the supervisor hands
both through their host monitors; the JobSet is never restarted, and the final weights
are bit-identical to a run without the fault. The host monitors are told their
checkpoint partners from the pods' placement, so a replacement restores from the peer
copy when no emergency checkpoint was taken.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.kube import objects as o
from supervisor.local.ports import free_port
from tests.control_plane import ControlPlane, Identity
from tests.kube_real_fixtures import REPO, started, tags, wait_for
from tests.kube_real_in_process import TOTAL_STEPS, RealInProcess, training
from tests.test_torch_emergency import SMALL, fault_free_weights

pytest.importorskip("torch")

INDEX = o.JS + "job-index"
RESUMED = re.compile(r"rank=(\d+): start attempt=(\d+) world_size=2: resumed step=(\d+) tier=(\w+)")
RESUMED_4 = re.compile(
    r"rank=(\d+): start attempt=(\d+) world_size=4: resumed step=(\d+) tier=(\w+)"
)

NO_EMERGENCY_POLICY = """
from policies.default import DefaultPolicy


class WithoutEmergencyCheckpoints(DefaultPolicy):
    emergency_checkpoints = False
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fault_free_weights(tmp_path_factory.mktemp("reference"), TOTAL_STEPS)


@pytest.fixture
def plane(control_plane: ControlPlane, kube_supervisor: Identity) -> tuple[ControlPlane, Identity]:
    """The session's control plane and the chart's ServiceAccount on it."""
    return control_plane, kube_supervisor


def running(
    plane: tuple[ControlPlane, Identity], tmp: Path, **kw: Any
) -> contextlib.AbstractContextManager[RealInProcess]:
    return started(RealInProcess(*plane, tmp, f"ip{next(tags)}", **kw))


def test_a_lost_node_is_replaced_alone_and_the_survivor_keeps_its_process(
    plane: tuple[ControlPlane, Identity], tmp_path: Path, reference: str
) -> None:
    """gpu of rank 0 dies. The supervisor saves the survivor's step (emergency
    checkpoint) and hot-swaps the node in-process: its pod alone is replaced, on a spare;
    the survivor's pod and process stay, and it trains on from the step it holds (tier
    memory) while the replacement loads it; the JobSet never restarts."""
    with running(plane, tmp_path) as env:
        pods = training(env, past=30)
        lost, survivor = pods[0], pods[1]
        lost_node, survivor_node = lost["spec"]["nodeName"], survivor["spec"]["nodeName"]
        survivor_pid = env.process(survivor)
        assert survivor_pid is not None
        # Partners from the placement: each node keeps the other's copies.
        wait_for(lambda: env.partner(lost_node) == survivor_node, 20, "partners told")
        assert env.partner(survivor_node) == lost_node

        env.node_dies(lost_node)
        weights = wait_for(env.weights, 300, "the job to finish")
        assert weights == reference

        actions = wait_for(env.settled, 30, "actions settled")
        swaps = [a for a in actions if a["type"] == "hot_swap"]
        assert len(swaps) == 1, actions
        (swap,) = swaps
        assert swap["status"] == "succeeded", swap
        assert swap["result"]["path"] == "in_process", swap["result"]
        assert swap["result"]["world"] == 1
        assert [a["type"] for a in actions if a["type"].startswith("restart")] == [], actions

        # The survivor: the same pod, the same process, in world 1 from memory.
        log = env.log_of(survivor)
        starts = RESUMED.findall(log)
        assert [(r, a, t) for r, a, _, t in starts] == [("1", "1", "memory")], log[-3000:]
        assert "rank=1: start attempt=0 world_size=2: starting from step=0" in log
        assert env.restarts() == 0
        replacement = [
            p
            for p in env.all_pods()
            if p["metadata"]["labels"][INDEX] == "0"
            and p["metadata"]["uid"] != lost["metadata"]["uid"]
        ]
        assert len(replacement) == 1, replacement
        assert replacement[0]["spec"]["nodeName"] not in (lost_node, survivor_node)
        resumed = RESUMED.findall(env.log_of(replacement[0]))
        ((rank, attempt, step, tier),) = resumed
        assert (rank, attempt) == ("0", "1") and tier in ("durable", "peer", "ram")
        assert int(step) == int(starts[0][2])
        # The survivor's copies now go to the replacement's node.
        assert env.partner(survivor_node) == replacement[0]["spec"]["nodeName"]


def test_a_replacement_that_ends_before_its_world_forms_restarts_the_jobset_at_once(
    plane: tuple[ControlPlane, Identity], tmp_path: Path, reference: str
) -> None:
    """The replacement of a lost node's pod fails as it starts (here: the new world's
    rendezvous port is taken on its node, as another program may take it): that world
    can no longer form, since the rank's next pod joins only the next one. The heal falls
    back to restarting the JobSet at once, saying why, instead of waiting out
    in_process_restart_timeout_s (100 s here); the job still ends exact."""
    with running(plane, tmp_path) as env:
        pods = training(env, past=30)
        lost = pods[0]
        base = next(
            int(e["value"])
            for e in lost["spec"]["containers"][0]["env"]
            if e["name"] == "MASTER_PORT"
        )
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", base + 1))  # world 1's store, which rank 0 hosts
            env.node_dies(lost["spec"]["nodeName"])

            def replacement_failed() -> bool:
                return any(
                    p["metadata"]["labels"][INDEX] == "0"
                    and p["metadata"]["uid"] != lost["metadata"]["uid"]
                    and p["status"].get("phase") == "Failed"
                    for p in env.all_pods()
                )

            def fell_back() -> bool:
                # The failed pod may be gone before a poll sees it (the JobSet's restart
                # deletes it, quickly on an idle machine): the swap's fallback says it too.
                return any(
                    a["type"] == "hot_swap" and "in_process_error" in (a.get("result") or {})
                    for a in env.actions()
                )

            try:
                wait_for(
                    lambda: replacement_failed() or fell_back(),
                    120,
                    "the replacement failing on the taken port",
                )
            except AssertionError as exc:
                phases = [(p["metadata"]["name"], p["status"].get("phase")) for p in env.all_pods()]
                raise AssertionError(
                    f"{exc}\nactions: {env.actions()}\npods: {phases}\nlogs: {env.logs()[-6000:]}"
                ) from None
        weights = wait_for(env.weights, 300, "the job to finish")
        assert weights == reference
        actions = wait_for(env.settled, 30, "actions settled")
        swaps = [a for a in actions if a["type"] == "hot_swap"]
        assert [a["status"] for a in swaps] == ["succeeded"], actions
        result = swaps[0]["result"]
        assert result["path"] == "full_restart", result
        assert "of world 1 ended before ranks" in result["in_process_error"], result


def test_without_an_emergency_checkpoint_the_replacement_restores_from_its_peer_copy(
    plane: tuple[ControlPlane, Identity], tmp_path: Path, reference: str
) -> None:
    """No emergency checkpoint (a policy without them): the newest step both ranks can
    load is the last RAM save; the replacement on a spare, with an empty RAM tier, takes
    its rank's copy from its partner's host monitor (the survivor's node), not from
    durable storage."""
    with running(plane, tmp_path, policy=NO_EMERGENCY_POLICY) as env:
        pods = training(env, past=65)  # past a durable save (50) and later RAM saves
        lost_node = pods[0]["spec"]["nodeName"]
        wait_for(lambda: env.partner(pods[1]["spec"]["nodeName"]) == lost_node, 20, "partners")
        env.node_dies(lost_node)
        weights = wait_for(env.weights, 300, "the job to finish")
        assert weights == reference
        resumed = {
            (rank, tier): int(step) for rank, attempt, step, tier in RESUMED.findall(env.logs())
        }
        peer_steps = [s for (rank, tier), s in resumed.items() if rank == "0" and tier == "peer"]
        assert peer_steps and peer_steps[0] > 50 and peer_steps[0] % 10 == 0, resumed


def four_rank_weights(tmp: Path) -> str:
    """The weights of a 4-rank run without a fault, its ranks started by the pods'
    launcher (one pod of four ranks, no host monitor)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_"))}
    env = {
        **base,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "CHECKPOINT_RAM_DIR": str(tmp / "ram"),
        "S3_CHECKPOINTING_FREQ": "0",
        "TOTAL_STEPS": str(TOTAL_STEPS),
        "OUTPUT_DIR": str(tmp / "out"),
        **SMALL,
    }
    launcher = [sys.executable, "-m", "training.pod_launch", "--nproc-per-node", "4"]
    done = subprocess.run(
        [*launcher, "-m", "training.torch_workload"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return (tmp / "out" / "weights.sha256").read_text()


def test_pods_of_two_ranks_heal_in_process_after_a_crashed_rank_then_a_lost_node(
    plane: tuple[ControlPlane, Identity], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The example with a pod per node running two ranks each (training.pod_launch), world
    size 4. Rank 3's process is SIGKILLed: its launcher ends rank 2, the pod is replaced
    alone, and the ranks of the other pod keep their processes (restart in place,
    in-process, world 1). Then the node of ranks 0 and 1 dies: its pod is replaced on a
    spare, and the replacement pod's two ranks keep theirs (hot swap, in-process, world 2).
    The JobSet never restarts, and the weights are those of a 4-rank run without a fault."""
    reference = four_rank_weights(tmp_path_factory.mktemp("reference-4"))
    with running(plane, tmp_path_factory.mktemp("pods-of-two"), nproc=2) as env:
        pods = training(env, past=30)
        first = env.rank_processes(pods[0])
        assert sorted(first) == [0, 1], first
        crashed = env.rank_processes(pods[1])
        assert sorted(crashed) == [2, 3], crashed
        os.kill(crashed[3], signal.SIGKILL)

        def healed(kind: str) -> dict[str, Any] | None:
            done = [a for a in env.actions() if a["type"] == kind and a["status"] == "succeeded"]
            return done[0] if done else None

        restart = wait_for(lambda: healed("restart_in_place"), 150, "restart in place")
        assert restart["result"]["path"] == "in_process", restart["result"]
        assert restart["result"]["world"] == 1
        # The crashed pod's Job (its only pod) was recreated, not left to replace the pod
        # after its pod-failure backoff.
        crashed_job = pods[1]["metadata"]["ownerReferences"][0]
        assert restart["result"]["recreated_jobs"] == [crashed_job["name"]], restart["result"]
        # Ranks 0 and 1: the same processes, in world 1.
        assert env.rank_processes(pods[0]) == first
        replacement = wait_for(
            lambda: next(
                (
                    p
                    for i, p in env.ranks().items()
                    if i == 1 and p["metadata"]["uid"] != pods[1]["metadata"]["uid"]
                ),
                None,
            ),
            60,
            "the replacement of the crashed rank's pod",
        )
        wait_for(
            lambda: sorted(env.rank_processes(replacement)) == [2, 3],
            60,
            "the replacement's ranks",
        )
        assert replacement["metadata"]["ownerReferences"][0]["uid"] != crashed_job["uid"]

        def resumed_in(pod: dict[str, Any], attempt: str) -> dict[str, str]:
            found = RESUMED_4.findall(env.log_of(pod))
            return {r: t for r, a, _, t in found if a == attempt}

        # The survivors resume from their memory once world 1 formed (the host monitors
        # count a rank in a world from when it takes it).
        wait_for(lambda: len(resumed_in(pods[0], "1")) == 2, 30, "world 1")
        # From memory, or from their own RAM tier for a rank that had finished a step more
        # than the others when rank 3 died (gloo's allreduce ends on each rank in turn):
        # never from a peer or the durable tier.
        sources = resumed_in(pods[0], "1")
        assert set(sources.values()) <= {"memory", "ram"}, sources
        past = env.step() + 10
        wait_for(lambda: env.step() >= past, 90, f"step {past} in world 1")

        env.node_dies(pods[0]["spec"]["nodeName"])
        weights = wait_for(env.weights, 300, "the job to finish")
        assert weights == reference
        actions = wait_for(env.settled, 30, "actions settled")
        swaps = [a for a in actions if a["type"] == "hot_swap"]
        assert len(swaps) == 1 and swaps[0]["status"] == "succeeded", actions
        assert swaps[0]["result"]["path"] == "in_process", swaps[0]["result"]
        assert swaps[0]["result"]["world"] == 2
        lost_job = pods[0]["metadata"]["ownerReferences"][0]["name"]
        assert swaps[0]["result"]["recreated_jobs"] == [lost_job], swaps[0]["result"]
        assert [a for a in actions if a["type"] == "restart_workload"] == [], actions
        # One remedy for the crash: its exit is one event, and no later restart answers it
        # again (one may answer another worker's failure: on this 2-core machine a rank can
        # be starved past its heartbeat timeout while eight processes train).
        events = {e["id"]: e for e in env.events()}
        seen = (actions, list(events.values()))
        exits = [e for e in events.values() if (e.get("details") or {}).get("pid") == crashed[3]]
        assert [e["type"] for e in exits] == ["worker_exited"], seen
        restarts = [a for a in actions if a["type"] == "restart_in_place"]
        assert restarts[0]["id"] == restart["id"], seen
        for later in restarts[1:]:
            trigger = events.get(later["event_id"]) or {}
            assert (trigger.get("details") or {}).get("pid") not in crashed.values(), seen
        # Ranks 2 and 3 kept their processes through the second heal: they resumed world 2
        # from the state in their memory, or from their node's RAM tier for a rank a step
        # behind the other when the node died mid-allreduce (as in world 1).
        second = resumed_in(replacement, "2")
        assert set(second) == {"2", "3"} and set(second.values()) <= {"memory", "ram"}, second
        assert "memory" in second.values(), second
        assert env.restarts() == 0


class TwoNodes(RealInProcess):
    """The cluster without a spare, with scaling on: a lost node is scaled away."""

    def supervisor_env(self) -> dict[str, str]:
        return {**super().supervisor_env(), "SUPERVISOR_ENABLE_WORKLOAD_SCALING": "true"}


def test_pods_of_two_ranks_scale_down_to_one_pod_when_no_spare_is_left(
    plane: tuple[ControlPlane, Identity], tmp_path: Path
) -> None:
    """Two pods of two ranks, no spare. The node of ranks 0 and 1 dies: the survivors save
    the step they hold, and the JobSet is scaled down to one replica, whose pod runs two
    ranks in a world of 2 (the world size follows the replicas times the ranks per pod)
    and resumes from that step: none is lost."""
    with started(TwoNodes(*plane, tmp_path, f"ip{next(tags)}", nproc=2, count=2)) as env:
        pods = training(env, past=30)
        held = env.step()
        env.node_dies(pods[0]["spec"]["nodeName"])

        def scaled() -> dict[str, Any] | None:
            done = [a for a in env.actions() if a["type"] == "scale_down"]
            return done[0] if done and done[0]["status"] == "succeeded" else None

        wait_for(scaled, 150, "the scale down")

        def both_resumed() -> list[tuple[str, int]] | None:
            # Both ranks' lines, not the first one written: the two ranks log apart.
            found = [
                (rank, int(step))
                for rank, _, step, _ in re.findall(
                    r"rank=(\d+): start attempt=(\d+) world_size=2: resumed step=(\d+) "
                    r"tier=(\w+)",
                    env.logs(),
                )
            ]
            return found if len({rank for rank, _ in found}) >= 2 else None

        resumed = wait_for(both_resumed, 120, "two ranks resumed in a world of 2")
        assert sorted(rank for rank, _ in resumed) == ["0", "1"], resumed
        assert min(step for _, step in resumed) >= held, (resumed, held)
        wait_for(env.weights, 300, "the job to finish")
        js = env.jobset_now()
        assert js["spec"]["replicatedJobs"][0]["replicas"] == 1
