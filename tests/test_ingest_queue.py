"""IngestQueue: heartbeats of one loop turn are parsed, then applied, together; each
request still gets its own result."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.api.routes.heartbeats import IngestQueue
from supervisor.sensor.heartbeat import HeartbeatError
from supervisor.sensor.sensor import Changes


class Recorder:
    """`parse` and `apply` for the queue: notes each call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []

    def parse(self, body: bytes) -> bytes:
        self.calls.append(("parse", body))
        if body == b"bad":
            raise HeartbeatError(("node",), "bad name")
        return body

    def apply(self, body: bytes) -> Changes:
        self.calls.append(("apply", body))
        if body == b"bug":
            raise RuntimeError("a bug")
        return Changes()

    def queue(self) -> IngestQueue[bytes]:
        return IngestQueue(self.parse, self.apply)

    @property
    def applied(self) -> list[bytes]:
        return [body for stage, body in self.calls if stage == "apply"]


def calls_when_done(future: asyncio.Future[Changes], recorder: Recorder) -> list[int]:
    """How many calls had been made when `future` got its result (filled in later)."""
    seen: list[int] = []
    future.add_done_callback(lambda _: seen.append(len(recorder.calls)))
    return seen


async def test_a_turn_is_parsed_then_applied_in_order() -> None:
    recorder = Recorder()
    queue = recorder.queue()
    futures = [queue.submit(b) for b in (b"a", b"bad", b"b", b"bug", b"c")]
    first_done = calls_when_done(futures[0], recorder)
    assert recorder.calls == []  # never while the submitters are still running
    await asyncio.wait(futures)
    assert recorder.calls == [
        *(("parse", b) for b in (b"a", b"bad", b"b", b"bug", b"c")),
        *(("apply", b) for b in (b"a", b"b", b"bug", b"c")),  # the refused one is not
    ]
    assert first_done == [9]  # one flush did it all before anyone resumed
    # Each submitter gets its own outcome; one failure does not touch the others.
    assert isinstance(futures[0].result(), Changes)
    with pytest.raises(HeartbeatError):
        futures[1].result()
    with pytest.raises(RuntimeError, match="a bug"):
        futures[3].result()
    assert isinstance(futures[4].result(), Changes)


async def test_a_later_turn_gets_a_flush_of_its_own() -> None:
    recorder = Recorder()
    queue = recorder.queue()
    first = queue.submit(b"a")
    first_done = calls_when_done(first, recorder)
    await first
    later = [queue.submit(b"b"), queue.submit(b"c")]
    later_done = calls_when_done(later[0], recorder)
    await asyncio.gather(*later)
    assert recorder.applied == [b"a", b"b", b"c"]
    assert (first_done, later_done) == ([2], [6])


async def test_a_cancelled_request_is_not_applied() -> None:
    """A request cancelled before its turn ended was never acknowledged: no change."""
    recorder = Recorder()
    queue = recorder.queue()
    gone = queue.submit(b"gone")
    kept = queue.submit(b"kept")
    gone.cancel()
    await kept
    assert recorder.calls == [("parse", b"kept"), ("apply", b"kept")]
