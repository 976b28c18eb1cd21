"""The dashboard at fleet scale: `supervisor serve` with 2,000 nodes heartbeating, its
CPU with three dashboard tabs open beside none (and beside three readers that fetch
the whole node list every 2 s, as the page once did), and how soon a node lost shows
on an open page. The nodes heartbeat every 5 s, as on a cluster.

`Fleet` is also what the dashboard's browser test heartbeats with.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import read_response
from bench.table import Row, verdict

AGENT_TOKEN = "bench-agent-token"
OPERATOR_TOKEN = "bench-operator-token"
WORKERS = 8
#: Jobs of the simulated fleet and their node counts; the rest of the nodes are spares.
JOBS = (("train-a", 1024), ("train-b", 512), ("train-c", 384))
NODES = 2000
#: A cluster's heartbeat period and timeout (the supervisor's defaults: 5 s, 15 s).
PERIOD_S = 5.0
TIMEOUT_S = 15.0
CPU_RATIO_TARGET = 1.10
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


@dataclass(frozen=True, slots=True)
class FleetNode:
    name: str
    job: str | None
    first_rank: int

    def template(self) -> bytes:
        """The heartbeat's JSON with `%d` for each worker's step (none for a spare)."""
        if self.job is None:
            return f'{{"node":"{self.name}","state":"spare","job":null,"workers":[]}}'.encode()
        workers = ",".join(
            f'{{"rank":{self.first_rank + i},"local_rank":{i},"pid":{1000 + i},'
            f'"state":"running","step":%d}}'
            for i in range(WORKERS)
        )
        return (
            f'{{"node":"{self.name}","state":"running","job":"{self.job}","workers":[{workers}]}}'
        ).encode()


def fleet_nodes(count: int = NODES, jobs: tuple[tuple[str, int], ...] = JOBS) -> list[FleetNode]:
    """`count` nodes named node-0000...: the jobs' nodes in turn, then spares."""
    out: list[FleetNode] = []
    for job, size in jobs:
        for i in range(size):
            out.append(FleetNode(f"node-{len(out):04d}", job, i * WORKERS))
    while len(out) < count:
        out.append(FleetNode(f"node-{len(out):04d}", None, 0))
    return out[:count]


