"""The database goes away under a running `supervisor serve`, and comes back.

PostgreSQL: a private server started from this machine's PostgreSQL binaries, in a
temporary directory on a free port, stopped the way a crash stops it (`pg_ctl stop -m
immediate`: no shutdown checkpoint, connections cut) while nodes heartbeat, then started
again. SQLite: its file on a small tmpfs filled to the last byte, then given room again.

What is promised and checked:
- detection keeps working: heartbeats that change nothing are acknowledged (204), and a
  node that falls silent is found lost;
- what cannot be stored is not acknowledged: a heartbeat that raised an event gets 503
  (its events are held in memory), an operator's action gets 503 and is not recorded;
- once the database is back, the events held are written in the order they were raised,
  and the policy handles them;
- nothing acknowledged is lost: what the API acknowledged before the outage is there.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.postgres import PrivatePostgres, running_postgres
from tests.test_api import heartbeat
from tests.test_e2e import AGENT, OPERATOR, Server
from tests.timing import scaled


@pytest.fixture
def postgres() -> Iterator[PrivatePostgres]:
    with running_postgres() as server:
        yield server


def wait_for(predicate: Callable[[], Any], within: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + scaled(within)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def crashed(node: str) -> dict[str, Any]:
    """A heartbeat of `node` whose first worker has just exited (an event)."""
    body = heartbeat(node)
    body["workers"][0].update(state="exited", exit_code=137)
    return body


def ready(client: httpx.Client) -> bool:
    return client.get("/readyz").status_code == 200


def events(client: httpx.Client) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.get("/api/v1/events", headers=OPERATOR).json()["items"]
    return items[::-1]  # oldest first


def outage_and_back(
    server: Server,
    take_away: Callable[[], None],
    give_back: Callable[[], None],
    *,
    unreachable: bool,
) -> None:
    """`unreachable`: the database cannot even be read (a server down), so the
    supervisor is not ready meanwhile; a full disk still reads."""
    with httpx.Client(base_url=server.url, timeout=10) as client:

        def beat(node: str, body: dict[str, Any] | None = None) -> httpx.Response:
            sent = body if body is not None else heartbeat(node)
            return client.post("/api/v1/heartbeats", json=sent, headers=AGENT)

        for node in ("n1", "n2", "n3"):
            assert beat(node).status_code in (202, 204)
        before = client.post(
            "/api/v1/actions", json={"type": "cordon", "node": "n3"}, headers=OPERATOR
        )
        assert before.status_code == 202, before.text  # acknowledged: it must survive

        take_away()
        # Detection goes on: heartbeats that change nothing are acknowledged.
        assert beat("n1").status_code == 204
        # An event cannot be stored: not acknowledged, held in memory.
        refused = beat("n2", crashed("n2"))
        assert refused.status_code == 503, refused.text
        assert "held in memory" in refused.json()["message"]
        assert refused.headers["retry-after"] == "1"
        # An operator's request is refused whole.
        action = client.post(
            "/api/v1/actions", json={"type": "cordon", "node": "n1"}, headers=OPERATOR
        )
        assert action.status_code == 503, action.text
        assert action.json()["message"].startswith("database unavailable")
        assert ready(client) is not unreachable
        # n3 falls silent: found lost meanwhile; n1 and n2 keep beating, to the end.
        codes: set[int] = set()
        stop = threading.Event()

        def keep_beating() -> None:
            with httpx.Client(base_url=server.url, timeout=10) as own:
                while not stop.is_set():
                    for body in (heartbeat("n1"), crashed("n2")):
                        sent = own.post("/api/v1/heartbeats", json=body, headers=AGENT)
                        codes.add(sent.status_code)
                    time.sleep(0.1)

        beating = threading.Thread(target=keep_beating, daemon=True)
        beating.start()
        try:
            time.sleep(3.0)
            give_back()
            _after_the_outage(client)
        finally:
            stop.set()
            beating.join(10)
        assert codes <= {202, 204, 503}, codes  # acknowledged or held, nothing else
        # n1 was never lost: its heartbeats were taken all along.
        assert not [e for e in events(client) if e["node"] == "n1"]


def _after_the_outage(client: httpx.Client) -> None:
    wait_for(lambda: ready(client), what="the supervisor to find its database again")
    recorded = wait_for(
        lambda: (
            [e for e in events(client) if e["node"] in ("n2", "n3")][:2]
            if len([e for e in events(client) if e["node"] in ("n2", "n3")]) >= 2
            else None
        ),
        what="the events held to be written",
    )
    # In the order they were raised: the crash first, the silence after.
    assert [(e["type"], e["node"]) for e in recorded] == [
        ("worker_exited", "n2"),
        ("host_heartbeat_lost", "n3"),
    ]
    assert recorded[0]["id"] < recorded[1]["id"]
    assert recorded[0]["time"] <= recorded[1]["time"]

    def handled() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = client.get(
            "/api/v1/actions", params={"event_id": recorded[0]["id"]}, headers=OPERATOR
        ).json()["items"]
        return items

    assert wait_for(handled, what="the policy to handle the crash")
    actions = client.get("/api/v1/actions", headers=OPERATOR).json()["items"]
    cordons = [(a["type"], a["node"]) for a in actions if a["type"] == "cordon"]
    assert cordons == [("cordon", "n3")]  # the one acknowledged, not the refused one


def test_postgresql_crash_and_restart(tmp_path: Path, postgres: PrivatePostgres) -> None:
    server = Server(tmp_path, database_url=postgres.url, heartbeat_timeout_s=1.0)
    server.start()
    try:
        outage_and_back(server, postgres.crash, postgres.start, unreachable=True)
    finally:
        server.stop()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_sqlite_on_a_full_disk(tmp_path: Path, small_disk: Path) -> None:
    server = Server(
        tmp_path, database_url=f"sqlite:///{small_disk}/supervisor.db", heartbeat_timeout_s=1.0
    )
    server.start()
    filler = small_disk / "filler"

    def fill() -> None:
        # To the last byte: chunks, then single bytes, until the file system refuses.
        with filler.open("wb", buffering=0) as f:
            for size in (1 << 20, 4096, 1):
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * size)

    try:
        outage_and_back(server, fill, lambda: filler.unlink(), unreachable=False)
    finally:
        server.stop()
