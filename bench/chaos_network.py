"""Network faults for the chaos run: the cluster's hosts on a network of their own, cut on
the wire at random while the supervisor's own fault schedule runs.

Each host (the supervisor, every node) runs in a network namespace of its own, joined by
one switch with no route out (tests/netns.py). A background thread draws a fault every
`mean_interval_s` on average (exponential), on a node of the job's current placement:
- `supervisor_cut`: the supervisor and the node no longer hear each other, both ways; the
  node's workers train on with their peers (the split brain of a partition);
- `link_down`: the node's cable is pulled: it reaches no one, and no one reaches it;
- `flapping`: the link between the supervisor and the node goes down and up every
  `FLAP_S`;
- `peer_cut`: the node and every other node no longer hear each other, both ways, while
  the supervisor hears them all: its job's collectives stall with no heartbeat missed.
Each lasts `DURATION_S` (drawn), then heals. One fault at a time: the next is drawn once
the last healed.

The account of each fault: what the supervisor saw of the node while it was cut or soon
after (its events), and whether the job was healed, judged by the job's actions taken
then as bench/chaos_judge.py judges the supervisor's own faults.
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from bench.chaos_judge import Judgement, judge, timestamp
from supervisor.local.demo import LocalDemo
from tests.netns import Network, unavailable

KINDS = ("supervisor_cut", "link_down", "flapping", "peer_cut")
#: How long a fault lasts: drawn between these, seconds.
DURATION_S = (3.0, 10.0)
#: A flapping link is down, then up, this long each time.
FLAP_S = 1.5
#: Events and actions this long after a fault healed still count as its consequences.
AFTERMATH_S = 20.0

__all__ = ["KINDS", "NetworkChaos", "NetworkFault", "unavailable"]


@dataclass
class NetworkFault:
    kind: str
    node: str
    started: datetime
    healed: datetime | None = None
    events: list[str] = field(default_factory=list)  # "type" of each event on the node
    #: As bench/chaos_judge.py judges the job's actions taken while it was cut or soon after.
    verdict: Judgement = field(default_factory=Judgement)
    #: The supervisor held the node lost already when the cut began (a process fault
    #: downed it): a cut of it has nothing new to show.
    already_lost: bool = False

    @property
    def detected(self) -> bool:
        return bool(self.events)


class NetworkChaos:
    """The hosts' network and the thread that cuts it. `hosts()` gives what the cluster
    needs to run on it (`DemoOptions.hosts`)."""

    def __init__(
        self,
        names: list[str],
        mean_interval_s: float,
        seed: int,
        durations_s: tuple[float, float] = DURATION_S,
    ) -> None:
        self.net = Network()
        self._durations_s = durations_s
        self._random = random.Random(seed)
        self._mean = mean_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.faults: list[NetworkFault] = []
        self._cutting: set[str] = set()  # the node of the fault in progress
        self._cordoned_since: dict[str, float] = {}
        self.error: str | None = None
        try:
            for name in ("supervisor", *names):
                self.net.add_host(name)
        except BaseException:
            self.net.close()
            raise

    def hosts(self) -> dict[str, tuple[list[str], str]]:
        return {name: (h.exec_args(), h.address) for name, h in self.net.hosts.items()}

    def start(self, demo: LocalDemo) -> None:
        self._thread = threading.Thread(target=self._run, args=(demo,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more faults; whatever is cut heals."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._durations_s[1] + 30)
        for name in self.net.hosts:
            self.net.heal(name)

    def close(self) -> None:
        self.net.close()

    def _run(self, demo: LocalDemo) -> None:
        try:
            while not self._stop.wait(self._random.expovariate(1 / self._mean)):
                placement = _placement(demo)
                if not placement:
                    continue
                self.one(self._random.choice(KINDS), self._random.choice(placement))
        except Exception as exc:  # told in the account, never a silent end of the faults
            self.error = f"{type(exc).__name__}: {exc}"

    def one(self, kind: str, node: str) -> None:
        """One fault of `kind` on `node`, for its drawn duration, then healed."""
        fault = NetworkFault(kind, node, datetime.now(UTC))
        self.faults.append(fault)
        self._cutting.add(node)
        duration = self._random.uniform(*self._durations_s)
        ends = time.monotonic() + duration
        try:
            if kind == "supervisor_cut":
                self.net.drop(node, "supervisor", "both")
                self._stop.wait(duration)
            elif kind == "link_down":
                self.net.link_down(node)
                self._stop.wait(duration)
            elif kind == "peer_cut":
                for peer in self.net.hosts:
                    if peer not in (node, "supervisor"):
                        self.net.drop(node, peer, "both")
                self._stop.wait(duration)
            else:
                while time.monotonic() < ends and not self._stop.is_set():
                    self.net.drop(node, "supervisor", "both")
                    self._stop.wait(FLAP_S)
                    self.net.heal(node)
                    self._stop.wait(FLAP_S)
        finally:
            self.net.heal(node)
            fault.healed = datetime.now(UTC)
            self._cutting.discard(node)

    def repair_cordoned(self, demo: LocalDemo, after_s: float) -> None:
        """Return to the pool each node the supervisor cordoned (a flapping link is bad
        hardware to it) once it has been cordoned `after_s` and is no longer cut, as a
        technician would after checking its cable; without it, every cut node would leave
        the pool for good and the job would run out of spares."""
        try:
            nodes = demo.api("/api/v1/nodes")
        except (httpx.HTTPError, ValueError):
            return
        now = time.monotonic()
        cordoned = {n["name"] for n in nodes if n.get("cordoned") and n["state"] != "lost"}
        for name in list(self._cordoned_since):
            if name not in cordoned:
                del self._cordoned_since[name]
        for name in cordoned - self._cutting:
            since = self._cordoned_since.setdefault(name, now)
            if now - since < after_s:
                continue
            try:
                demo.operator_action(
                    {"type": "uncordon", "node": name, "reason": "link checked"},
                    key=f"link-checked-{name}-{int(since)}",
                )
            except httpx.HTTPError:
                continue  # the supervisor is busy: on the next pass
            self._cordoned_since.pop(name, None)

    def account(self, demo: LocalDemo) -> None:
        """Each fault's events on its node, and the verdict on the actions the job got
        while the node was cut or soon after, from the supervisor's records."""
        events = _all(demo, "/api/v1/events")
        actions = [a for a in _all(demo, "/api/v1/actions") if a.get("job") == demo.options.job]
        for fault in self.faults:
            healed = fault.healed or datetime.now(UTC)
            window = (fault.started, healed + timedelta(seconds=AFTERMATH_S))
            fault.events = [
                e["type"]
                for e in events
                if e.get("node") == fault.node and _within(e["time"], window)
            ]
            fault.already_lost = _lost_at(events, fault.node, fault.started)
            mine = [a for a in actions if _within(a["created_at"], window)]
            fault.verdict = judge(mine, actions)

    def stale_reports(self, demo: LocalDemo) -> dict[str, float]:
        """`supervisor_stale_world_reports_total` by "report outcome": what the supervisor
        refused or dropped of an older world's reports."""
        text = httpx.get(f"{demo.url}/metrics", timeout=10).text
        found: dict[str, float] = {}
        for line in text.splitlines():
            match = re.fullmatch(r"supervisor_stale_world_reports_total\{(.*)\} (\S+)", line)
            if match:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match[1]))
                found[f"{labels['report']} {labels['outcome']}"] = float(match[2])
        return found


def _placement(demo: LocalDemo) -> list[str]:
    try:
        job = demo.api(f"/api/v1/jobs/{demo.options.job}")
    except (httpx.HTTPError, ValueError):
        return []
    nodes = job.get("nodes") if isinstance(job, dict) else None
    return [str(n) for n in nodes] if isinstance(nodes, list) else []


def _all(demo: LocalDemo, path: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = demo.api(path, limit=500, **({"cursor": cursor} if cursor else {}))
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def _lost_at(events: list[dict[str, Any]], node: str, when: datetime) -> bool:
    """Whether the supervisor held `node` lost at `when`: its last loss or recovery
    before then was a loss."""
    last = None
    for event in events:
        if event.get("node") != node or event["type"] not in LIFE_EVENTS:
            continue
        seen = timestamp(event["time"])
        if seen is not None and seen < when and (last is None or seen >= last[0]):
            last = (seen, event["type"])
    return last is not None and last[1] == "host_heartbeat_lost"


#: The events that say a node was lost, or back.
LIFE_EVENTS = frozenset({"host_heartbeat_lost", "node_recovered"})


def _within(stamp: str, window: tuple[datetime, datetime]) -> bool:
    when = timestamp(stamp)
    return when is not None and window[0] <= when <= window[1]
