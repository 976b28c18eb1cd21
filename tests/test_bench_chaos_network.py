"""The chaos run's network faults (bench/chaos_network.py) on real network namespaces:
each kind cuts what it says while it lasts and heals after; the account gives each fault
the events of its node and the verdict on the job's actions of its window."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_judge import LATER_REMEDY_S
from bench.chaos_network import NetworkChaos, NetworkFault, unavailable
from supervisor.local.demo_options import DemoOptions

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PORT = 7711
#: How long each fault lasts: its probes, a Python process each started in a namespace,
#: all end within it on a loaded machine (at 2.5 s, probed one after the other, the last
#: one could see the fault healed: seen once in CI).
FAULT_S = 5.0
JOB = "chaos"
LISTEN = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64)\n"
    "while True: s.accept()[0].close()\n"
)
CONNECT = (
    "import socket, sys\n"
    "try: socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()\n"
    "except OSError: sys.exit(1)\n"
)


@pytest.fixture
def chaos() -> Iterator[NetworkChaos]:
    network = NetworkChaos(["node-0", "node-1"], 60.0, seed=1, durations_s=(FAULT_S, FAULT_S))
    try:
        for host in network.net.hosts.values():
            subprocess.Popen(
                [*host.exec_args(), sys.executable, "-c", LISTEN, host.address, str(PORT)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        yield network
    finally:
        network.close()  # kills the listeners too


def connect_args(chaos: NetworkChaos, source: str, target: str) -> list[str]:
    """A connection attempt from `source` to `target`'s listener (exit code 0: made)."""
    address = chaos.net.hosts[target].address
    return [*chaos.net.hosts[source].exec_args(), sys.executable, "-c", CONNECT, address, str(PORT)]


def reaches(chaos: NetworkChaos, source: str, target: str) -> bool:
    args = connect_args(chaos, source, target)
    return subprocess.run(args, capture_output=True, timeout=10).returncode == 0


#: How long a healed link may take to carry a first connection again, tried every 0.2 s
#: with a connection attempt that gives up after 0.5 s. Beside two CPU burners and the
#: suite, one attempt right after a cable was put back in failed once (why is not known:
#: its output was not kept; 12 flaps beside 4 to 6 burners here each connected within
#: 0.12 s). What a failed attempt said is now part of the failure.
HEALED_WITHIN_S = 10.0


def assert_healed(chaos: NetworkChaos, source: str, target: str) -> None:
    """`source` reaches `target` again within HEALED_WITHIN_S."""
    args = connect_args(chaos, source, target)
    deadline = time.monotonic() + HEALED_WITHIN_S
    tries = 0
    while (done := subprocess.run(args, capture_output=True, timeout=10)).returncode != 0:
        tries += 1
        assert time.monotonic() < deadline, (
            f"{source} did not reach {target} again in {tries} tries over "
            f"{HEALED_WITHIN_S:g}s; the last exited {done.returncode}: {done.stderr[-2000:]!r}"
        )
        time.sleep(0.2)


def probe(chaos: NetworkChaos, source: str, target: str) -> subprocess.Popen[bytes]:
    """A connection from `source` to `target`'s listener, under way (exit code 0: made)."""
    args = connect_args(chaos, source, target)
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def seen_during(chaos: NetworkChaos, kind: str, node: str) -> dict[str, bool]:
    """Who reaches whom 1 s into a fault of `kind` on `node` (it lasts FAULT_S), the three
    probed at once."""
    fault = threading.Thread(target=chaos.one, args=(kind, node))
    fault.start()
    time.sleep(1.0)
    started = time.monotonic()
    probes = {
        "supervisor->node": probe(chaos, "supervisor", node),
        "node->supervisor": probe(chaos, node, "supervisor"),
        "peer->node": probe(chaos, "node-1", node),
    }
    seen = {what: proc.wait(timeout=30) == 0 for what, proc in probes.items()}
    assert time.monotonic() - started < FAULT_S - 1.0, "the probes outlasted the fault"
    fault.join(timeout=30)
    return seen


def wait_until_listening(chaos: NetworkChaos) -> None:
    deadline = time.monotonic() + 20
    while not all(reaches(chaos, "supervisor", n) for n in ("node-0", "node-1")):
        assert time.monotonic() < deadline, "the listeners did not start"
        time.sleep(0.2)


