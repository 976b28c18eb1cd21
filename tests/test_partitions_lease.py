"""A rank cut off from the supervisor stops itself (training/monitor_link/lease.py), on
hosts with a network of their own (tests/netns.py), the local cluster's NumPy job.

node-1's host monitor frozen (SIGSTOP), or node-1 cut from the supervisor by the
network: its rank's lease (`HOST_LEASE_S`, shorter here than the supervisor's
`heartbeat_timeout_s`, so that the rank still trains with the survivor when it runs out)
runs out, its durable saves from then on are refused (every other step saves one), it exits with
LEASE_EXIT_CODE within a report interval, and nothing of its after the lease is in the
durable tier. The supervisor swaps the node out; the new world's restore is untouched:
every rank resumes from one step, and the final weights are a fault-free run's.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.local.demo import LocalDemo
from tests.netns import Network, unavailable
from tests.test_local_cluster import (
    assert_same_weights,
    demos,
    finished_actions,
    output,
    reference_weights,
    resumed_steps,
    wait_for,
)
from tests.test_partitions import NODES, STEPS, node_status, trained_and_heard
from tests.timing import scaled
from training.worker_client import LEASE_EXIT_CODE

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

#: The rank's lease, and the supervisor's heartbeat timeout: longer, so that the lease
#: runs out while the cut-off rank still trains in lock-step with the survivor (and
#: tries its durable saves), before the supervisor swaps its node out.
LEASE_S = 1.5
HEARTBEAT_TIMEOUT_S = 4.0
#: The worker client's report interval (its default): the lease's exit comes this late.
REPORT_INTERVAL_S = 0.5
REFUSED = re.compile(r"checkpoint refused step=(\d+) tier=durable: HostLeaseExpired")
SAVED = re.compile(r"checkpoint saved step=(\d+) tier=durable")


@pytest.fixture
def net() -> Iterator[Network]:
    with Network() as network:
        for name in ("supervisor", *NODES):
            network.add_host(name)
        yield network


@pytest.fixture
def start_demo(tmp_path: Path, net: Network) -> Iterator[Callable[..., LocalDemo]]:
    hosts = {name: (h.exec_args(), h.address) for name, h in net.hosts.items()}
    options = {
        "hosts": hosts,
        "total_steps": STEPS["numpy"],
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        # A durable save every other step, 0.1 s a step: several fall in the half second
        # between the lease's end and the exit. (Every step, the checkpoint reports kept
        # the worker client's thread from its progress reports under load.)
        "step_time_s": 0.1,
        "in_memory_checkpointing_freq": 2,
        "s3_checkpointing_freq": 2,
        "workload_env": {"HOST_LEASE_S": str(LEASE_S)},
    }
    for start in demos(tmp_path, "numpy"):
        yield functools.partial(start, **options)


def monitor_pid(demo: LocalDemo, node: str) -> int:
    return demo.monitors[node].pid


def exit_status(demo: LocalDemo, node: str, pid: int, frozen: bool, within: float) -> int | None:
    """The worker's exit status: a zombie's (field 52 of its stat) while its host monitor
    is frozen, else as its host monitor reports it."""
    deadline = time.monotonic() + scaled(within)
    while time.monotonic() < deadline:
        if frozen:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                return int(stat[49]) >> 8
        else:
            for w in node_status(demo, node)["workers"]:
                if (w["host_pid"] or w["pid"]) == pid and w["exit_code"] is not None:
                    return int(w["exit_code"])
        time.sleep(0.05)
    return None


def rank_log(demo: LocalDemo, node: str) -> str:
    return "".join(
        p.read_text(errors="replace") for p in sorted((demo.run_dir / "nodes" / node).glob("*.log"))
    )


@pytest.mark.parametrize("cut", ["frozen_host_monitor", "network"])
def test_a_cut_off_rank_refuses_durable_saves_and_exits_within_its_lease(
    start_demo: Callable[..., LocalDemo], net: Network, tmp_path: Path, cut: str
) -> None:
    expected = reference_weights(tmp_path, 2, 1, STEPS["numpy"], "numpy")
    demo = start_demo()
    wait_for(lambda: trained_and_heard(demo), within=120, what="step 20, every node heard")
    victim = NODES[1]
    # The lease is armed by the first progress report answered once the supervisor took
    # the node's heartbeats: a few report intervals after it is heard.
    wait_for(lambda: demo.api(f"/api/v1/nodes/{victim}")["alive"], what=f"{victim} heard")
    time.sleep(scaled(3 * REPORT_INTERVAL_S))
    (worker,) = [w for w in node_status(demo, victim)["workers"] if w["state"] == "running"]
    pid = worker["host_pid"] or worker["pid"]
    frozen = cut == "frozen_host_monitor"
    cut_at = time.monotonic()
    if frozen:
        os.kill(monitor_pid(demo, victim), signal.SIGSTOP)
    else:
        net.drop(victim, "supervisor", "both")
    try:
        status = exit_status(demo, victim, pid, frozen, within=LEASE_S + 20)
        ended = time.monotonic()
        actions = wait_for(lambda: finished_actions(demo, 2), within=120, what="the hot-swap")
    finally:
        if frozen:  # after the swap: the node comes back to a newer world
            os.kill(monitor_pid(demo, victim), signal.SIGCONT)
    assert status == LEASE_EXIT_CODE, (status, rank_log(demo, victim)[-2000:])
    # Within the lease and a report interval of the cut (with the machine's margin).
    assert ended - cut_at <= LEASE_S + REPORT_INTERVAL_S + scaled(3), ended - cut_at
    # It tried durable saves once its lease ran out: refused, and none committed after
    # (the old process's part of its log: the first the host monitor started).
    text = rank_log(demo, victim).split("=== host-monitor: start")[1]
    refused = [(m.start(), int(m[1])) for m in REFUSED.finditer(text)]
    assert refused, text[-2000:]
    first = refused[0][0]
    assert not SAVED.search(text, first), text[first:][:2000]
    types = [(a["type"], a["status"]) for a in actions]
    assert types == [("emergency_checkpoint", "succeeded"), ("hot_swap", "succeeded")], actions
    weights = wait_for(lambda: output(demo), within=300, what="the job to finish")
    assert_same_weights(weights, expected)
    resumes = {step for step, _ in resumed_steps(demo)}
    assert len(resumes) == 1, resumes
    if not frozen:
        net.heal(victim)
