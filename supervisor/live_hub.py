"""A small publish/subscribe hub: the runtime tells it what it recorded (events, action
changes), live readers (the dashboard's stream) hear about it.

Publishing never waits: each subscriber has a bounded queue, and a subscriber that falls
behind loses its backlog and is told to resync (reload from the API, which has
everything) instead of slowing the supervisor down. Recent messages are kept in a ring,
so a reader that reconnects after a short drop is given what it missed.

Message ids are `<epoch>.<seq>`: the epoch changes with each process, so an id from
before a restart is recognised as such (resync) rather than mistaken for a newer one.
Everything here runs on the event loop's thread, except `close_threadsafe`.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from supervisor.domain import ActionRecord, Event

Kind = Literal["event", "action"]


@dataclass(slots=True)
class Message:
    seq: int
    id: str
    kind: Kind
    item: Event | ActionRecord
    _encoded: str | None = None

    def encoded(self, encode: Callable[[Event | ActionRecord], str]) -> str:
        """The payload, encoded once and shared by every reader (and replay)."""
        if self._encoded is None:
            self._encoded = encode(self.item)
        return self._encoded


@dataclass(frozen=True, slots=True)
class Resync:
    """Marks where a subscriber's backlog was dropped; `id` is the newest message then."""

    id: str


Item = Message | Resync


@dataclass(eq=False, slots=True)
class Subscription:
    limit: int
    backlog: deque[Item] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    dropped: int = 0

    def offer(self, message: Message) -> None:
        if len(self.backlog) >= self.limit:
            # Too far behind: drop everything queued rather than wait or grow.
            self.dropped += len(self.backlog)
            self.backlog.clear()
            self.backlog.append(Resync(message.id))
        else:
            self.backlog.append(message)
        self.wakeup.set()

    async def wait(self) -> None:
        await self.wakeup.wait()
        self.wakeup.clear()

    def drain(self) -> Iterator[Item]:
        while self.backlog:
            yield self.backlog.popleft()


class Hub:
    def __init__(self, *, history: int = 2048, queue_limit: int = 512) -> None:
        self.epoch = secrets.token_hex(4)
        self.queue_limit = queue_limit
        self._seq = 0
        self._history: deque[Message] = deque(maxlen=history)
        self._subscribers: set[Subscription] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def head(self) -> str:
        """Id of the newest message published (`<epoch>.0` before the first)."""
        return f"{self.epoch}.{self._seq}"

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, kind: Kind, item: Event | ActionRecord) -> None:
        """Never blocks and never raises for a slow subscriber."""
        self._seq += 1
        message = Message(self._seq, f"{self.epoch}.{self._seq}", kind, item)
        self._history.append(message)
        for subscription in self._subscribers:
            subscription.offer(message)

    def event(self, event: Event) -> None:
        self.publish("event", event)

    def action(self, action: ActionRecord) -> None:
        self.publish("action", action)

    def subscribe(
        self, last_id: str | None = None, *, limit: int | None = None
    ) -> tuple[Subscription, list[Item]]:
        """A new subscription (backlog of at most `limit`, else the hub's), and what to
        send first: the messages after `last_id` when they are still in the ring, else a
        Resync at the head.

        Subscribing and reading the ring happen with no await in between, so nothing
        published meanwhile can fall between the two.
        """
        self._loop = asyncio.get_running_loop()
        subscription = Subscription(limit or self.queue_limit)
        self._subscribers.add(subscription)
        missed = self._since(last_id) if last_id is not None else None
        first: list[Item] = list(missed) if missed is not None else [Resync(self.head)]
        return subscription, first

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def close(self) -> None:
        """End every subscription (the server is stopping)."""
        for subscription in self._subscribers:
            subscription.closed = True
            subscription.wakeup.set()
        self._subscribers.clear()

    def close_threadsafe(self) -> None:
        """`close` from a signal handler or another thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    def _since(self, last_id: str) -> list[Message] | None:
        epoch, _, seq_text = last_id.strip().partition(".")
        if epoch != self.epoch or not seq_text.isdigit():
            return None
        seq = int(seq_text)
        if seq > self._seq:
            return None
        oldest = self._history[0].seq if self._history else self._seq + 1
        if seq < oldest - 1:
            return None  # some of what it missed has left the ring
        return [m for m in self._history if m.seq > seq]
