"""The live stream (GET /api/v1/stream) and the hub behind it.

The HTTP tests run the real app under uvicorn on 127.0.0.1 (a thread of this process,
so a test can reach the hub) and read the stream over real sockets: httpx cannot stream
an endless response through its ASGI transport.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from supervisor.api.app import create_app
from supervisor.config import Settings
from supervisor.domain import Event, EventType, utcnow
from supervisor.live_hub import Hub, Message, Resync
from supervisor.local.ports import free_port
from supervisor.runtime import Supervisor
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.http import http
from tests.test_api import heartbeat
from tests.test_e2e import serving

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


# --- the hub ---------------------------------------------------------------------------


def _event(n: int) -> Event:
    return Event(EventType.GPU_XID, utcnow(), node="n1", job="j1", details={"code": n}, id=n)


async def test_hub_replays_what_a_reader_missed_and_asks_for_resync_otherwise() -> None:
    hub = Hub(history=4)
    first, initial = hub.subscribe()
    assert initial == [Resync(hub.head)]  # a new reader loads from the API first
    for n in range(1, 4):
        hub.event(_event(n))
    seen = [item for item in first.drain() if isinstance(item, Message)]
    assert [m.item.id for m in seen if isinstance(m.item, Event)] == [1, 2, 3]
    hub.unsubscribe(first)

    _, replay = hub.subscribe(seen[0].id)
    assert [m.id for m in replay] == [seen[1].id, seen[2].id]
    _, nothing_missed = hub.subscribe(hub.head)
    assert nothing_missed == []

    for n in range(4, 10):
        hub.event(_event(n))  # the ring (4) no longer holds what came after seen[0]
    _, too_old = hub.subscribe(seen[0].id)
    assert too_old == [Resync(hub.head)]
    _, other_process = hub.subscribe("0000beef.3")
    assert other_process == [Resync(hub.head)]
    _, from_the_future = hub.subscribe(f"{hub.epoch}.999")
    assert from_the_future == [Resync(hub.head)]
    _, garbage = hub.subscribe("not an id")
    assert garbage == [Resync(hub.head)]


async def test_a_reader_that_falls_behind_loses_its_backlog_not_the_publisher() -> None:
    hub = Hub(queue_limit=8)
    slow, _ = hub.subscribe()
    fast, _ = hub.subscribe()
    list(slow.drain())
    list(fast.drain())
    started = time.perf_counter()
    for n in range(1, 1001):
        hub.event(_event(n))  # synchronous: publishing cannot wait for anyone
        if n % 4 == 0:
            list(fast.drain())  # this reader keeps up
        assert len(slow.backlog) <= 8
    assert time.perf_counter() - started < 5  # generous: it is microseconds per message
    backlog = list(slow.drain())
    assert isinstance(backlog[0], Resync)  # told to reload ...
    assert all(isinstance(m, Message) for m in backlog[1:])  # ... then it goes on
    assert slow.dropped > 900
    assert fast.dropped == 0
    assert hub.subscribers == 2


async def test_closing_the_hub_ends_every_subscription() -> None:
    hub = Hub()
    subscription, _ = hub.subscribe()
    waiter = asyncio.create_task(subscription.wait())
    hub.close()
    await asyncio.wait_for(waiter, 5)
    assert subscription.closed
    assert hub.subscribers == 0


# --- over HTTP ---------------------------------------------------------------------------


@contextmanager
def running(settings: Settings, hub: Hub | None = None) -> Iterator[tuple[str, Supervisor]]:
    supervisor = Supervisor(settings)
    if hub is not None:
        supervisor.hub = hub
    app = create_app(settings, supervisor)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", supervisor
    finally:
        supervisor.hub.close_threadsafe()  # as `supervisor serve` does on SIGTERM
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "server did not stop"


async def frames(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Server-sent events as dicts: id, event, data (parsed JSON)."""
    fields: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line:
            if "data" in fields:
                fields["data"] = json.loads(fields["data"])
                yield fields
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