@dataclass
class Fleet:
    """Host monitors of `nodes`, each heartbeating every `period_s` over a few keep-alive
    connections (HTTP/1.1 on raw streams, as bench/loadgen.py), in a thread of its own.
    `silence` stops nodes as a network cut would."""

    port: int
    nodes: list[FleetNode]
    period_s: float = PERIOD_S
    connections: int = 8
    token: str = AGENT_TOKEN
    silenced: set[str] = field(default_factory=set)
    sent: int = 0
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _primed: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Fleet:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        if not self._primed.wait(120):
            raise RuntimeError("the fleet's first heartbeats did not all go out")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def silence(self, names: list[str]) -> None:
        self.silenced.update(names)

    def _request(self, node: FleetNode, template: bytes, step: int) -> bytes:
        body = template % ((step,) * WORKERS) if node.job is not None else template
        head = (
            f"POST /api/v1/heartbeats HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def _run(self) -> None:
        shares = [self.nodes[c :: self.connections] for c in range(self.connections)]
        primed = [0]

        def one_done() -> None:
            primed[0] += 1
            if primed[0] == len(shares):
                self._primed.set()

        await asyncio.gather(*(self._connection(share, one_done) for share in shares if share))

    async def _connection(self, share: list[FleetNode], primed: Any) -> None:
        templates = [node.template() for node in share]
        loop = asyncio.get_running_loop()
        start = loop.time()
        step = 0
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            while not self._stop.is_set():
                step += 1
                for k, node in enumerate(share):
                    # Spread over the period, as independent host monitors are.
                    due = start + (step - 1) * self.period_s + k * self.period_s / len(share)
                    if due > loop.time():
                        await asyncio.sleep(due - loop.time())
                    if node.name in self.silenced or self._stop.is_set():
                        continue
                    writer.write(self._request(node, templates[k], step))
                    status = await read_response(reader)
                    self.sent += 1
                    if status >= 300:
                        self.errors += 1
                if step == 1:
                    primed()
        finally:
            writer.close()


# --- the supervisor under test -------------------------------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def serving(workdir: Path) -> Iterator[Served]:
    """`supervisor serve` (the real process, SQLite), timeouts as a cluster's."""
    from supervisor.local.ports import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    env.update(
        SUPERVISOR_DATABASE_URL=f"sqlite:///{workdir / 'supervisor.db'}",
        SUPERVISOR_AGENT_TOKEN=AGENT_TOKEN,
        SUPERVISOR_OPERATOR_TOKEN=OPERATOR_TOKEN,
        SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S=str(PERIOD_S),
        SUPERVISOR_HEARTBEAT_TIMEOUT_S=str(TIMEOUT_S),
        SUPERVISOR_LOG_LEVEL="warning",
    )
    log = (workdir / "server.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    served = Served(proc, port)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"supervisor exited: {(workdir / 'server.log').read_text()}")
            with suppress(httpx.TransportError):
                if httpx.get(f"{served.url}/readyz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("supervisor did not become ready")
            time.sleep(0.1)
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


#: The page is live and has read the nodes.
LIVE = (
    "() => document.querySelector('#connection')?.dataset.state === 'live'"
    " && (window.supervisorDashboard?.nodes.byName.size ?? 0) > 0"
)


def open_dashboard(browser: Any, url: str, width: int = 1600, height: int = 1000) -> Any:
    """A signed-in page showing every node (its first full read done)."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(60_000)
    page.goto(url)
    page.fill("#token", OPERATOR_TOKEN)
    page.press("#token", "Enter")
    wait_js(page, LIVE)
    return page


def wait_js(page: Any, function: str, arg: Any = None, timeout_s: float = 60.0) -> None:
    """Until `function(arg)` is true in the page. Polled from here: the page's content
    security policy forbids the eval that Playwright's wait_for_function uses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(function, arg):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout_s:g} s: {function}")
        time.sleep(0.05)


# --- the measurement ------------------------------------------------------------------------


@dataclass
class DashboardResult:
    nodes: int
    window_s: float
    cpu_none_pct: float
    cpu_tabs_pct: float
    cpu_pollers_pct: float
    loss_lag_ms: list[float]
    lost: int
    errors: int


def _cpu_pct(served: Served, window_s: float) -> float:
    before, t0 = served.cpu_s(), time.monotonic()
    time.sleep(window_s)
    return 100 * (served.cpu_s() - before) / (time.monotonic() - t0)


def _pollers(url: str, stop: threading.Event) -> None:
    """What the page did before: the whole node list every 2 s."""
    headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        while not stop.wait(2.0):
            client.get("/api/v1/nodes")


def run(nodes: int = NODES, window_s: float = 20.0, tabs: int = 3) -> DashboardResult:
    from playwright.sync_api import sync_playwright  # the `dev` extra

    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp, serving(Path(tmp)) as sv:
        fleet_list = fleet_nodes(nodes)
        with Fleet(sv.port, fleet_list) as fleet:
            time.sleep(2 * PERIOD_S)  # registration settled
            none_a = _cpu_pct(sv, window_s)
            stop = threading.Event()
            threads = [
                threading.Thread(target=_pollers, args=(sv.url, stop), daemon=True)
                for _ in range(tabs)
            ]
            for t in threads:
                t.start()
            pollers = _cpu_pct(sv, window_s)
            stop.set()
            for t in threads:
                t.join(30)
            # Tabs and no tabs in turns, so that the machine's drift falls on both.
            nones, tabs_on = [none_a], []
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
                pages = [open_dashboard(browser, sv.url) for _ in range(tabs)]
                tabs_on.append(_cpu_pct(sv, window_s))
                for page in pages:
                    page.goto("about:blank")
                nones.append(_cpu_pct(sv, window_s))
                for page in pages:  # the token is still in the tab's session storage
                    page.goto(sv.url)
                    wait_js(page, LIVE)
                tabs_on.append(_cpu_pct(sv, window_s))
                lags, lost = _loss_lag(sv, fleet, pages[0], fleet_list)
                browser.close()
            nones.append(_cpu_pct(sv, window_s))
            return DashboardResult(
                nodes=nodes,
                window_s=window_s,
                cpu_none_pct=sum(nones) / len(nones),
                cpu_tabs_pct=sum(tabs_on) / len(tabs_on),
                cpu_pollers_pct=pollers,
                loss_lag_ms=lags,
                lost=lost,
                errors=fleet.errors,
            )


def _loss_lag(
    sv: Served, fleet: Fleet, page: Any, nodes: list[FleetNode], count: int = 10
) -> tuple[list[float], int]:
    """Silence `count` nodes of one job; for each, from the supervisor's loss event to
    the page showing it lost (both clocks are this machine's)."""
    victims = [n.name for n in nodes if n.job == JOBS[1][0]][:count]
    fleet.silence(victims)
    headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    wait_js(
        page,
        "names => names.every(n => window.supervisorDashboard.nodes.statusSeen.get(n)?.status"
        " === 'lost')",
        victims,
        timeout_s=120,
    )
    seen = page.evaluate(
        "names => names.map(n => window.supervisorDashboard.nodes.statusSeen.get(n).at)", victims
    )
    events = httpx.get(
        f"{sv.url}/api/v1/events",
        params={"type": ["host_heartbeat_lost", "node_flapping"], "limit": 100},
        headers=headers,
        timeout=30,
    ).json()["items"]
    raised = {e["node"]: _epoch_ms(e["time"]) for e in events}
    lags = [max(0.0, at - raised[name]) for name, at in zip(victims, seen, strict=True)]
    return lags, len([n for n in victims if n in raised])


def _epoch_ms(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp() * 1000


def rows() -> list[Row]:
    res = run()
    ratio = res.cpu_tabs_pct / res.cpu_none_pct if res.cpu_none_pct else float("inf")
    poll_ratio = res.cpu_pollers_pct / res.cpu_none_pct if res.cpu_none_pct else float("inf")
    lags = sorted(res.loss_lag_ms)
    worst = lags[-1] if lags else float("inf")
    where = f"{res.nodes:,} nodes every {PERIOD_S:g} s; {res.window_s:g} s windows in turns"
    return [
        Row(
            f"Dashboard: supervisor CPU, 3 tabs open / none ({where})",
            f"{res.cpu_tabs_pct:.1f}% / {res.cpu_none_pct:.1f}% = {ratio:.2f}x",
            f"3 readers of every node every 2 s: {res.cpu_pollers_pct:.1f}% = {poll_ratio:.2f}x",
            f"<= {CPU_RATIO_TARGET:.2f}x",
            verdict(ratio <= CPU_RATIO_TARGET and res.errors == 0),
        ),
        Row(
            f"  node lost -> shown lost on an open page ({len(lags)} nodes) p50 / max",
            f"{lags[len(lags) // 2]:.0f} / {worst:.0f} ms" if lags else "not shown",
            f"heartbeat period {PERIOD_S * 1000:.0f} ms",
            "max <= 1 heartbeat period",
            verdict(bool(lags) and len(lags) == res.lost and worst <= PERIOD_S * 1000),
        ),
    ]
