"""The fleet-shaped ingest bench (bench/fleet.py) on a small fleet, with real processes:
the supervisor restores the nodes written in its database and answers their beats
without a loss, both servers answer the same beats, and the supervisor's SQL statements
are counted in its process (a registration is counted, a steady beat is not; the history
pruner's passes apart, being no steady rate)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.fleet import Group, Phase, run_group
from bench.fleet import _sql_counts as sql_counts
from bench.fleet import _statements as statements
from bench.ingest import AGENT_TOKEN, _stop
from bench.payload import heartbeat_json
from tests.timing import scaled


def test_a_small_fleet_is_measured_on_both_servers_without_errors() -> None:
    # 40 nodes of 2 workers every 0.5 s, late by up to 0.2 s: about 80 beats a second.
    # Lost after 3 s of silence (scaled): beside two CPU burners the load generator itself
    # was held up past 1.5 s, and every node was lost once.
    period_s = 0.5
    group = Group(
        "sqlite", 2, 4, (Phase(40, 0.2, period_s, timeout_periods=scaled(3.0) / period_s),)
    )
    (window,) = run_group(group, duration_s=2.0, settle_s=1.0)
    assert window.errors == 0
    expected = 40 / 0.5 * window.seconds
    for answered in (window.heartbeats, window.bare_heartbeats):
        assert 0.5 * expected <= answered <= 1.5 * expected
    assert window.cpu_s > 0 and window.bare_cpu_s > 0
    # No node was lost (a loss is an event: a write), and beats write nothing.
    assert window.statements <= 2 * window.seconds


def test_the_statement_count_sees_a_registration_and_not_a_steady_beat(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/supervisor.db"
    fleet = '{"period_s": 5, "timeout_s": 15}'
    cmd = [sys.executable, "-m", "bench.server", "--app", "supervisor", "--count-sql"]
    cmd += ["--database-url", url, "--agent-token", AGENT_TOKEN, "--fleet", fleet]
    server: subprocess.Popen[str] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(200):
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            else:
                pytest.fail("the supervisor did not become ready")
            auth = {"Authorization": f"Bearer {AGENT_TOKEN}"}

            def beat(step: int) -> None:
                body = heartbeat_json(7, step, workers=2, job="fleet-000", first_rank=0)
                reply = client.post("/api/v1/heartbeats", content=body, headers=auth)
                assert reply.status_code in (202, 204), reply.text

            def count() -> int:
                return statements(server)

            before = count()
            beat(1)  # registers the node: its row (and its job's) written
            registered = count()
            assert registered > before
            beat(2)
            beat(3)
            assert count() == registered
    finally:
        _stop(server)


def test_the_history_pruners_statements_are_counted_apart(tmp_path: Path) -> None:
    """A window that catches the pruner's pass (a minute after the start, then hourly)
    does not count its statements as the steady rate: they are counted apart."""
    url = f"sqlite:///{tmp_path}/supervisor.db"
    cmd = [sys.executable, "-m", "bench.server", "--app", "supervisor", "--count-sql"]
    cmd += ["--database-url", url, "--fleet", '{"period_s": 5, "timeout_s": 15}']
    # A pass every 0.5 s (the first 0.5 s after the start): several within the test.
    env = {**os.environ, "SUPERVISOR_HISTORY_PRUNE_PERIOD_S": "0.5"}
    server: subprocess.Popen[str] = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert server.stdout is not None
        int(server.stdout.readline())  # its port: it serves
        started = time.monotonic()
        while (counts := sql_counts(server))[1] < 20:
            assert time.monotonic() - started < 30, f"no pruner pass counted: {counts}"
            time.sleep(0.2)
        others, pruner = counts
        time.sleep(1.5)  # three more passes
        later_others, later_pruner = sql_counts(server)
        assert later_pruner > pruner
        # The scheduler's reads as it wakes for the pruner (two a pass) count as the
        # pruner's: the idle supervisor's own statements move little, if at all.
        assert later_pruner - pruner >= 6
        assert later_others - others < (later_pruner - pruner) / 4
        assert statements(server) == sql_counts(server)[0]
    finally:
        _stop(server)


def test_the_goodput_samples_of_many_jobs_are_one_statement(tmp_path: Path) -> None:
    """A fleet of many jobs sends no more statements a sampling period than one of few:
    every job's sample goes in one INSERT (executemany), all of them stored."""
    from datetime import UTC, datetime

    from sqlalchemy import event, func, select
    from sqlalchemy.engine import Engine

    from supervisor.domain import ProgressSample
    from supervisor.store import open_store
    from supervisor.store.models import ProgressSampleRow

    store = open_store(f"sqlite:///{tmp_path}/supervisor.db")
    sent: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        sent.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        now = datetime.now(UTC)
        store.record_progress_samples(
            [ProgressSample(job=f"job-{j:02d}", step=j, time=now) for j in range(25)]
        )
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    inserts = [s for s in sent if s.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1, inserts
    with store.engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(ProgressSampleRow)) == 25
    store.close()
