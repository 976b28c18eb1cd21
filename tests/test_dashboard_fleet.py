"""The dashboard at fleet scale, in a real headless Chromium against `supervisor serve`
with 2,000 simulated nodes heartbeating over HTTP every 5 s (bench/dashboard.py's
fleet): every node on one screen, grouped by job, the lost ones named first, filters
kept in the URL, and live changes read from the stream, not by reading every node.

The screenshot of the 2,000-node view goes to test-artifacts/; with UPDATE_DOCS_IMAGES=1
also to docs/images/ (the one docs/dashboard-and-metrics.md shows).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, expect

from bench.dashboard import JOBS, Fleet, fleet_nodes, open_dashboard, serving
from tests.http import http
from tests.test_dashboard import ARTIFACTS, browser

__all__ = ["browser"]  # the module's Chromium fixture

DOCS_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
OPERATOR = {"Authorization": "Bearer bench-operator-token"}
SCREEN = {"width": 1600, "height": 1000}
LOST = 10


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Fleet]]:
    with (
        serving(tmp_path_factory.mktemp("fleet")) as served,
        Fleet(served.port, fleet_nodes()) as running,
    ):
        deadline = time.monotonic() + 60
        while len(http.get(f"{served.url}/api/v1/nodes", headers=OPERATOR).json()) < 2000:
            assert time.monotonic() < deadline, "the fleet did not register"
            time.sleep(0.5)
        yield served.url, running


def test_two_thousand_nodes_on_one_screen_and_the_lost_ones_named(
    browser: Browser, fleet: tuple[str, Fleet]
) -> None:
    url, running = fleet
    page = open_dashboard(browser, url, **SCREEN)
    try:
        # Every request the page makes for nodes, to tell a full read from one node's.
        reads: list[str] = []
        page.on("request", lambda r: reads.append(r.url) if "/api/v1/nodes" in r.url else None)
        summary = page.locator("#nodes-summary")
        # (On a loaded machine a few may be late: counted as suspect, or even lost.)
        expect(summary).to_have_text(re.compile(r"^2000 nodes: .*80 spare, \d+ healthy\.$"))
        # The compact view: a canvas per job (and one for the spares), no card per node.
        groups = page.locator("#node-map .job-group")
        expect(groups).to_have_count(len(JOBS) + 1)
        expect(page.locator("#nodes li")).to_have_count(0)
        expect(groups.first.locator("h3")).to_contain_text("Job train-a · 1024 nodes")
        # All of them on one 1600x1000 screen, page header included.
        bottom = page.evaluate(
            "Math.max(...[...document.querySelectorAll('#node-map canvas')]"
            ".map(c => c.getBoundingClientRect().bottom))"
        )
        assert bottom <= SCREEN["height"], bottom
        assert page.evaluate("document.querySelectorAll('#node-map *').length") < 20

        # Ten nodes of train-b go silent: named at the top, within moments of their loss.
        victims = [n.name for n in fleet_nodes() if n.job == "train-b"][:LOST]
        running.silence(victims)
        for name in victims:
            expect(page.locator(f"#attention-list li[data-node='{name}']")).to_contain_text(
                f"{name} lost", timeout=90_000
            )
        expect(summary).to_have_text(re.compile(r"^2000 nodes: \d+ failed, .*80 spare"))
        failed = int(page.locator("#node-counts .failed strong").inner_text())
        assert failed >= LOST
        # Read one by one as the stream named them, not by reading all 2,000 again.
        one_by_one = {u.rsplit("/", 1)[1] for u in reads if "/nodes/" in u}
        assert set(victims) <= one_by_one, reads
        lags = page.evaluate(
            "names => names.map(n => window.supervisorDashboard.nodes.statusSeen.get(n).at)",
            victims,
        )
        events = http.get(
            f"{url}/api/v1/events",
            params={"type": "host_heartbeat_lost", "limit": 100},
            headers=OPERATOR,
        ).json()["items"]
        raised = {e["node"]: e["time"] for e in events}
        assert set(victims) <= set(raised)
        print("shown after the loss event (ms):", _lags(lags, victims, raised))

        # Failed first: the first cell of train-b's grid is a lost node; its name on hover.
        canvas = page.locator("#node-map canvas[data-job='train-b']")
        box = canvas.bounding_box()
        assert box is not None
        page.mouse.move(box["x"] + 3, box["y"] + 3)
        tip = page.locator("#node-tip")
        expect(tip).to_be_visible()
        expect(tip).to_contain_text("lost · train-b")
        page.mouse.move(box["x"] + 3, box["y"] + 3)
        page.mouse.click(box["x"] + 3, box["y"] + 3)
        expect(page.locator("#node-detail .node")).to_have_attribute("data-state", "lost")
        page.mouse.move(0, 0)
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / "dashboard-fleet-2000.png"
        page.screenshot(path=str(path))  # the screen as on-call sees it
        if os.environ.get("UPDATE_DOCS_IMAGES") == "1":
            DOCS_IMAGES.mkdir(exist_ok=True)
            shutil.copy(path, DOCS_IMAGES / "dashboard-fleet-2000.png")
    finally:
        page.close()


def _lags(at_ms: list[float], names: list[str], raised: dict[str, str]) -> list[float]:
    from datetime import datetime

    return [
        round(at - datetime.fromisoformat(raised[n]).timestamp() * 1000)
        for at, n in zip(at_ms, names, strict=True)
    ]


def test_filters_are_kept_in_the_url(browser: Browser, fleet: tuple[str, Fleet]) -> None:
    url, _ = fleet
    page = open_dashboard(browser, url, **SCREEN)
    try:
        page.select_option("#nf-job", "train-c")
        page.fill("#nf-name", "node-17")
        shown = re.compile(r"^100 of 2000 nodes: ")
        expect(page.locator("#nodes-summary")).to_have_text(shown)
        assert "job=train-c" in page.url and "node=node-17" in page.url
        # A link to it shows the same: the filters come back from the URL (the token is
        # still in the tab).
        page.goto(page.url)
        expect(page.locator("#nodes-summary")).to_have_text(shown)
        expect(page.locator("#nf-job")).to_have_value("train-c")
        expect(page.locator("#nf-name")).to_have_value("node-17")
        # Few enough to read: cards, each saying what the node is.
        expect(page.locator("#nodes li")).to_have_count(0)  # 100 > the cards' 48
        page.select_option("#nf-view", "cards")
        expect(page.locator("#nodes li")).to_have_count(100)
        assert "view=cards" in page.url
        page.locator("#node-counts button[data-group='spare']").click()
        expect(page.locator("#nodes-summary")).to_have_text("0 of 2000 nodes: none.")
    finally:
        page.close()
