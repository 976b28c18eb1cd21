"""Maintenance windows on the dashboard, in a real headless Chromium against `supervisor
serve` with nodes heartbeating over HTTP: the open and upcoming windows listed in the
nodes panel, the node under an open window marked on its card, both kept current from
the live stream (a window's start and end are actions), and a window cancelled from the
page. The list is read as a whole, a few times, never once per node.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from playwright.sync_api import Browser, expect

from tests.test_dashboard import api, browser, cluster, dashboard, shot

__all__ = ["browser"]  # the module's Chromium fixture


def at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def test_open_and_upcoming_windows_are_shown_live_and_cancelled_from_the_page(
    browser: Browser, tmp_path: Path
) -> None:
    with cluster(tmp_path) as server, dashboard(browser, server) as page:
        reads: list[str] = []
        page.on("request", lambda r: reads.append(r.url) if "/maintenance" in r.url else None)
        panel = page.locator("#maintenance")
        expect(panel).to_be_hidden()  # no window: nothing takes room above the nodes

        later = api(
            server,
            "POST",
            "/api/v1/maintenance",
            json={"node": "n2", "start": at(3600), "end": at(7200), "reason": "bios"},
        )
        now = api(
            server,
            "POST",
            "/api/v1/maintenance",
            json={"node": "s1", "start": at(0), "end": at(3600), "reason": "firmware"},
        )
        # The window opening now cordons s1: that action, on the stream, brings the list
        # (both windows) to the page, and s1's card is marked.
        expect(panel).to_be_visible()
        expect(page.locator("#maintenance-title")).to_have_text("Maintenance: 1 open, 1 to come")
        opened = page.locator(f"#maintenance-list li[data-window='{now['id']}']")
        expect(opened).to_have_attribute("data-state", "open")
        expect(opened).to_contain_text(re.compile(r"open s1 out until .* \(in (59|60) min\)"))
        expect(opened).to_contain_text("next: uncordon · firmware")
        coming = page.locator(f"#maintenance-list li[data-window='{later['id']}']")
        expect(coming).to_have_attribute("data-state", "scheduled")
        expect(coming).to_contain_text("scheduled n2 (j1) out from")
        expect(coming).to_contain_text("next: emergency checkpoint, hot swap, cordon · bios")

        s1 = page.locator("#nodes li[data-node='s1']")
        expect(s1).to_have_attribute("data-maintenance", "open")
        expect(s1).to_have_attribute("data-state", "cordoned")
        expect(s1.locator("h3 .badge.maintenance")).to_have_text("maintenance")
        expect(s1.locator(".notes")).to_contain_text("maintenance: out until")
        n2 = page.locator("#nodes li[data-node='n2']")
        expect(n2).to_have_attribute("data-maintenance", "scheduled")
        expect(n2.locator(".notes")).to_contain_text("maintenance from")
        expect(n2.locator("h3 .badge.maintenance")).to_have_count(0)
        expect(page.locator("#nodes li[data-node='n1']")).not_to_have_attribute(
            "data-maintenance", re.compile(".")
        )
        shot(page, "maintenance")

        # Ended from the page: s1 is uncordoned, its mark goes; the window to come stays.
        opened.get_by_role("button", name="Cancel the maintenance window on s1").click()
        expect(page.locator("#maintenance-result")).to_have_text(
            "Window on s1 ended: it is uncordoned."
        )
        expect(opened).to_have_count(0)
        expect(s1).to_have_attribute("data-state", "spare")
        expect(s1).not_to_have_attribute("data-maintenance", re.compile("."))
        expect(page.locator("#maintenance-title")).to_have_text("Maintenance: 0 open, 1 to come")
        assert [w["id"] for w in api(server, "GET", "/api/v1/maintenance")] == [later["id"]]

        coming.get_by_role("button", name="Cancel the maintenance window on n2").click()
        expect(page.locator("#maintenance-result")).to_have_text("Window on n2 cancelled.")
        expect(page.locator("#maintenance-list li")).to_have_text(["None."])
        expect(n2).not_to_have_attribute("data-maintenance", re.compile("."))
        assert api(server, "GET", "/api/v1/maintenance") == []
        # The whole list a few times (load, the stream's actions, the cancels), never
        # once per node; and nothing asked of a single window but the cancels.
        gets = [u for u in reads if u.endswith("/api/v1/maintenance")]
        assert 2 <= len(gets) <= 12, reads
        assert len(reads) - len(gets) == 2, reads
