"""Heartbeats cost no SQL statement once a fleet is steady, however unevenly they arrive.

A node's heartbeat that only moves its workers' steps and its last-seen time is kept in
memory: the store is written when something changes that a restart must know (a node's
or a worker's state, a job's membership, an event). This drives the real app over ASGI,
with its lifespan, on SQLite and PostgreSQL: a job's nodes report one shared step that
advances as a synchronous job's does, each node at intervals drawn between a tenth of
the heartbeat timeout and half of it (a congested network, a paused host monitor), and
every statement the engine sends is counted with SQLAlchemy's cursor events.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from sqlalchemy import event

from tests.conftest import SettingsFactory
from tests.test_api import Api, heartbeat, running

NODES = 24
TIMEOUT_S = 4.0
#: How long the fleet beats while statements are counted.
WINDOW_S = 5.0


class Statements:
    """Every statement the engine sends, by its first word, from when it is attached."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.seen.append(statement.lstrip().split(None, 1)[0].upper())

    def writes(self) -> list[str]:
        return [s for s in self.seen if s in ("INSERT", "UPDATE", "DELETE")]


async def test_uneven_heartbeats_with_advancing_steps_write_nothing(
    make_settings: SettingsFactory, database_url: str
) -> None:
    counted = Statements()
    settings = make_settings(
        database_url=database_url,
        heartbeat_timeout_s=TIMEOUT_S,
        heartbeat_polling_period_s=0.5,
    )
    async with running(settings) as api:
        started = time.monotonic()

        def step() -> int:  # the job's one step, as every rank of a synchronous job has it
            return 10 + int((time.monotonic() - started) / 0.05)

        # The fleet joins (each join is written), then settles.
        for n in range(NODES):
            assert (await api.beat(heartbeat(f"n{n}", step=step()))).status_code == 204
        await api.settle()
        await beat_unevenly(api, step, seconds=1.0)
        await api.settle()

        engine = api.supervisor.store.engine
        event.listen(engine, "before_cursor_execute", counted)
        try:
            beats = await beat_unevenly(api, step, seconds=WINDOW_S)
            await api.settle()
        finally:
            event.remove(engine, "before_cursor_execute", counted)

        assert beats >= NODES * WINDOW_S / (TIMEOUT_S / 2), beats  # every node beat often
        nodes = await api.get("/api/v1/nodes")
        items = nodes["items"] if isinstance(nodes, dict) else nodes
        assert len(items) == NODES and all(n["alive"] for n in items), items
        assert (await api.get("/api/v1/events", limit=100))["items"] == [], "no event raised"
        # What the job learns of its step intervals is kept (a new longest interval, a
        # few times in a run); nothing else is written while the fleet just trains.
        writes = counted.writes()
        assert len(writes) <= 3, (beats, writes)


async def beat_unevenly(api: Api, step: Any, *, seconds: float) -> int:
    """Every node beats for `seconds`, each pause drawn anew between a tenth of the
    heartbeat timeout and half of it; the number of heartbeats sent."""
    rng = random.Random(7)
    deadline = time.monotonic() + seconds
    sent = 0

    async def node(name: str) -> None:
        nonlocal sent
        await asyncio.sleep(rng.uniform(0, TIMEOUT_S / 10))
        while time.monotonic() < deadline:
            response = await api.beat(heartbeat(name, step=step()))
            assert response.status_code == 204, response.text
            sent += 1
            await asyncio.sleep(rng.uniform(TIMEOUT_S / 10, TIMEOUT_S / 2))

    await asyncio.gather(*(node(f"n{n}") for n in range(NODES)))
    return sent
