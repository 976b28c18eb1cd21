"""The worker client's reporting thread: the newest step (the worker's heartbeat) every
interval, and the checkpoint reports queued by the training loop, sent in order.

A checkpoint report is sent until the host monitor takes it or refuses it for good: one
whose answer timed out is sent again under the same key (`REPORT_KEY_HEADER`), which the
host monitor keeps once. The two kinds take turns: a host monitor slower to answer than
the interval starves neither.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import uuid

from resiliency_protocol.backoff import Backoff
from resiliency_protocol.checkpoint_reports import (
    MAX_CHECKPOINT_BYTES,
    MAX_CHECKPOINT_ERROR_CHARS,
    MAX_CHECKPOINT_SECONDS,
    REPORT_KEY_HEADER,
    CheckpointReport,
    Tier,
)
from resiliency_protocol.worker_wire import WorkerProgress, worker_path
from training.monitor_link.connection import Delivery, MonitorConnection, log
from training.monitor_link.lease import HostLease
from training.monitor_link.registration import Registration

_MAX_QUEUED_REPORTS = 1000
_TIERS: frozenset[str] = frozenset(Tier)
# Between two tries of a checkpoint report the host monitor did not take.
_RETRY_FIRST_S = 0.2
_RETRY_CAP_S = 2.0


class _Queued:
    """A checkpoint report waiting to be sent, with the key its tries share."""

    __slots__ = ("body", "key", "path")

    def __init__(self, path: str, body: CheckpointReport) -> None:
        self.path = path
        self.body = body
        self.key = uuid.uuid4().hex


class Reporter:
    """Takes reports from the training loop (cheap, never blocking on the network) and
    sends them from a daemon thread of its own, started on first use when online."""

    def __init__(
        self,
        connection: MonitorConnection,
        registration: Registration,
        rank: int,
        report_interval_s: float,
        lease: HostLease | None = None,
    ) -> None:
        self._connection = connection
        self._lease = lease
        self._registration = registration
        self._rank = rank
        self._interval_s = report_interval_s
        self._lock = threading.Lock()
        self._step: int | None = None
        self._compute_lock = threading.Lock()
        self._compute_sum = 0.0
        self._compute_count = 0
        self._queue: queue.Queue[_Queued] = queue.Queue(_MAX_QUEUED_REPORTS)
        # The report being sent (the queue's head), kept across its tries; the thread's own.
        self._head: _Queued | None = None
        self._retry = Backoff(_RETRY_FIRST_S, _RETRY_CAP_S)
        self._retry_at = 0.0  # monotonic: no try of the head before then
        self._give_up_at = math.inf  # monotonic: set by `stop`
        # Reports queued and not yet sent (or given up on): what `flush` waits for.
        self._unsent = 0
        self._sent = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        #: Set once the client closes: no thread starts after it.
        self.closed = False
        #: The world sent with each progress report (see WorkerClient.attempt).
        self.attempt: str | None = None
        self._report_now = False

    def report_step(self, step: int, compute_s: float | None) -> None:
        self._step = step  # one attribute store: atomic under the GIL
        if compute_s is not None and compute_s >= 0:
            with self._compute_lock:
                self._compute_sum += compute_s
                self._compute_count += 1
        if self.thread is None and self._connection.http is not None:
            self.ensure_thread()

    def report_checkpoint(
        self,
        event: str,
        step: int,
        duration_s: float,
        tier: Tier | str,
        size_bytes: int | None,
        total_s: float | None,
        *,
        error: str | None = None,
    ) -> None:
        """Check the report (ValueError, even offline), then queue it for the thread."""
        if tier not in _TIERS:
            raise ValueError(f"unknown checkpoint tier {tier!r}")
        if size_bytes is not None and (
            isinstance(size_bytes, bool)
            or not isinstance(size_bytes, int)
            or not 0 <= size_bytes <= MAX_CHECKPOINT_BYTES
        ):
            raise ValueError(f"size_bytes must be an int in [0, 2**62], got {size_bytes!r}")
        if total_s is not None and not (
            isinstance(total_s, int | float)
            and not isinstance(total_s, bool)
            and math.isfinite(total_s)
            and total_s <= MAX_CHECKPOINT_SECONDS
        ):
            raise ValueError(f"total_s must be finite seconds up to a week, got {total_s!r}")
        if self._connection.http is None:
            return
        optional = {
            "bytes": size_bytes,
            "total_s": None if total_s is None else max(0.0, float(total_s)),  # clock jitter
            "error": None if error is None else error[:MAX_CHECKPOINT_ERROR_CHARS],
        }
        body = self._connection.body(
            CheckpointReport,
            "checkpoint",
            event=event,
            step=step,
            duration_s=max(0.0, duration_s),
            tier=tier,
            **{k: v for k, v in optional.items() if v is not None},
        )
        if body is None:
            return
        try:
            with self._sent:
                self._queue.put_nowait(_Queued(worker_path(self._rank, "checkpoints"), body))
                self._unsent += 1
        except queue.Full:
            log.warning("worker client: report queue full, dropping a checkpoint report")
        self.ensure_thread()
        self._wake.set()

    def report_now(self) -> None:
        """Send a progress report at once (the world changed), not at the next interval."""
        self._report_now = True
        self.ensure_thread()
        self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Wait until the checkpoint reports queued so far are sent (or given up on)."""
        if self._connection.http is None:
            return True
        self.ensure_thread()
        self._wake.set()
        with self._sent:
            return self._sent.wait_for(lambda: self._unsent <= 0, timeout=timeout_s)

    def ensure_thread(self) -> None:
        if self._connection.http is None or self.closed:
            return
        with self._lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name=f"worker-client-{self._rank}", daemon=True
                )
                self.thread.start()

    def stop(self, timeout_s: float) -> None:
        """Send what is queued and a last progress report, then end the thread: within
        `timeout_s`, after which reports not taken are given up (logged)."""
        thread = self.thread
        if thread is not None:
            self._give_up_at = time.monotonic() + timeout_s
            self._stop.set()
            self._wake.set()
            thread.join(timeout_s)

    def _run(self) -> None:
        next_progress = time.monotonic()
        said_last_progress = False
        while True:
            self._wake.clear()  # before draining: a report queued from now on wakes us
            stopping = self._stop.is_set()
            # At least one checkpoint report between two progress reports, and no more
            # than fit before the next one is due: neither kind starves the other (a rank
            # not heard from is taken for hung, and its lease runs out; a save not heard
            # of is not in the supervisor's goodput and not resumed from).
            self._drain(until=None if stopping else next_progress)
            now = time.monotonic()
            if stopping:
                if not said_last_progress:
                    self.send_progress()
                    said_last_progress = True
                if not self._pending() or now >= self._give_up_at:
                    self._give_up_the_rest()
                    return
                self._wake.wait(max(0.0, min(self._retry_at, self._give_up_at) - now))
                continue
            if now >= next_progress or self._report_now:
                self._report_now = False
                self.send_progress()
                next_progress = max(next_progress + self._interval_s, now)
                self._registration.renew_if_forgotten(now)
            if self._pending() and time.monotonic() >= self._retry_at:
                continue  # the drain stopped for the progress report: go on with it
            wake_at = min(next_progress, self._retry_at) if self._pending() else next_progress
            self._wake.wait(max(0.0, wake_at - time.monotonic()))

    def _pending(self) -> bool:
        return self._head is not None or not self._queue.empty()

    def _drain(self, until: float | None = None) -> None:
        """Send the queued checkpoint reports, in order: one at least, then until the
        monotonic `until` (None: all); stop at one the host monitor did not take (it is
        tried again after a backoff)."""
        tried = 0
        while tried == 0 or until is None or time.monotonic() < until:
            if time.monotonic() < self._retry_at:
                return
            if self._head is None:
                try:
                    self._head = self._queue.get_nowait()
                except queue.Empty:
                    return
            head = self._head
            tried += 1
            headers = {REPORT_KEY_HEADER: head.key}
            delivery = self._connection.deliver(head.path, head.body, "checkpoint", headers)
            if self._worth_another_try(delivery):
                self._retry_at = time.monotonic() + self._retry.next()
                return
            self._retry.reset()
            self._retry_at = 0.0
            self._done_with_head()

    def _worth_another_try(self, delivery: Delivery) -> bool:
        if delivery is Delivery.TRY_AGAIN:
            return time.monotonic() < self._give_up_at
        # While running, a host monitor that is restarting; at the end, most likely none
        # (the node going down): the process does not wait out `stop`'s time for it.
        return delivery is Delivery.UNREACHABLE and not self._stop.is_set()

    def _done_with_head(self) -> None:
        self._head = None
        with self._sent:
            self._unsent -= 1
            self._sent.notify_all()

    def _give_up_the_rest(self) -> None:
        """At the end of `stop`'s time: the reports the host monitor never took."""
        lost = 0
        while self._head is not None or not self._queue.empty():
            if self._head is None:
                self._head = self._queue.get_nowait()
            self._done_with_head()
            lost += 1
        if lost:
            log.error("worker client: %d checkpoint report(s) never reached the host monitor", lost)

    def send_progress(self) -> None:
        """POST the newest step, with the mean compute time since the last report."""
        fields: dict[str, object] = {"step": self._step}  # null before the first step
        if self.attempt is not None:
            fields["attempt"] = self.attempt
        with self._compute_lock:
            if self._compute_count:
                fields["compute_s"] = min(86400.0, self._compute_sum / self._compute_count)
            self._compute_sum, self._compute_count = 0.0, 0
        body = self._connection.body(WorkerProgress, "progress", **fields)
        if body is not None:
            asked_at = time.monotonic()
            reply = self._connection.post(worker_path(self._rank, "progress"), body, "progress")
            if self._lease is not None and isinstance(reply, dict):
                heard = reply.get("supervisor_heard_s")
                if not isinstance(heard, int | float) or isinstance(heard, bool):
                    heard = None
                self._lease.renew(asked_at, heard)