@asynccontextmanager
async def stream(
    client: httpx.AsyncClient, last_id: str | None = None
) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    headers = dict(OPERATOR)
    if last_id is not None:
        headers["Last-Event-ID"] = last_id
    async with client.stream("GET", "/api/v1/stream", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        yield frames(response).__aiter__()


async def until(
    messages: AsyncIterator[dict[str, Any]],
    done: Callable[[list[dict[str, Any]]], bool],
    within: float = 20,
) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(within):
        async for message in messages:
            seen.append(message)
            if done(seen):
                return seen
    raise AssertionError(f"stream ended early: {seen}")


def _quiet(make_settings: SettingsFactory, **overrides: Any) -> Settings:
    """No heartbeat deadlines firing during a test: only the faults it injects."""
    values: dict[str, Any] = {"heartbeat_polling_period_s": 5, "heartbeat_timeout_s": 60}
    values.update(overrides)
    return make_settings(**values)


async def _cluster(client: httpx.AsyncClient) -> None:
    for body in (heartbeat("n1"), heartbeat("n2"), heartbeat("s1", job=None)):
        r = await client.post("/api/v1/heartbeats", json=body, headers=AGENT)
        assert r.status_code in (202, 204), r.text  # 202 when it raised an event


async def _xid(client: httpx.AsyncClient, code: int, node: str = "n1") -> int:
    r = await client.post(
        "/api/v1/faults", json={"kind": "xid", "node": node, "code": code}, headers=OPERATOR
    )
    assert r.status_code == 201, r.text
    fault_id: int = r.json()["id"]
    return fault_id


async def _settled(client: httpx.AsyncClient, fault_id: int) -> dict[str, Any]:
    """The fault once every action it caused has finished."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        fault = (await client.get(f"/api/v1/faults/{fault_id}", headers=OPERATOR)).json()
        actions = [
            (await client.get(f"/api/v1/actions/{a}", headers=OPERATOR)).json()
            for a in fault["actions"]
        ]
        if actions and all(a["status"] in ("succeeded", "failed") for a in actions):
            result: dict[str, Any] = fault
            return result
        await asyncio.sleep(0.05)
    raise AssertionError(f"actions of fault {fault_id} did not finish")


async def test_stream_needs_the_operator_token(make_settings: SettingsFactory) -> None:
    with running(_quiet(make_settings)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.get("/api/v1/stream")
            assert r.status_code == 401
            assert r.headers["www-authenticate"] == "Bearer"
            r = await client.get("/api/v1/stream", headers=AGENT)  # the agent's is not it
            assert r.status_code == 401
            r = await client.get("/api/v1/info", headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401


async def test_a_last_event_id_too_long_gets_a_422_naming_it(
    make_settings: SettingsFactory,
) -> None:
    """The stream is left out of the property-based run (it never ends): its one input."""
    with running(_quiet(make_settings)) as (url, supervisor):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            headers = {**OPERATOR, "Last-Event-ID": "9" * 65}
            r = await client.get("/api/v1/stream", headers=headers)
            assert r.status_code == 422
            assert (
                r.json()["message"]
                == "header.last-event-id: String should have at most 64 characters"
            )
            assert supervisor.hub.subscribers == 0


async def test_stream_is_open_when_reads_need_no_token(make_settings: SettingsFactory) -> None:
    with running(_quiet(make_settings, read_requires_token=False)) as (url, supervisor):
        async with (
            httpx.AsyncClient(base_url=url, timeout=10) as client,
            client.stream("GET", "/api/v1/stream") as response,
        ):
            assert response.status_code == 200
            first = await anext(frames(response).__aiter__())
            assert first["event"] == "resync"
            assert first["id"] == supervisor.hub.head
            info = (await client.get("/api/v1/info")).json()
            assert info["operator"] is False  # open reads, but no rights to inject
            assert (await client.get("/api/v1/info", headers=OPERATOR)).json()["operator"]


async def test_events_and_action_changes_arrive_as_the_api_shows_them(
    make_settings: SettingsFactory,
) -> None:
    with running(_quiet(make_settings)) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await _cluster(client)
            async with stream(client) as messages:
                first = await anext(messages)
                assert first["event"] == "resync"
                fault_id = await _xid(client, 79)

                def finished(seen: list[dict[str, Any]]) -> bool:
                    actions = {m["data"]["id"]: m["data"] for m in seen if m["event"] == "action"}
                    return any(a["type"] == "hot_swap" for a in actions.values()) and all(
                        a["status"] in ("succeeded", "failed") for a in actions.values()
                    )

                seen = await until(messages, finished)
            events = [m["data"] for m in seen if m["event"] == "event"]
            assert [(e["type"], e["node"], e["fault_id"]) for e in events] == [
                ("gpu_xid", "n1", fault_id)
            ]
            stored = await client.get(f"/api/v1/events/{events[0]['id']}", headers=OPERATOR)
            assert events[0] == stored.json()
            # Each action is seen pending (as decided), running, then finished, in order.
            by_action: dict[int, list[str]] = {}
            for m in seen:
                if m["event"] == "action":
                    by_action.setdefault(m["data"]["id"], []).append(m["data"]["status"])
                    assert m["data"]["event_id"] == events[0]["id"]
                    assert m["data"]["fault_id"] == fault_id
            assert by_action and all(
                statuses == ["pending", "running", "succeeded"] for statuses in by_action.values()
            ), by_action
            last = {m["data"]["id"]: m["data"] for m in seen if m["event"] == "action"}
            for action_id, data in last.items():
                stored = await client.get(f"/api/v1/actions/{action_id}", headers=OPERATOR)
                assert data == stored.json()
            ids = [int(m["id"].split(".")[1]) for m in seen]
            assert ids == list(range(ids[0], ids[0] + len(ids)))  # nothing skipped


async def test_reconnecting_with_the_last_id_replays_what_was_missed(
    make_settings: SettingsFactory,
) -> None:
    with running(_quiet(make_settings)) as (url, supervisor):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await _cluster(client)
            async with stream(client) as messages:
                last_id = (await anext(messages))["id"]
            # While nobody listens: two faults, their events and actions.
            faults = [await _xid(client, 79), await _xid(client, 48, node="n2")]
            caused = [await _settled(client, f) for f in faults]
            head = supervisor.hub.head
            async with stream(client, last_id) as messages:
                replay = await until(messages, lambda seen: seen[-1]["id"] == head)
            assert all(m["event"] in ("event", "action") for m in replay)  # no resync
            assert {m["data"]["id"] for m in replay if m["event"] == "event"} == {
                e for f in caused for e in f["events"]
            }
            assert {m["data"]["id"] for m in replay if m["event"] == "action"} == {
                a for f in caused for a in f["actions"]
            }
            seqs = [int(m["id"].split(".")[1]) for m in replay]
            assert seqs == list(range(int(last_id.split(".")[1]) + 1, seqs[-1] + 1))

            # An id from before a restart (another epoch) cannot be replayed: resync.
            async with stream(client, "0badc0de.5") as messages:
                assert (await anext(messages))["event"] == "resync"


async def test_a_stalled_reader_does_not_hold_up_the_supervisor(
    make_settings: SettingsFactory,
) -> None:
    """A reader that stops reading (its socket full) is dropped to a resync; the runtime,
    heartbeats, fault injection and the other readers carry on."""
    hub = Hub(queue_limit=256)
    with running(_quiet(make_settings), hub) as (url, supervisor):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await _cluster(client)
            fault_id = await _xid(client, 79)
            fault = (await client.get(f"/api/v1/faults/{fault_id}", headers=OPERATOR)).json()
            record = supervisor.store.get_event(fault["events"][0])
            assert record is not None

            stalled = socket.socket()
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            host, port = url.removeprefix("http://").split(":")
            stalled.connect((host, int(port)))
            stalled.sendall(
                b"GET /api/v1/stream HTTP/1.1\r\nHost: test\r\n"
                + f"Authorization: Bearer {OPERATOR_TOKEN}\r\n\r\n".encode()
            )
            deadline = time.monotonic() + 10
            while hub.subscribers < 1:
                assert time.monotonic() < deadline, "the stalled reader never subscribed"
                await asyncio.sleep(0.02)

            async def flood() -> None:
                # Megabytes, far more than socket buffers hold: a long burst of records,
                # published in batches as the runtime does.
                for _ in range(150):
                    for _ in range(100):
                        supervisor.hub.event(record)
                    await asyncio.sleep(0.01)

            async with stream(client) as messages:
                await anext(messages)  # resync: a fresh reader
                seen: list[dict[str, Any]] = []

                async def read() -> None:
                    async for message in messages:
                        seen.append(message)
                        data = message["data"]
                        if message["event"] == "event" and data["node"] == "n2":
                            return

                reader = asyncio.create_task(read())
                loop = asyncio.get_running_loop()
                flooding = loop.run_in_executor(None, on_server_loop, supervisor, flood)
                # Meanwhile the supervisor answers heartbeats at once.
                beats = 0
                while not flooding.done():
                    started = time.monotonic()
                    r = await client.post("/api/v1/heartbeats", json=heartbeat("n2"), headers=AGENT)
                    assert r.status_code in (202, 204)
                    assert time.monotonic() - started < 5
                    beats += 1
                    await asyncio.sleep(0.05)
                await flooding
                assert beats > 0
                assert all(len(s.backlog) <= 256 for s in list(hub._subscribers))
                # The reader that kept reading gets what happens next.
                await _xid(client, 48, node="n2")
                await asyncio.wait_for(reader, 60)
                assert seen[-1]["data"]["type"] == "gpu_xid"

            # The stalled reader, read at last: its backlog was dropped and it was told.
            stalled.settimeout(10)
            received = b""
            while received.count(b"event: resync") < 2:
                chunk = stalled.recv(1 << 20)
                assert chunk, "stream closed"
                received += chunk
            stalled.close()
            assert received.count(b"event: event") < 15_000


def on_server_loop(supervisor: Supervisor, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine on the server's loop (the hub's) and wait for it."""
    loop = supervisor.hub._loop
    assert loop is not None
    asyncio.run_coroutine_threadsafe(fn(), loop).result(120)


def test_supervisor_serve_stops_promptly_with_a_stream_open(tmp_path: Path) -> None:
    """uvicorn waits for open responses before it stops; SIGTERM ends the streams."""
    with serving(tmp_path) as server:
        assert server.proc is not None
        with httpx.stream(
            "GET", f"{server.url}/api/v1/stream", headers=OPERATOR, timeout=30
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("retry")
            started = time.monotonic()
            server.proc.terminate()
            for _ in lines:  # the server ends the stream
                pass
            server.proc.wait(15)
            assert time.monotonic() - started < 10
            # uvicorn re-raises the signal once it has shut down cleanly.
            assert server.proc.returncode in (0, -signal.SIGTERM)


def test_dashboard_files_are_served_without_a_token(tmp_path: Path) -> None:
    with serving(tmp_path) as server:
        for path in ("/", "/static/js/main.js", "/static/app.css"):
            r = http.get(f"{server.url}{path}", timeout=10)
            assert r.status_code == 200, path
            assert r.headers["cache-control"] == "no-cache"
        page = http.get(f"{server.url}/", timeout=10)
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<script type="module" src="/static/js/main.js">' in page.text
        assert "://" not in page.text  # nothing from another origin
        assert http.get(f"{server.url}/static/nope.js", timeout=10).status_code == 404
