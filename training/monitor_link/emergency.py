"""Emergency checkpoints asked for with SIGUSR1: saved at the training loop's safe
points, or at once by a thread of the client's own (see the `training.worker_client`
docstring), and acked to the host monitor."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from resiliency_protocol import worker_env
from resiliency_protocol.emergency import EmergencyAck
from resiliency_protocol.worker_wire import worker_path
from training.monitor_link.connection import MAX_ERROR_CHARS, MonitorConnection, log

DEFAULT_REQUEST_ID = "signal"
_MAX_REQUEST_ID_CHARS = 200


class EmergencyServer:
    """Runs the emergency checkpoint callback when SIGUSR1 asked for one.

    `on_sigterm(grace_s)` is what the serving thread does when it sees SIGTERM (the main
    thread may be stuck in C++ and never run the handler). `on_handler(installed)` is told
    when its SIGUSR1 handler is installed and put back: the host monitor signals only a
    worker that handles SIGUSR1."""

    def __init__(
        self,
        connection: MonitorConnection,
        rank: int,
        on_sigterm: Callable[[float], None],
        on_handler: Callable[[bool], None] = lambda installed: None,
    ) -> None:
        self._connection = connection
        self._rank = rank
        self._on_sigterm = on_sigterm
        self._on_handler = on_handler
        # The signal handler only sets this flag.
        self.requested = False
        self._callback: Callable[[], int] | None = None
        self._previous_handler: Any = None
        self._handler_installed = False
        self._serve_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends
        self._term_grace_s = 1.0
        self._on_exit: Callable[[], None] = lambda: None
        self._exit_wait_s = 0.0

    def on_emergency_checkpoint(self, callback: Callable[[], int]) -> None:
        """Install the SIGUSR1 handler (once; main thread only) and `callback`."""
        self._callback = callback
        if not self._handler_installed:
            self._previous_handler = signal.signal(signal.SIGUSR1, self._on_signal)
            self._handler_installed = True
            self._on_handler(True)

    def serve_from_thread(
        self,
        callback: Callable[[], int],
        term_grace_s: float,
        *,
        on_exit: Callable[[], None] = lambda: None,
        exit_wait_s: float = 60.0,
    ) -> bool:
        """Start the serving thread on Python's wakeup fd; False if that fd is taken.

        At the interpreter's exit (the training loop raised: a collective whose peer died,
        say) `on_exit()` is called, then a request being served, or asked and not served
        yet, is saved and acked within `exit_wait_s` before the process ends: the serving
        thread is a daemon, which the interpreter would stop mid-save."""
        if term_grace_s < 0 or exit_wait_s < 0:
            raise ValueError("term_grace_s and exit_wait_s must be >= 0")
        self._on_exit, self._exit_wait_s = on_exit, exit_wait_s
        self.on_emergency_checkpoint(callback)
        if self._thread is not None:
            return True
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # the C handler must never block on it
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            log.warning(
                "worker client: the wakeup fd is in use (an event loop?): emergency "
                "checkpoints are served at safe points only"
            )
            return False
        self._wakeup = (read_end, write_end)
        self._term_grace_s = term_grace_s
        self._thread = threading.Thread(
            target=self._serve_signals, name=f"emergency-checkpoint-{self._rank}", daemon=True
        )
        self._thread.start()
        _at_interpreter_exit(self._finish_at_exit)
        return True

    def at_safe_point(self) -> bool:
        """Serve a pending request unless the serving thread does; True if served."""
        if not self.requested or self._thread is not None:
            return False  # nothing asked, or the client's thread serves it
        return self._serve()

    def stop_thread(self, timeout_s: float) -> None:
        """Give the wakeup fd back and end the serving thread (a save in flight first)."""
        if self._wakeup is None:
            return
        read_end, write_end = self._wakeup
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError):
                current = signal.set_wakeup_fd(-1)
                if current != write_end:  # somebody else's since: put it back
                    signal.set_wakeup_fd(current)
        with contextlib.suppress(OSError):
            os.write(write_end, b"\0")
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)  # a save in flight finishes first (it has a timeout)
        if thread is None or not thread.is_alive():  # else its fd number must stay taken
            for fd in (read_end, write_end):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wakeup = None
        self._thread = None  # its exit hook does nothing now

    def restore_handler(self) -> None:
        """Put back the SIGUSR1 handler ours replaced (main thread only)."""
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            # Said first: a signal between the two would meet the handler put back.
            self._on_handler(False)
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGUSR1, self._previous_handler)
            self._handler_installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Signal-safe: a single attribute store, no locks, no I/O.
        self.requested = True

    def _serve_signals(self) -> None:
        assert self._wakeup is not None
        read_end = self._wakeup[0]
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                return
            if not data or 0 in data:  # closed, or close()'s wake-up byte
                return
            if signal.SIGTERM in data:
                self._on_sigterm(self._term_grace_s)
            if signal.SIGUSR1 in data:
                self._serve()

    def _finish_at_exit(self) -> None:
        if self._thread is None:
            return
        self._on_exit()
        if not self._serve_lock.acquire(timeout=self._exit_wait_s):
            log.error(
                "emergency checkpoint still being saved after %gs at exit: not waiting longer",
                self._exit_wait_s,
            )
            return
        self._serve_lock.release()
        if self._serve(only_if_requested=True) or getattr(sys, "last_value", None) is None:
            return
        # The main thread ended on an exception Python printed (a collective that raised
        # once its peer died, say), before any request: the supervisor's comes after the
        # process is gone. The last completed step is saved now, as a request would.
        self._save_at_exit()

    def _save_at_exit(self) -> None:
        callback = self._callback
        if callback is None:
            return
        try:
            step = callback()
        except Exception as exc:
            log.error("emergency checkpoint at exit failed: %s: %s", type(exc).__name__, exc)
            return
        log.warning("emergency checkpoint at exit: the training loop raised after step %d", step)

    def _serve(self, *, only_if_requested: bool = False) -> bool:
        with self._serve_lock:
            if only_if_requested and not self.requested:
                return False
            self.requested = False  # a signal arriving during the save asks for another
            self._save_and_ack()
        return True

    def _save_and_ack(self) -> None:
        callback = self._callback
        started = time.monotonic()
        step: int | None = None
        error: str | None = None
        if callback is None:
            error = "no emergency checkpoint callback installed"
        else:
            try:
                step = int(callback())
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
                log.error("emergency checkpoint failed: %s", error)
        duration = time.monotonic() - started
        if self._connection.http is not None:
            body = self._connection.body(
                EmergencyAck,
                "ack",
                request_id=_request_id(),
                ok=error is None,
                step=step if step is not None and step >= 0 else None,
                duration_s=duration,
                error=error,
            )
            # Sent now, not queued: the host monitor is waiting for exactly this.
            path = worker_path(self._rank, "emergency-ack")
            for _ in range(2):
                if body is None:
                    break  # the host monitor would refuse it (logged)
                if self._connection.post(path, body, "ack") is not None:
                    break


def _at_interpreter_exit(call: Callable[[], None]) -> None:
    """Run `call` when the main thread ends, before the interpreter joins its threads and
    before concurrent.futures stops taking work (a save writes through thread pools):
    through threading's exit hooks, which concurrent.futures registers with too (run last
    registered first); through atexit where an interpreter lacks them."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(call)
        return
    with contextlib.suppress(RuntimeError):  # the interpreter is already ending
        register(call)


def _request_id() -> str:
    """The id the host monitor wrote before it signalled (a signal carries no data)."""
    path = os.environ.get(worker_env.HOST_MONITOR_REQUEST_FILE)
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            value = ""
        if value:
            return value[:_MAX_REQUEST_ID_CHARS]
    return DEFAULT_REQUEST_ID