def test_each_kind_cuts_what_it_says_then_heals(chaos: NetworkChaos) -> None:
    wait_until_listening(chaos)
    assert seen_during(chaos, "supervisor_cut", "node-0") == {
        "supervisor->node": False,
        "node->supervisor": False,
        "peer->node": True,  # the node trains on with its peers
    }
    assert_healed(chaos, "supervisor", "node-0")
    assert_healed(chaos, "node-0", "supervisor")
    assert seen_during(chaos, "link_down", "node-0") == {
        "supervisor->node": False,
        "node->supervisor": False,
        "peer->node": False,
    }
    assert_healed(chaos, "supervisor", "node-0")
    assert_healed(chaos, "node-1", "node-0")
    assert seen_during(chaos, "peer_cut", "node-0") == {
        "supervisor->node": True,  # the supervisor hears it: only its peers do not
        "node->supervisor": True,
        "peer->node": False,
    }
    assert_healed(chaos, "node-1", "node-0")
    assert_healed(chaos, "node-0", "node-1")
    [cut, down, peers] = chaos.faults
    assert (cut.kind, cut.node, down.kind, peers.kind) == (
        "supervisor_cut",
        "node-0",
        "link_down",
        "peer_cut",
    )
    assert cut.healed is not None and cut.healed - cut.started >= timedelta(seconds=FAULT_S - 0.1)


class Records:
    """What the account reads of the supervisor (`LocalDemo.api`), one page at a time."""

    def __init__(self, events: list[dict[str, Any]], actions: list[dict[str, Any]]) -> None:
        self.pages = {"/api/v1/events": events, "/api/v1/actions": actions}
        self.options = DemoOptions(run_dir=Path("/nonexistent"), job=JOB)

    def api(self, path: str, limit: int = 500, cursor: str | None = None) -> dict[str, Any]:
        items = self.pages[path]
        start = int(cursor or 0)
        more = start + limit < len(items)
        return {
            "items": items[start : start + limit],
            "next_cursor": str(start + limit) if more else None,
        }


def test_the_account_gives_each_fault_its_nodes_events_and_the_verdict_on_its_window(
    chaos: NetworkChaos,
) -> None:
    """A fault's actions are the job's taken while its node was cut or within AFTERMATH_S
    of the heal; they are judged as the supervisor's own faults' are: by the last remedy,
    or a later one of the same job soon after; a checkpoint that did not commit is listed
    apart and fails nothing."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def at_time(seconds: float) -> datetime:
        return t0 + timedelta(seconds=seconds)

    def at(seconds: float) -> str:
        return at_time(seconds).isoformat()

    chaos.faults = [
        NetworkFault("link_down", "node-0", t0, t0 + timedelta(seconds=5)),
        NetworkFault("flapping", "node-1", at_time(100), at_time(110)),
        NetworkFault("peer_cut", "node-2", at_time(200), at_time(205)),
        NetworkFault("supervisor_cut", "node-0", at_time(300), at_time(305)),
    ]
    events = [
        {"type": "host_heartbeat_lost", "node": "node-0", "time": at(2)},
        {"type": "node_recovered", "node": "node-0", "time": at(24)},  # within 20 s after
        {"type": "host_heartbeat_lost", "node": "node-0", "time": at(60)},  # long after
        {"type": "node_flapping", "node": "node-1", "time": at(104)},
        {"type": "hang", "node": "node-0", "time": at(105)},  # another node's
        {"type": "node_cut_off", "node": "node-2", "time": at(203)},
        {"type": "host_heartbeat_lost", "node": "node-0", "time": at(302)},
    ] * 300  # over one page

    def action(id_: int, type_: str, status: str, seconds: float, **more: Any) -> dict[str, Any]:
        record = {"id": id_, "type": type_, "status": status, "job": JOB}
        record.update(created_at=at(seconds), finished_at=at(seconds + 1), error=None)
        return {**record, **more}

    actions = [
        action(1, "hot_swap", "succeeded", 3),
        action(2, "emergency_checkpoint", "failed", 106, error="nothing to save"),
        action(3, "hot_swap", "succeeded", 107),
        # Its spare went down as it started; the next remedy, 30 s on, healed the job.
        action(4, "hot_swap", "failed", 204, error="no reachable spare node"),
        action(5, "restart_workload", "succeeded", 235),
        # Another job's success heals nothing of this one's.
        action(6, "hot_swap", "failed", 303, error="could not start workers"),
        action(7, "hot_swap", "succeeded", 310, job="other"),
        action(8, "restart_workload", "succeeded", 303 + 1 + LATER_REMEDY_S + 5),
    ]
    chaos.account(Records(events, actions))  # type: ignore[arg-type]
    down, flapping, peers, cut = chaos.faults
    assert set(down.events) == {"host_heartbeat_lost", "node_recovered"} and down.detected
    assert (down.verdict.healed, down.verdict.healed_by) == (True, None)
    assert set(flapping.events) == {"node_flapping"}
    assert flapping.verdict.healed
    assert flapping.verdict.checkpoints_not_committed == ["nothing to save"]
    assert (peers.verdict.healed, peers.verdict.healed_by) == (True, "restart_workload #5")
    assert not cut.verdict.healed
    assert cut.verdict.why_not == "hot_swap: could not start workers"
    # node-0 was back (t=24) when its link went down, lost again (t=60) when the
    # supervisor was cut from it: that cut could show nothing new.
    assert not down.already_lost and cut.already_lost
    assert not flapping.already_lost and not peers.already_lost
