"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright),
against `supervisor serve` as a process, with nodes heartbeating over HTTP.

Screenshots go to test-artifacts/ (look at them: they are how a person sees the page).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN
from tests.http import http
from tests.test_api import heartbeat
from tests.test_e2e import Server
from tests.timing import scaled

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
WAIT_MS = 30_000  # generous: the machine is shared
expect.set_options(timeout=WAIT_MS)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: `make test` installs it (apt chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()


class Beater:
    """Host monitors as the supervisor sees them: a heartbeat per node every 0.1 s, with
    the job's step advancing. Connection errors (a server being restarted) are ignored."""

    def __init__(
        self, url: str, nodes: dict[str, str | None], compute: dict[str, float] | None = None
    ) -> None:
        self.url = url
        self.nodes = nodes
        self.compute = compute or {}  # node -> its workers' compute time per step
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beater", daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=2) as client:
            while not self._stop.is_set():
                self.step += 1
                for node, job in self.nodes.items():
                    body = heartbeat(node, job=job, step=self.step)
                    if node in self.compute:
                        for worker in body["workers"]:
                            worker["compute_s"] = self.compute[node]
                    with suppress(httpx.TransportError):
                        client.post("/api/v1/heartbeats", json=body, headers=AGENT)
                self._stop.wait(0.1)

    def __enter__(self) -> Beater:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@contextmanager
def cluster(tmp_path: Path, **settings: Any) -> Iterator[Server]:
    """`supervisor serve` with two nodes of job j1 and a spare, all heartbeating."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    # Lost after 3 s of silence (scaled): quick to see, and no false alarm on a loaded
    # machine (beside two CPU burners a starved beater once let a node be lost and found
    # again, two events more than the page expected).
    settings.setdefault("heartbeat_timeout_s", str(scaled(3.0)))
    server = Server(tmp_path, **settings)
    server.start()
    try:
        with Beater(server.url, {"n1": "j1", "n2": "j1", "s1": None}):
            deadline = time.monotonic() + 30
            while len(http.get(f"{server.url}/api/v1/nodes", headers=OPERATOR).json()) < 3:
                assert time.monotonic() < deadline, "nodes did not appear"
                time.sleep(0.05)
            yield server
    finally:
        server.stop()


NETWORK_CHANGED = "net::ERR_NETWORK_CHANGED"


def load(page: Page, url: str | None = None) -> None:
    """Open `url` (None: load the page again). A script Chromium cut off while the page
    loaded, because the machine's addresses changed (NETWORK_CHANGED), leaves the page
    without its code, as it would a user's, who loads it again: so does the test, a few
    times at most."""
    cut: list[str] = []

    def on_failed(request: Any) -> None:
        if NETWORK_CHANGED in (request.failure or ""):
            cut.append(request.url)

    page.on("requestfailed", on_failed)
    try:
        for _ in range(3):
            cut.clear()
            if url is None:
                page.reload(wait_until="load")
            else:
                page.goto(url, wait_until="load")
            if not cut:
                return
    finally:
        page.remove_listener("requestfailed", on_failed)


@contextmanager
def dashboard(
    browser: Browser,
    server: Server,
    token: str | None = OPERATOR_TOKEN,
    allowed_errors: tuple[str, ...] = (),
) -> Iterator[Page]:
    """The page, signed in with `token`; at the end, no script error, and no request
    left for anywhere but the supervisor (offline: no CDN)."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    requests: list[str] = []
    # The first look, before the token; and a request Chromium cancelled because the
    # machine's addresses changed (the network-namespace tests, running beside, give the
    # root namespace its side of a veth pair): once loaded, the page recovers from it
    # (it asks again, its stream reconnects), which the waits of each test check.
    expected = ("status of 401", NETWORK_CHANGED, *allowed_errors)

    def on_console(message: Any) -> None:
        if message.type == "error" and not any(e in message.text for e in expected):
            errors.append(message.text)

    page.on("console", on_console)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda request: requests.append(request.url))
    try:
        load(page, f"{server.url}/")
        if token is not None:
            expect(page.locator("#login")).to_be_visible()
            page.fill("#token", token)
            page.press("#token", "Enter")
        expect(page.locator("#connection")).to_have_attribute("data-state", "live")
        expect(page.locator("#nodes li")).to_have_count(3)
        yield page
        assert not errors, errors
        foreign = [u for u in requests if not u.startswith((server.url, "data:"))]
        assert not foreign, foreign
    finally:
        context.close()


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.evaluate("window.scrollTo(0, 0)")  # the sticky header where a person sees it
    page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)


