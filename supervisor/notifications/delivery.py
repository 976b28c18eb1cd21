"""Sends notices to their routes from background tasks, never in the way of the supervisor.

The runtime publishes each event and action change to the hub (supervisor.live_hub); the
notifier reads them from a subscription of its own, whose backlog is bounded: when the
database cannot keep up, the oldest unrouted items are dropped and counted
(`supervisor_notifications_dropped`) rather than the heartbeat path slowed.

A notice bound for a route is recorded as a pending delivery before any attempt, so a
restart resumes it. Each route has one sender task that takes its pending deliveries
oldest first: a receiver that is down holds up only its own route, and Alertmanager
hears of an alert before it hears it resolved. Attempts are bounded, each is recorded
with its error, and retries wait an exponential backoff with jitter. A receiver answering
4xx (other than 408, 425, 429) will not change its mind: that delivery fails at once.
Delivery is at least once: a receiver can drop repeats by the X-Supervisor-Delivery
header.

Secrets (URLs, header values) are replaced by *** in recorded errors and in what httpx
logs.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

import httpx

from resiliency_protocol.backoff import Backoff, attempt_delay
from supervisor.config_parts import NotificationSettings
from supervisor.config_parts.notification_routes import Route
from supervisor.domain import ActionRecord, Event
from supervisor.live_hub import Hub, Message, Subscription
from supervisor.metrics import Metrics
from supervisor.notices import (
    Delivery,
    DeliveryStatus,
    NewDelivery,
    Notice,
    action_notice,
    event_notice,
)
from supervisor.notifications.routing import routes_for
from supervisor.notifications.sinks import Request, request_for
from supervisor.store.roles import DeliveryQueue

log = logging.getLogger(__name__)

#: Pending deliveries a sender reads at once.
BATCH = 100
MAX_BACKOFF_S = 60.0
#: How long a stopping notifier gives its router to record what was already published.
STOP_GRACE_S = 5.0
RETRYABLE_STATUS = frozenset({408, 425, 429})
#: Answers from a receiver are cut to this in a delivery's error.
ERROR_CHARS = 300
READ_CHARS = 65536
ROUTE_GONE = "route no longer configured"


class Notifier:
    def __init__(
        self,
        settings: NotificationSettings,
        store: DeliveryQueue,
        hub: Hub,
        metrics: Metrics,
        *,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.routes: Sequence[Route] = settings.notification_routes
        self.public_url = settings.public_url
        self.timeout_s = settings.notification_timeout_s
        self.max_attempts = settings.notification_max_attempts
        self.backoff_s = settings.notification_retry_backoff_s
        self.queue_size = settings.notification_queue_size
        self._store = store
        self._hub = hub
        self._metrics = metrics
        self._jitter = jitter
        self._secrets = sorted(
            {s for route in self.routes for s in route.sink.secrets() if s}, key=len, reverse=True
        )
        self._redact = _Redact(self.scrub)
        self._client: httpx.AsyncClient | None = None
        self._subscription: Subscription | None = None
        self._router: asyncio.Task[None] | None = None
        self._senders: list[asyncio.Task[None]] = []
        self._wakeups = {route.name: asyncio.Event() for route in self.routes}
        self._dropped = 0

    async def start(self) -> None:
        """Give up deliveries of routes no longer configured, then route what the hub
        publishes and send what is pending (from before a restart too)."""
        names = [route.name for route in self.routes]
        gone = await asyncio.to_thread(
            lambda: self._store.fail_pending_deliveries(except_routes=names, error=ROUTE_GONE)
        )
        if gone:
            log.warning("%d pending notifications failed: %s", gone, ROUTE_GONE)
        if not self.routes:
            return
        # httpx logs each request's URL, which for a Slack webhook is the credential.
        logging.getLogger("httpx").addFilter(self._redact)
        self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
        self._subscription, _ = self._hub.subscribe(limit=self.queue_size)
        self._router = asyncio.create_task(self._route(self._subscription), name="notify-router")
        self._senders = [
            asyncio.create_task(self._send_route(route), name=f"notify:{route.name}")
            for route in self.routes
        ]
        log.info(
            "notifications on: %s", ", ".join(f"{r.name} ({r.sink.type})" for r in self.routes)
        )

    async def stop(self) -> None:
        """Record what was published before the hub closed; what is pending then is sent
        after the next start."""
        if self._router is not None and self._subscription is not None:
            self._subscription.closed = True
            self._subscription.wakeup.set()
            self._hub.unsubscribe(self._subscription)
            try:
                await asyncio.wait_for(self._router, STOP_GRACE_S)
            except (TimeoutError, asyncio.CancelledError):
                pass
            except Exception:
                log.exception("notification router failed")
        for sender in self._senders:
            sender.cancel()
        await asyncio.gather(*self._senders, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
        logging.getLogger("httpx").removeFilter(self._redact)

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # --- routing --------------------------------------------------------------------------

    async def _route(self, subscription: Subscription) -> None:
        while True:
            if not subscription.closed:
                await subscription.wait()
            notices = [
                n
                for item in subscription.drain()
                if isinstance(item, Message) and (n := _notice(item.item)) is not None
            ]
            self._count_dropped(subscription)
            new = [
                NewDelivery(route.name, route.sink.type, notice)
                for notice in notices
                for route in routes_for(notice, self.routes)
            ]
            if new:
                created = await self._create(new)
                for route in {d.route for d in created}:
                    self._wakeups[route].set()
            if subscription.closed and not subscription.backlog:
                return

    async def _create(self, new: list[NewDelivery]) -> list[Delivery]:
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                return await asyncio.to_thread(self._store.create_deliveries, new)
            except Exception:
                # The database is down: keep them in memory (the subscription goes on
                # filling, bounded) and try again.
                log.exception("cannot record %d notifications; retrying", len(new))
                await asyncio.sleep(backoff.next())

    def _count_dropped(self, subscription: Subscription) -> None:
        dropped = subscription.dropped - self._dropped
        if dropped:
            self._dropped = subscription.dropped
            self._metrics.notifications_dropped.inc(dropped)
            log.warning("notification queue full: %d events and action changes dropped", dropped)

    # --- sending --------------------------------------------------------------------------

    async def _send_route(self, route: Route) -> None:
        wakeup = self._wakeups[route.name]
        while True:
            wakeup.clear()  # before reading: a delivery recorded meanwhile wakes us again
            try:
                pending = await asyncio.to_thread(self._store.pending_deliveries, route.name, BATCH)
            except Exception:
                log.exception("cannot read the pending notifications of route %s", route.name)
                await asyncio.sleep(1.0)
                continue
            if not pending:
                await wakeup.wait()
            for delivery in pending:
                try:
                    await self._deliver(route, delivery)
                except Exception as exc:
                    # A notice this version cannot render (say, recorded by a newer one):
                    # give it up rather than stop the route or retry it forever.
                    log.exception("cannot send notification %d", delivery.id)
                    error = self.scrub(f"cannot send: {type(exc).__name__}: {exc}")
                    await self._record(delivery.id, DeliveryStatus.FAILED, error)
                    self._metrics.notifications.labels(route.name, route.sink.type, "failed").inc()

    async def _deliver(self, route: Route, delivery: Delivery) -> None:
        request = request_for(route, delivery.notice, delivery.id, self.public_url)
        attempts = delivery.attempts
        while True:
            error, retryable = await self._attempt(request)
            attempts += 1
            if error is None:
                status = DeliveryStatus.DELIVERED
            elif retryable and attempts < self.max_attempts:
                status = DeliveryStatus.PENDING
            else:
                status = DeliveryStatus.FAILED
            await self._record(delivery.id, status, error)
            if status is DeliveryStatus.PENDING:
                log.info(
                    "notification %d to %s, attempt %d failed: %s",
                    delivery.id,
                    route.name,
                    attempts,
                    error,
                )
                await asyncio.sleep(self._backoff(attempts))
                continue
            self._metrics.notifications.labels(route.name, route.sink.type, status.value).inc()
            if status is DeliveryStatus.FAILED:
                log.warning(
                    "notification %d (%s %d) to %s failed after %d attempts: %s",
                    delivery.id,
                    delivery.notice.kind,
                    delivery.notice.id,
                    route.name,
                    attempts,
                    error,
                )
            return

    async def _attempt(self, request: Request) -> tuple[str | None, bool]:
        """Send once: (None, _) when delivered, else (what went wrong, worth retrying)."""
        assert self._client is not None
        try:
            response = await self._client.post(
                request.url, json=request.body, headers=request.headers
            )
        except httpx.TimeoutException:
            return f"no answer within {self.timeout_s:g} s", True
        except (httpx.UnsupportedProtocol, httpx.InvalidURL):
            return "the route's URL is not an http:// or https:// URL", False
        except httpx.HTTPError as exc:
            return self.scrub(f"{type(exc).__name__}: {exc}"), True
        if response.is_success:
            return None, False
        code = response.status_code
        # Scrubbed before it is cut, so that no part of a secret is left at the cut.
        text = self.scrub(" ".join(response.text[:READ_CHARS].split()))[:ERROR_CHARS]
        return f"HTTP {code}: {text}", code >= 500 or code in RETRYABLE_STATUS

    async def _record(self, delivery_id: int, status: DeliveryStatus, error: str | None) -> None:
        backoff = Backoff(0.1, 5.0)
        while True:
            try:
                await asyncio.to_thread(
                    self._store.record_delivery_attempt, delivery_id, status, error
                )
                return
            except Exception:
                log.exception("cannot record notification %d; retrying", delivery_id)
                await asyncio.sleep(backoff.next())

    def _backoff(self, attempts: int) -> float:
        """Doubling from notification_retry_backoff_s, capped, each wait drawn between
        half and all of it: receivers recovering from an outage are not hit in step."""
        return attempt_delay(self.backoff_s, attempts, MAX_BACKOFF_S, jitter=self._jitter)


def _notice(item: Event | ActionRecord) -> Notice | None:
    if isinstance(item, Event):
        return event_notice(item)
    return action_notice(item)


class _Redact(logging.Filter):
    def __init__(self, scrub: Callable[[str], str]) -> None:
        super().__init__()
        self._scrub = scrub

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        scrubbed = self._scrub(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        return True
