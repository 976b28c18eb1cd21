"""The worker client's reporting thread: the newest step (the worker's heartbeat) every
interval, and the checkpoint reports queued by the training loop, sent in order."""

from __future__ import annotations

import math
import queue
import threading
import time

from resiliency_protocol.checkpoint_reports import (
    MAX_CHECKPOINT_BYTES,
    MAX_CHECKPOINT_ERROR_CHARS,
    MAX_CHECKPOINT_SECONDS,
    CheckpointReport,
    Tier,
)
from resiliency_protocol.worker_wire import WorkerProgress, worker_path
from training.monitor_link.connection import MonitorConnection, log
from training.monitor_link.lease import HostLease
from training.monitor_link.registration import Registration

_MAX_QUEUED_REPORTS = 1000
_TIERS: frozenset[str] = frozenset(Tier)


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
        self._queue: queue.Queue[tuple[str, CheckpointReport]] = queue.Queue(_MAX_QUEUED_REPORTS)
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
                self._queue.put_nowait((worker_path(self._rank, "checkpoints"), body))
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
        """Send what is queued and a last progress report, then end the thread."""
        thread = self.thread
        if thread is not None:
            self._stop.set()
            self._wake.set()
            thread.join(timeout_s)

    def _run(self) -> None:
        next_progress = time.monotonic()
        while True:
            self._wake.clear()  # before draining: a report queued from now on wakes us
            stopping = self._stop.is_set()
            # Checkpoint reports queued faster than they are sent must not starve the
            # progress reports: the host monitor would take the rank for hung, and its
            # lease (lease.py) would run out with the rank training on.
            self._drain(until=None if stopping else next_progress)
            now = time.monotonic()
            if now >= next_progress or stopping or self._report_now:
                self._report_now = False
                self.send_progress()
                next_progress = max(next_progress + self._interval_s, now)
                if not stopping:
                    self._registration.renew_if_forgotten(now)
            if stopping:
                self._drain()
                return
            if not self._queue.empty():
                continue  # the drain stopped for the progress report: go on with it
            self._wake.wait(max(0.0, next_progress - time.monotonic()))

    def _drain(self, until: float | None = None) -> None:
        """Send the queued checkpoint reports, in order; `until` (monotonic): stop then,
        when a progress report is due."""
        while until is None or time.monotonic() < until:
            try:
                path, body = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                self._connection.post(path, body, kind="checkpoint")
            finally:
                with self._sent:
                    self._unsent -= 1
                    self._sent.notify_all()

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