def api(server: Server, method: str, path: str, **kwargs: Any) -> Any:
    r = http.request(method, f"{server.url}{path}", headers=OPERATOR, timeout=10, **kwargs)
    assert r.status_code < 300, r.text
    return r.json()


def event_row(page: Page, event_id: int) -> Any:
    return page.locator(f"#events-table tbody tr[data-id='{event_id}']")


def wait_fault_settled(server: Server, fault_id: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        fault: dict[str, Any] = api(server, "GET", f"/api/v1/faults/{fault_id}")
        actions = [api(server, "GET", f"/api/v1/actions/{a}") for a in fault["actions"]]
        if actions and all(a["status"] in ("succeeded", "failed") for a in actions):
            return fault
        time.sleep(0.1)
    raise AssertionError(f"fault {fault_id}: actions did not finish")


# --- tests ------------------------------------------------------------------------------


def test_page_asks_for_the_token_and_shows_the_cluster(browser: Browser, tmp_path: Path) -> None:
    with cluster(tmp_path) as server:
        context = browser.new_context(viewport={"width": 1440, "height": 900})
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        load(page, f"{server.url}/")
        dialog = page.locator("#login")
        expect(dialog).to_be_visible()
        expect(page.get_by_role("textbox", name="Operator token")).to_be_focused()
        shot(page, "login")
        page.fill("#token", "not-the-token")
        page.press("#token", "Enter")
        expect(page.locator("#login-error")).to_have_text("That token was refused.")
        page.fill("#token", OPERATOR_TOKEN)
        page.press("#token", "Enter")
        expect(dialog).to_be_hidden()
        expect(page.locator("#connection")).to_have_text("Live")
        # The token stays in the tab (sessionStorage), never in the URL.
        assert OPERATOR_TOKEN not in page.url
        load(page)
        expect(page.locator("#connection")).to_have_text("Live")
        expect(dialog).to_be_hidden()
        context.close()

    with cluster(tmp_path / "again") as server, dashboard(browser, server) as page:
        nodes = page.locator("#nodes li")
        expect(nodes).to_have_count(3)
        n1 = page.locator("#nodes li[data-node='n1']")
        expect(n1).to_have_attribute("data-state", "running")
        expect(n1.locator("dd").first).to_have_text("j1")
        expect(n1.locator(".heartbeat")).to_have_text(re.compile(r"^\d+\.\d s ago$"))
        expect(n1.locator(".gpu")).to_have_text("no errors")
        expect(page.locator("#nodes li[data-node='s1']")).to_have_attribute("data-state", "spare")
        expect(page.locator("#nodes-summary")).to_have_text("3 nodes: 1 spare, 2 healthy.")
        # The spare's arrival is in the history.
        expect(page.locator("#events-table tbody tr[data-type='spare_available']")).to_have_count(1)
        expect(page.locator("#faults-section")).to_be_visible()
        shot(page, "loaded")


def test_node_cards_show_compute_times_and_mark_a_straggler(
    browser: Browser, tmp_path: Path
) -> None:
    # Three nodes of two ranks each, no spare: the straggler is only recorded.
    server = Server(tmp_path, heartbeat_timeout_s="3.0", straggler_window_s="0.5")
    server.start()
    compute = {"n1": 0.1, "n2": 0.1, "n3": 0.2}
    try:
        nodes = {"n1": "j1", "n2": "j1", "n3": "j1"}
        with Beater(server.url, nodes, compute), dashboard(browser, server) as page:
            n1 = page.locator("#nodes li[data-node='n1']")
            expect(n1.locator(".compute")).to_have_text("100.0 ms")
            slow = page.locator("#nodes li[data-node='n3'] .compute")
            expect(slow).to_have_text(re.compile(r"^200\.0 ms straggler \+100%$"))
            expect(n1.locator(".compute .badge")).to_have_count(0)
            shot(page, "straggler")
    finally:
        server.stop()


def test_fault_injected_through_the_api_appears_live_with_its_actions(
    browser: Browser, tmp_path: Path
) -> None:
    with cluster(tmp_path) as server, dashboard(browser, server) as page:
        page.evaluate("window.notReloaded = true")
        fault = api(
            server,
            "POST",
            "/api/v1/faults",
            json={"kind": "xid", "node": "n1", "code": 79, "gpu": 3},
        )
        fault = wait_fault_settled(server, fault["id"])
        (event_id,) = fault["events"]
        row = event_row(page, event_id)
        expect(row).to_have_attribute("data-type", "gpu_xid")
        expect(row).to_contain_text("n1")
        expect(row).to_contain_text(f"fault #{fault['id']}")
        expect(row).to_contain_text("code 79")
        # The actions it caused, as they finished, listed on the event and in their table.
        for action_id in fault["actions"]:
            action = api(server, "GET", f"/api/v1/actions/{action_id}")
            action_row = page.locator(f"#actions-table tbody tr[data-id='{action_id}']")
            expect(action_row).to_have_attribute("data-status", action["status"])
            expect(action_row).to_contain_text(action["type"].replace("_", " "))
            expect(action_row.locator(".cause")).to_contain_text(f"event #{event_id} gpu xid on n1")
            expect(action_row.locator(".cause")).to_contain_text(f"fault #{fault['id']}")
            expect(row).to_contain_text(f"{action['type'].replace('_', ' ')}: {action['status']}")
        expect(page.locator("#actions-table tbody tr[data-id] >> text=hot swap")).to_have_count(1)
        # From an action to its cause: focus moves to the event's row.
        page.locator(f"#actions-table tbody tr[data-id='{fault['actions'][0]}'] .cause a").click()
        expect(row).to_be_focused()
        # The node grid follows: the node was swapped out (cordoned; its host monitor here
        # still reports the job's workers, so it is draining), its GPU error shows.
        n1 = page.locator("#nodes li[data-node='n1']")
        expect(n1).to_have_attribute("data-state", "draining")
        expect(n1).to_have_attribute("data-group", "cordoned")
        expect(n1.locator(".gpu")).to_contain_text("XID 79 on GPU 3")
        # Screen readers were told.
        expect(page.locator("#announcer")).to_contain_text("Action")
        assert page.evaluate("window.notReloaded") is True  # live, not a reload
        shot(page, "xid-live")

        # The form shows each kind's parameters as the protocol's table gives them
        # (/api/v1/info's fault_params): an XID takes a code, a GPU and a rank.
        page.select_option("#fault-kind", "xid")
        for label in ("XID code", "GPU", "Rank"):
            expect(page.locator("#fault-form").get_by_label(label, exact=True)).to_be_visible()
        expect(page.get_by_label("Duration (s)")).to_be_hidden()
        # The page's own form: a heartbeat loss on n2, which is declared lost.
        page.select_option("#fault-kind", "heartbeat_loss")
        page.select_option("#fault-node", "n2")
        expect(page.get_by_label("Duration (s)")).to_be_visible()
        expect(page.get_by_label("XID code")).to_be_hidden()
        page.get_by_label("Duration (s)").fill("8")
        page.get_by_role("button", name="Inject fault").click()
        expect(page.locator("#fault-result")).to_have_text(
            re.compile(r"^Fault #\d+ injected: heartbeat loss on n2\.$")
        )
        lost = page.locator("#events-table tbody tr[data-type='host_heartbeat_lost']")
        expect(lost).to_have_count(1)
        expect(lost).to_contain_text("n2")
        expect(lost.locator("td").nth(7).locator(".badge").first).to_be_visible()  # its action
        expect(page.locator("#nodes li[data-node='n2']")).to_have_attribute("data-state", "lost")
        expect(page.locator("#attention-list li[data-node='n2']")).to_contain_text("n2 lost")
        expect(page.locator("#active-faults")).to_contain_text("heartbeat loss n2")
        shot(page, "heartbeat-loss-live")
        # Eight seconds later the fault ends and the node comes back, live as well.
        expect(page.locator("#events-table tbody tr[data-type='node_recovered']")).to_contain_text(
            "n2"
        )
        expect(page.locator("#nodes li[data-node='n2']")).not_to_have_attribute(
            "data-state", "lost"
        )


def events_recorded(server: Server) -> int:
    return len(api(server, "GET", "/api/v1/events", params={"limit": 1000})["items"])


def test_filters_and_pagination(browser: Browser, tmp_path: Path) -> None:
    with cluster(tmp_path) as server:
        # Enough history for more than one page (50 rows): XID faults with distinct codes.
        for code in range(60):
            node = "n1" if code % 2 else "n2"
            api(server, "POST", "/api/v1/faults", json={"kind": "xid", "node": node, "code": code})
        assert events_recorded(server) > 60
        with dashboard(browser, server) as page:
            rows = page.locator("#events-table tbody tr[data-id]")
            expect(rows).to_have_count(50)
            page.get_by_role("button", name="Load older events").click()
            # Every event the supervisor holds, also one recorded since the count above
            # (what the policy did about the faults, on a slow machine): the live stream
            # adds it to the page.
            deadline = time.monotonic() + scaled(30)
            while rows.count() != (total := events_recorded(server)):
                assert time.monotonic() < deadline, (rows.count(), total)
                time.sleep(0.2)
            expect(page.get_by_role("button", name="Load older events")).to_be_hidden()
            ids = [int(i) for i in rows.evaluate_all("rs => rs.map(r => r.dataset.id)")]
            assert ids == sorted(ids, reverse=True)  # newest first

            page.select_option("#f-type", "gpu_xid")
            expect(rows).to_have_count(50)
            types = set(rows.evaluate_all("rs => rs.map(r => r.dataset.type)"))
            assert types == {"gpu_xid"}
            assert "type=gpu_xid" in page.url  # a view that can be bookmarked

            page.select_option("#f-node", "n2")
            expect(rows).to_have_count(30)
            for text in rows.locator("td:nth-child(4)").all_inner_texts():
                assert text == "n2"
            action_nodes = page.locator("#actions-table tbody tr[data-id] td:nth-child(4)")
            for text in action_nodes.all_inner_texts():
                assert "n2" in text or "job j1" in text
            shot(page, "filtered")

            # A time range before anything happened: nothing.
            page.fill("#f-until", "2020-01-01T00:00:00")
            page.get_by_role("button", name="Apply").click()
            expect(page.locator("#events-table tbody tr.empty")).to_have_text(
                "No events match these filters."
            )
            expect(page.locator("#filter-summary")).to_contain_text("Showing 0 events")

            # The URL keeps the filters: a reload shows the same view.
            page.get_by_role("button", name="Clear").click()
            expect(rows).to_have_count(50)
            page.select_option("#f-status", "succeeded")
            load(page)
            expect(page.locator("#f-status")).to_have_value("succeeded")
            statuses = page.locator("#actions-table tbody tr[data-id]")
            expect(statuses.first).to_be_visible()
            assert set(statuses.evaluate_all("rs => rs.map(r => r.dataset.status)")) == {
                "succeeded"
            }


def test_filters_work_from_the_keyboard(browser: Browser, tmp_path: Path) -> None:
    with cluster(tmp_path) as server:
        api(server, "POST", "/api/v1/faults", json={"kind": "xid", "node": "n2", "code": 48})
        with dashboard(browser, server) as page:
            rows = page.locator("#events-table tbody tr[data-id]")
            expect(rows).to_have_count(2)  # the spare's arrival and the XID
            # From the top of a fresh page (the token is kept for the tab: no dialog).
            load(page)
            expect(page.locator("#connection")).to_have_text("Live")
            expect(rows).to_have_count(2)
            page.keyboard.press("Tab")
            expect(page.get_by_role("link", name="Skip to the event history")).to_be_focused()
            page.keyboard.press("Enter")
            page.keyboard.press("Tab")
            filters = page.get_by_role("search", name="Filter events and actions")
            event_type = filters.get_by_label("Event type")
            expect(event_type).to_be_focused()
            outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
            assert outline != "none"  # focus is visible
            page.keyboard.type("gpu x")  # type-ahead on the closed select picks "gpu xid"
            expect(event_type).to_have_value("gpu_xid")
            expect(rows).to_have_count(1)
            expect(rows.first).to_have_attribute("data-type", "gpu_xid")
            # On to Node, and pick n1: nothing matches.
            for _ in range(3):
                page.keyboard.press("Tab")
            expect(filters.get_by_label("Node")).to_be_focused()
            page.keyboard.type("n1")
            expect(page.locator("#events-table tbody tr.empty")).to_be_visible()
            shot(page, "keyboard-filters")
            # To "Clear" by keyboard, and the full history is back.
            for _ in range(20):
                page.keyboard.press("Tab")
                if page.evaluate("document.activeElement.textContent") == "Clear":
                    break
            expect(filters.get_by_role("button", name="Clear")).to_be_focused()
            page.keyboard.press("Enter")
            expect(rows).to_have_count(2)
            expect(event_type).to_have_value("")


def test_stream_reconnects_after_the_server_drops_it(browser: Browser, tmp_path: Path) -> None:
    with (
        cluster(tmp_path) as server,
        dashboard(
            browser,
            server,
            allowed_errors=("net::ERR_", "status of 503"),  # SIGKILL: cut requests
        ) as page,
    ):
        page.evaluate("window.notReloaded = true")
        status = page.locator("#connection")
        reloads = "window.supervisorDashboard.history.generation"
        loaded = page.evaluate(reloads)

        # A dropped connection, the server still up: the page catches up by Last-Event-ID
        # (the server replays what it missed), without reloading the history.
        page.route("**/api/v1/stream", lambda route: route.abort())
        page.evaluate("window.supervisorDashboard.stream.controller.abort()")
        expect(status).to_have_attribute("data-state", "reconnecting")
        missed = api(
            server, "POST", "/api/v1/faults", json={"kind": "xid", "node": "n2", "code": 13}
        )
        missed = wait_fault_settled(server, missed["id"])
        page.unroute("**/api/v1/stream")
        expect(status).to_have_attribute("data-state", "live")
        expect(event_row(page, missed["events"][0])).to_contain_text("code 13")
        for action_id in missed["actions"]:
            row = page.locator(f"#actions-table tbody tr[data-id='{action_id}']")
            expect(row).to_have_attribute("data-status", "succeeded")
        assert page.evaluate(reloads) == loaded  # replayed, not reloaded

        server.kill()  # SIGKILL: the stream is cut, no goodbye
        expect(status).to_have_attribute("data-state", "reconnecting")
        expect(status).to_contain_text("reconnecting")
        shot(page, "reconnecting")
        server.start()  # same port, same database
        fault = api(
            server, "POST", "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}
        )
        expect(status).to_have_attribute("data-state", "live")
        expect(status).to_have_text("Live")
        # What happened while the page was away is there, and what follows arrives live.
        fault = wait_fault_settled(server, fault["id"])
        expect(event_row(page, fault["events"][0])).to_have_attribute("data-type", "gpu_xid")
        later = api(
            server, "POST", "/api/v1/faults", json={"kind": "xid", "node": "n2", "code": 48}
        )
        later = wait_fault_settled(server, later["id"])
        expect(event_row(page, later["events"][0])).to_contain_text("n2")
        for action_id in later["actions"]:
            expect(page.locator(f"#actions-table tbody tr[data-id='{action_id}']")).to_be_visible()
        assert page.evaluate("window.supervisorDashboard.stream.connections") >= 3
        assert page.evaluate(reloads) > loaded  # another process: resync, history reloaded
        assert page.evaluate("window.notReloaded") is True
        shot(page, "reconnected")


def test_a_page_left_open_keeps_a_bounded_history(browser: Browser, tmp_path: Path) -> None:
    with cluster(tmp_path) as server, dashboard(browser, server) as page:
        rows = page.locator("#events-table tbody tr[data-id]")
        expect(rows).to_have_count(1)  # the spare's arrival
        # 1200 live events (made up here: real ones would take minutes to raise).
        page.evaluate(
            """() => {
              const history = window.supervisorDashboard.history;
              for (let i = 1; i <= 1200; i++) {
                history.onEvent({id: 100000 + i, type: "hang", time: new Date().toISOString(),
                  node: "n1", job: "j1", rank: 0, details: {}, fault_id: null});
              }
            }"""
        )
        expect(rows).to_have_count(1000)
        expect(rows.first).to_have_attribute("data-id", "101200")
        more = page.get_by_role("button", name="Reload from the newest events")
        more.click()
        expect(rows).to_have_count(1)  # what the server has, from the newest page again
        expect(page.get_by_role("button", name="Load older events")).to_be_hidden()


def test_fault_form_only_with_fault_injection_and_the_token(
    browser: Browser, tmp_path: Path
) -> None:
    with (
        cluster(tmp_path, enable_fault_injection="false") as server,
        dashboard(browser, server) as page,
    ):
        expect(page.locator("#nodes li")).to_have_count(3)
        expect(page.locator("#faults-section")).to_be_hidden()
        expect(page.get_by_role("link", name="Fault injection")).to_be_hidden()

    # Reads open to all: the page works without a token, but offers no fault injection
    # until the operator token is given.
    with (
        cluster(tmp_path / "open", read_requires_token="false") as server,
        dashboard(browser, server, token=None) as page,
    ):
        expect(page.locator("#login")).to_be_hidden()
        expect(page.locator("#faults-section")).to_be_hidden()
        page.get_by_role("button", name="Enter operator token").click()
        page.fill("#token", OPERATOR_TOKEN)
        page.press("#token", "Enter")
        expect(page.locator("#faults-section")).to_be_visible()
        expect(page.get_by_role("button", name="Forget token")).to_be_visible()


def test_goodput_panel_and_advice(browser: Browser, tmp_path: Path) -> None:
    with cluster(tmp_path, goodput_sample_period_s="0.5") as server:
        time.sleep(2)  # some training to measure
        api(server, "POST", "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79})
        # Checkpoints of the RAM tier with their sizes (64 MiB in 0.5 s: 128 MiB/s), and
        # one of the local tier from an older client (no size).
        now = time.time()
        reports = [
            {"id": f"c{step}", "node": "n1", "job": "j1", "rank": 0, "event": "saved",
             "step": step, "duration_s": 0.25, "tier": tier, "bytes": size, "total_s": total,
             "time": datetime.fromtimestamp(now - 1 + step / 100, UTC).isoformat()}
            for step, tier, size, total in ((1, "ram", 64 * 2**20, 0.5), (2, "local", None, None))
        ]  # fmt: skip
        r = http.post(f"{server.url}/api/v1/checkpoints", json={"reports": reports}, headers=AGENT)
        assert r.status_code == 200, r.text
        with dashboard(browser, server) as page:
            expect(page.locator("#goodput-job")).to_have_value("j1")
            figure = page.locator("#goodput-figure")
            expect(figure).to_have_text(re.compile(r"^Goodput \d+\.\d %$"))
            goodput = api(server, "GET", "/api/v1/jobs/j1/goodput")
            shown = float(figure.inner_text().split()[1])
            assert abs(shown - 100 * goodput["goodput"]) < 15  # the same figure, a bit later
            expect(page.locator("#goodput-chart")).to_be_visible()
            assert page.locator("#goodput-chart rect").count() > 0
            expect(page.locator(".breakdown")).to_contain_text("lost progress")
            ram = page.locator("#goodput-tiers tr[data-tier='ram']")
            expect(ram).to_contain_text("64 MiB")
            expect(ram).to_contain_text("128 MiB/s")
            expect(ram).to_contain_text("250 ms")
            expect(page.locator("#goodput-tiers tr[data-tier='local']")).to_contain_text("—")
            expect(
                page.get_by_role("heading", name="Checkpoint advice", exact=True)
            ).to_be_visible()
            page.get_by_label("Model parameters").fill("70e9")
            page.get_by_label("Hosts").fill("16")
            page.get_by_role("button", name="Size the ramdisk").click()
            advice = api(
                server, "GET", "/api/v1/jobs/j1/advice", params={"parameters": 70e9, "hosts": 16}
            )
            size = f"{advice['ramdisk']['size_mib']:,} MiB"
            expect(page.locator("#advice-ramdisk")).to_contain_text(size)
            shot(page, "goodput")


def test_a_dry_run_supervisor_shows_what_it_would_have_done(
    browser: Browser, tmp_path: Path
) -> None:
    with cluster(tmp_path, dry_run="true") as server, dashboard(browser, server) as page:
        expect(page.locator("#about")).to_contain_text("(dry run)")
        fault = api(
            server, "POST", "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}
        )
        fault = wait_fault_settled(server, fault["id"])
        (event_id,) = fault["events"]
        for action_id in fault["actions"]:
            action = api(server, "GET", f"/api/v1/actions/{action_id}")
            assert action["dry_run"] is True
            row = page.locator(f"#actions-table tbody tr[data-id='{action_id}']")
            expect(row.locator(".badge.dry-run")).to_have_text("would have")
        expect(event_row(page, event_id)).to_contain_text("would hot swap: succeeded")
        # Nothing was cordoned: the node is shown as it is, the would-have apart.
        node = api(server, "GET", "/api/v1/nodes/n1")
        assert (node["cordoned"], node["dry_run_cordoned"], node["status"]) == (
            False,
            True,
            "running",
        )
        n1 = page.locator("#nodes li[data-node='n1']")
        expect(n1.locator(".notes")).to_contain_text("dry run: would have cordoned it")
        expect(n1).to_have_attribute("data-state", "running")
        expect(page.locator("#node-counts .cordoned strong")).to_have_text("0")
        shot(page, "dry-run")


def test_the_simulated_runs_page_shows_a_simulation(browser: Browser, tmp_path: Path) -> None:
    """`supervisor simulate -o json`, opened in the dashboard's page of simulated runs:
    a bar per run split by badput category, and the figures side by side."""
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        "days: 3\nseed: 2\n"
        "cluster: {num_dp_replicas: 2, num_nodes_per_dp: 2, spares: 1}\n"
        "failures: {rates: {host: 0.01, software: 0.01}}\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "simulate",
            "--scenario",
            str(scenario),
            "--compare",
            "default:",
            "--compare",
            "slow:heartbeat_timeout_s=300",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
    )
    assert done.returncode == 0, done.stderr
    result = tmp_path / "simulation.json"
    result.write_text(done.stdout)
    runs = json.loads(done.stdout)["runs"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": []}')
    server = Server(tmp_path / "server")
    (tmp_path / "server").mkdir()
    server.start()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        load(page, f"{server.url}/simulate")
        page.set_input_files("#sim-file", str(bad))
        expect(page.locator("#sim-error")).to_contain_text("no runs")
        expect(page.locator("#sim-result")).to_be_hidden()
        page.set_input_files("#sim-file", str(result))
        expect(page.locator("#sim-result")).to_be_visible()
        expect(page.locator("#sim-error")).to_have_text("")
        head = page.locator("#sim-table thead th")
        expect(head).to_have_text(["", "default", "slow"])
        goodput = page.locator("#sim-table tbody tr").first.locator("td")
        expect(goodput).to_have_text([f"{r['goodput'] * 100:.2f}%" for r in runs])
        detection = page.locator("#sim-chart rect[data-category='detection']")
        expect(detection).to_have_count(2)  # both runs lost time to detection
        widths = [
            float(w) for w in detection.evaluate_all("els => els.map(e => e.getAttribute('width'))")
        ]
        assert widths[1] > widths[0]  # the slow detection shows
        assert not errors, errors
        shot(page, "simulated-runs")
    finally:
        context.close()
        server.stop()
