"""SIGTERM and the `stopping` report: a worker stopped on purpose (pod deleted, node
drained, restart by the supervisor) or done says so before it exits, so that its exit
does not count as a crash (see the `training.worker_client` docstring)."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.parse
from types import FrameType
from typing import Any

from resiliency_protocol.worker_wire import WorkerStopping, worker_path
from training.monitor_link.connection import MAX_ERROR_CHARS, MonitorConnection, log, wire
from training.monitor_link.registration import Registration

# The stopping report is sent from the SIGTERM handler, before the process goes on
# stopping, and holds the exit up for at most this (connect, send and the answer
# together). A host monitor on a busy node can take over a second to answer; a report
# given up on is worse than late: the worker's exit then races the report, and an exit
# seen first counts as a crash. Kubernetes' default grace period is 30 s.
STOPPING_REPORT_BOUND_S = 5.0


class TermHandler:
    """Reports `stopping` once: from the SIGTERM handler it installs (then hands the
    signal on), from `finished()`, or from the emergency thread when the main thread is
    stuck (`stop_if_main_thread_stuck`)."""

    def __init__(
        self, connection: MonitorConnection, registration: Registration, rank: int
    ) -> None:
        self._connection = connection
        self._registration = registration
        self._rank = rank
        self._stop_address: tuple[str, int] | None = None  # the monitor, resolved early
        self._previous_term: Any = None
        self.installed = False
        self.stopping_reported = False

    def install(self) -> None:
        """Install the SIGTERM handler (main thread only; not when SIGTERM is ignored)."""
        if self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            log.info("worker client: register() not on the main thread: no SIGTERM report")
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return  # SIGTERM does not stop this process: nothing to report
        self._stop_address = _resolve(self._connection.url)
        self._previous_term = previous
        signal.signal(signal.SIGTERM, self._on_term)
        self.installed = True

    def restore(self) -> None:
        """Put back the SIGTERM handler ours replaced, if ours is still the handler: one
        installed after it stays."""
        if self.installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_term:
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(signal.SIGTERM, self._previous_term)
            self.installed = False

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes (Python's signal handling), so a
        # blocking call is allowed; it is bounded (STOPPING_REPORT_BOUND_S).
        if not self.stopping_reported:
            self.stopping_reported = True
            self._report_stopping(signum)
        previous = self._previous_term
        if callable(previous):
            previous(signum, frame)
        elif previous is not signal.SIG_IGN:
            # SIG_DFL (or a handler not set from Python): the default action, as if we
            # had never been there. The process ends killed by SIGTERM (exit -15 / 143).
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def finished(self) -> None:
        """Report `stopping` without a signal: the process ends on its own. Once."""
        if self.stopping_reported:
            return
        self.stopping_reported = True
        self._report_stopping(None)

    def stop_if_main_thread_stuck(self, grace_s: float) -> None:
        """After a SIGTERM seen by another thread: unless the main thread runs the handler
        within `grace_s`, report `stopping` and end the process as SIGTERM would (143)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self.stopping_reported or not self.installed:
                return  # the main thread runs the handler: it decides what happens
            time.sleep(0.01)
        if self.stopping_reported:
            return
        self.stopping_reported = True
        log.warning(
            "worker client: SIGTERM while the main thread is blocked (in a collective?): "
            "stopping now"
        )
        self._report_stopping(signal.SIGTERM)
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(128 + signal.SIGTERM)

    def _report_stopping(self, signum: int | None) -> None:
        """POST /v1/workers/{rank}/stopping on a connection of its own: the interrupted
        main thread may be inside a request of the client's httpx client and hold its
        pool's lock."""
        registered = self._registration.registered
        monitor_url = self._connection.url
        if monitor_url is None or registered is None:
            return
        url = urllib.parse.urlsplit(monitor_url)
        host, port = self._stop_address or (url.hostname or "", url.port or 0)
        deadline = time.monotonic() + STOPPING_REPORT_BOUND_S
        connection = (
            http.client.HTTPSConnection(
                host, port or 443, timeout=STOPPING_REPORT_BOUND_S, context=self._connection.ssl
            )
            if url.scheme == "https"
            else http.client.HTTPConnection(host, port or 80, timeout=STOPPING_REPORT_BOUND_S)
        )
        signal = {"signal": signum} if signum is not None else {}
        stopping = self._connection.body(
            WorkerStopping,
            "stopping",
            pid=registered.pid,
            pid_namespace=registered.pid_namespace,
            **signal,
        )
        if stopping is None:
            return
        body = json.dumps(wire(stopping))
        headers = {
            **self._connection.headers,
            "Host": url.netloc,
            "Content-Type": "application/json",
            "Connection": "close",
        }
        try:
            path = url.path + worker_path(self._rank, "stopping")
            connection.connect()
            _left_until(connection, deadline)
            connection.request("POST", path, body, headers)
            _left_until(connection, deadline)
            response = connection.getresponse()
            text = response.read(MAX_ERROR_CHARS).decode(errors="replace")
            if response.status >= 300:
                log.warning(
                    "worker client: stopping report refused (HTTP %d): %s", response.status, text
                )
        except (OSError, http.client.HTTPException) as exc:
            log.warning("worker client: stopping report to host monitor failed: %r", exc)
        finally:
            connection.close()


def _left_until(connection: http.client.HTTPConnection, deadline: float) -> None:
    """The connection's next socket operations get what is left of the report's bound."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no answer within {STOPPING_REPORT_BOUND_S:g}s")
    if connection.sock is not None:
        connection.sock.settimeout(left)


def _resolve(url: str | None) -> tuple[str, int] | None:
    """The monitor's (address, port), looked up now: a DNS lookup cannot be bounded by a
    socket timeout, so the SIGTERM handler must not need one. None: look it up then."""
    if url is None:
        return None
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme == "https":
        return None  # TLS checks the host name: keep it
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return (str(infos[0][4][0]), port) if infos else None
