"""DeadlineQueue: callbacks fire once a key's deadline has passed, in deadline order."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import cast

from supervisor.sensor.deadlines import DeadlineQueue
from tests.timing import scaled

# Generous upper bound for "it fires eventually" on a shared, noisy machine.
PATIENCE_S = scaled(5.0)


async def _until(predicate: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + PATIENCE_S
    while not predicate():
        if loop.time() > give_up:
            raise AssertionError(f"condition not met within {PATIENCE_S} s")
        await asyncio.sleep(0.005)


class Recorder:
    """Collects (key, deadline, loop time at firing) and lets tests wait for firings."""

    def __init__(self) -> None:
        self.fired: list[tuple[str, float, float]] = []
        self._changed = asyncio.Event()

    def __call__(self, key: str, deadline: float) -> None:
        self.fired.append((key, deadline, asyncio.get_running_loop().time()))
        self._changed.set()

    @property
    def keys(self) -> list[str]:
        return [key for key, _, _ in self.fired]

    async def wait_for(self, count: int) -> None:
        async def wait() -> None:
            while len(self.fired) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), PATIENCE_S)


async def test_fires_after_deadline_never_before() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.05
    queue.arm("a", deadline)
    assert "a" in queue
    assert queue.deadline("a") == deadline
    assert rec.fired == []  # never synchronously

    await rec.wait_for(1)

    [(key, given, fired_at)] = rec.fired
    assert key == "a"
    assert given == deadline
    assert fired_at >= deadline
    assert "a" not in queue
    assert len(queue) == 0
    queue.close()


async def test_rearm_later_fires_once_at_the_later_time() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    queue.arm("a", loop.time() + 0.05)
    later = loop.time() + 0.2
    queue.arm("a", later)  # as a heartbeat would

    await rec.wait_for(1)
    await asyncio.sleep(0.1)  # room for a (wrong) second firing

    assert len(rec.fired) == 1
    key, given, fired_at = rec.fired[0]
    assert key == "a"
    assert given == later
    assert fired_at >= later
    queue.close()


async def test_repeated_rearm_keeps_pushing_the_deadline() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    last = 0.0
    for _ in range(10):
        last = loop.time() + 0.08
        queue.arm("a", last)
        await asyncio.sleep(0.01)
        # Each re-arm came before the previous deadline (on a quiet machine), so any
        # firing so far must have been for a deadline that had actually passed.
        for _, given, fired_at in rec.fired:
            assert fired_at >= given
    # A firing in the loop above can only come from a stall longer than 0.08 s; either
    # way the last deadline set is the one that fires last.
    await _until(lambda: "a" not in queue)
    await asyncio.sleep(0.05)
    assert rec.fired[-1][1] == last
    assert all(fired_at >= given for _, given, fired_at in rec.fired)
    queue.close()


async def test_disarm_cancels() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    queue.arm("gone", loop.time() + 0.03)
    queue.arm("kept", loop.time() + 0.1)
    queue.disarm("gone")
    queue.disarm("never-armed")  # harmless
    assert "gone" not in queue

    await rec.wait_for(1)
    await asyncio.sleep(0.05)

    assert rec.keys == ["kept"]
    queue.close()


async def test_disarm_then_rearm_fires_at_the_new_deadline() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    queue.arm("a", loop.time() + 0.03)
    queue.disarm("a")
    again = loop.time() + 0.15
    queue.arm("a", again)

    await rec.wait_for(1)
    await asyncio.sleep(0.05)

    assert [(k, d) for k, d, _ in rec.fired] == [("a", again)]
    assert rec.fired[0][2] >= again
    queue.close()


async def test_earlier_rearm_fires_earlier() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    start = loop.time()
    queue.arm("a", start + 3.0)
    sooner = start + 0.05
    queue.arm("a", sooner)

    await rec.wait_for(1)  # would time out if it still waited for the 3 s deadline

    [(key, given, fired_at)] = rec.fired
    assert key == "a"
    assert given == sooner
    assert fired_at >= sooner
    assert fired_at < start + 3.0
    # The superseded, later heap entry must not fire the key a second time.
    assert len(queue) == 0
    queue.close()


async def test_many_keys_fire_in_deadline_order() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    now = loop.time()
    offsets = [0.09, 0.01, 0.05, 0.07, 0.03, 0.02, 0.08, 0.04, 0.06, 0.10]
    for i, off in enumerate(offsets):
        queue.arm(f"k{i}", now + off)
    # Move one key later and one earlier after the fact.
    queue.arm("k1", now + 0.11)  # was first, now last
    queue.arm("k0", now + 0.005)  # was near the end, now first

    await rec.wait_for(len(offsets))
    await asyncio.sleep(0.05)

    deadlines = [d for _, d, _ in rec.fired]
    assert deadlines == sorted(deadlines)
    assert rec.keys[0] == "k0"
    assert rec.keys[-1] == "k1"
    assert sorted(rec.keys) == sorted(f"k{i}" for i in range(len(offsets)))
    assert all(fired_at >= given for _, given, fired_at in rec.fired)
    queue.close()


async def test_rearm_from_the_callback_works() -> None:
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    done = asyncio.Event()

    def on_expired(key: str, deadline: float) -> None:
        fired.append(loop.time())
        if len(fired) < 3:
            queue.arm(key, loop.time() + 0.02)
        else:
            done.set()

    queue: DeadlineQueue[str] = DeadlineQueue(on_expired)
    queue.arm("periodic", loop.time() + 0.02)
    await asyncio.wait_for(done.wait(), PATIENCE_S)
    assert len(fired) == 3
    assert fired == sorted(fired)
    queue.close()


async def test_close_stops_firing() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    queue.arm("a", loop.time() + 0.02)
    queue.arm("b", loop.time() + 0.04)
    queue.close()
    queue.arm("c", loop.time() + 0.01)  # arming after close schedules nothing

    await asyncio.sleep(0.15)

    assert rec.fired == []


async def test_close_after_some_fired_stops_the_rest() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    queue.arm("first", loop.time() + 0.01)
    queue.arm("late", loop.time() + 0.3)
    await rec.wait_for(1)
    queue.close()

    await asyncio.sleep(0.4)

    assert rec.keys == ["first"]


async def test_past_deadline_fires_promptly() -> None:
    rec = Recorder()
    queue: DeadlineQueue[str] = DeadlineQueue(rec)
    loop = asyncio.get_running_loop()
    queue.arm("overdue", loop.time() - 1.0)
    await rec.wait_for(1)
    assert rec.keys == ["overdue"]
    queue.close()


async def test_an_owner_can_move_deadlines_on_without_arming() -> None:
    """`extended` is asked once the armed deadline passes; a later answer re-arms the key
    there, and the callback gets the deadline that finally passed."""
    rec = Recorder()
    loop = asyncio.get_running_loop()
    latest = {"a": loop.time() + 0.05}
    asked: list[tuple[str, float]] = []

    def extended(key: str, deadline: float) -> float:
        asked.append((key, deadline))
        return latest[key]

    queue: DeadlineQueue[str] = DeadlineQueue(rec, extended=extended)
    armed = latest["a"]
    queue.arm("a", armed)
    latest["a"] = loop.time() + 0.2  # moved on by the owner alone, as a heartbeat does
    await rec.wait_for(1)

    [(key, given, fired_at)] = rec.fired
    assert key == "a" and given == latest["a"] and fired_at >= latest["a"]
    assert asked == [("a", armed), ("a", latest["a"])]
    queue.close()


class CountingLoop:
    """The running loop, counting the queue's timers that ran (its wake-ups)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakeups = 0

    def time(self) -> float:
        return self.loop.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        def counted() -> None:
            self.wakeups += 1
            callback()

        return self.loop.call_at(when, counted)


async def test_deadlines_within_one_resolution_step_share_one_wake_up() -> None:
    """Ten deadlines spread over 90 ms of one 100 ms step of the grid fire together, at the
    step's end, none before its own deadline; the next step's deadline in a wake-up of its
    own."""
    rec = Recorder()
    counting = CountingLoop(asyncio.get_running_loop())
    loop = cast(asyncio.AbstractEventLoop, counting)
    queue: DeadlineQueue[str] = DeadlineQueue(rec, loop=loop, resolution_s=0.1)
    step_end = math.ceil((loop.time() + 0.15) / 0.1) * 0.1
    deadlines = {f"k{i}": step_end - 0.095 + i * 0.009 for i in range(10)}
    for key, deadline in deadlines.items():
        queue.arm(key, deadline)
    queue.arm("next", step_end + 0.05)

    await rec.wait_for(11)

    assert counting.wakeups == 2
    assert rec.keys == [*deadlines, "next"]
    for key, given, fired_at in rec.fired:
        assert fired_at >= given
        assert given == (deadlines[key] if key != "next" else step_end + 0.05)
    assert all(fired_at >= step_end - 0.002 for _, _, fired_at in rec.fired[:10])
    queue.close()
