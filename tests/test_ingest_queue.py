"""IngestQueue: heartbeats of one loop turn are applied together, each with its own result."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.api.routes.heartbeats import IngestQueue
from supervisor.sensor.heartbeat import HeartbeatError
from supervisor.sensor.sensor import Changes


class Recorder:
    """`apply` for the queue: notes each body it is given."""

    def __init__(self) -> None:
        self.applied: list[bytes] = []

    def __call__(self, body: bytes) -> Changes:
        self.applied.append(body)
        if body == b"bad":
            raise HeartbeatError(("node",), "bad name")
        if body == b"bug":
            raise RuntimeError("a bug")
        return Changes()


def applied_when_done(future: asyncio.Future[Changes], recorder: Recorder) -> list[int]:
    """How many bodies had been applied when `future` got its result (filled in later)."""
    seen: list[int] = []
    future.add_done_callback(lambda _: seen.append(len(recorder.applied)))
    return seen


async def test_bodies_of_one_turn_are_applied_together_in_order() -> None:
    recorder = Recorder()
    queue = IngestQueue(recorder)
    futures = [queue.submit(b) for b in (b"a", b"bad", b"b", b"bug", b"c")]
    first_done = applied_when_done(futures[0], recorder)
    assert recorder.applied == []  # never while the submitters are still running
    await asyncio.wait(futures)
    assert recorder.applied == [b"a", b"bad", b"b", b"bug", b"c"]
    assert first_done == [5]  # one flush applied them all before anyone resumed
    # Each submitter gets its own outcome; one failure does not touch the others.
    assert isinstance(futures[0].result(), Changes)
    with pytest.raises(HeartbeatError):
        futures[1].result()
    with pytest.raises(RuntimeError, match="a bug"):
        futures[3].result()
    assert isinstance(futures[4].result(), Changes)


async def test_a_later_turn_gets_a_flush_of_its_own() -> None:
    recorder = Recorder()
    queue = IngestQueue(recorder)
    first = queue.submit(b"a")
    first_done = applied_when_done(first, recorder)
    await first
    later = [queue.submit(b"b"), queue.submit(b"c")]
    later_done = applied_when_done(later[0], recorder)
    await asyncio.gather(*later)
    assert recorder.applied == [b"a", b"b", b"c"]
    assert (first_done, later_done) == ([1], [3])


async def test_a_cancelled_request_is_not_applied() -> None:
    """A request cancelled before its turn ended was never acknowledged: no change."""
    recorder = Recorder()
    queue = IngestQueue(recorder)
    gone = queue.submit(b"gone")
    kept = queue.submit(b"kept")
    gone.cancel()
    await kept
    assert recorder.applied == [b"kept"]
