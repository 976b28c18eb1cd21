"""What a training loop imports to talk to its node's host monitor.

Standard library and httpx only: a training script must be able to import this without
pydantic or the supervisor. The bodies sent are plain dicts shaped like the models of
`host_monitor.protocol` (the worker routes, `/v1/workers/...`).

Typical use::

    client = WorkerClient.from_env()
    client.register(world_size=world_size)
    client.on_emergency_checkpoint(save_now)  # save_now() -> the step it saved
    for step in ...:
        client.at_safe_point()                # serves a pending emergency checkpoint
        compute_s = train_one_step()          # its own work, before it waits for the others
        client.report_step(step, compute_s=compute_s)  # cheap: sent by a background thread
    client.finishing()                        # out of the loop: the end is not a hang
    client.close()

`register()` sends the job from `HOST_MONITOR_JOB` (a host monitor that is a spare, as
on Kubernetes, learns its job from it) and installs a SIGTERM handler that tells the
host monitor this worker is being stopped (pod deleted, node drained, restart by the
supervisor), so its exit counts as `stopped`, not as a crash; the handler then hands the
signal on to the handler that was there before (or to the default action: the process
terminates exactly as it would have). Install your own SIGTERM handler, if any, before
`register()`: installed after, it replaces the client's. A worker killed without SIGTERM
(SIGKILL, the OOM killer, a crash) is still `exited`. A host monitor that answers a
progress report with 404 (it restarted) gets the registration again.

Without a monitor URL (no `HOST_MONITOR_URL`) the client works offline: nothing is
reported, and emergency checkpoints still run on SIGUSR1 (they are just not acked), so
the workload also runs standalone.

A loop that spends its time inside C++ (a PyTorch job: a rank whose peer died sits in a
gloo or NCCL collective, where no Python signal handler runs until the call returns)
uses `serve_emergency_checkpoints(save_now)` instead of `on_emergency_checkpoint`: a
thread of the client's own serves each request at once, whatever the main thread is
doing. It learns of the signal through Python's wakeup fd (`signal.set_wakeup_fd`),
which the interpreter's C-level handler writes from any thread. The same thread sees
SIGTERM: when the main thread is stuck and cannot run the SIGTERM handler within
`term_grace_s`, it reports `stopping` itself and ends the process with the exit status
SIGTERM gives (143), rather than leave the host monitor to wait out its grace period
and SIGKILL.

"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import queue
import re
import signal
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import httpx

from resiliency_protocol.backoff import attempt_delay
from resiliency_protocol.tls import TLSError, client_context
from training.process_identity import self_identity

__all__ = ["CheckpointTier", "WorkerClient"]

log = logging.getLogger(__name__)

# `local`: node-local files (the NumPy demo); `ram`: tmpfs on the node; `peer`: a copy held
# by a partner node's host monitor; `durable`: shared storage; `emergency`: saved on demand.
CheckpointTier = Literal["local", "ram", "peer", "durable", "emergency"]
_TIERS: frozenset[str] = frozenset({"local", "ram", "peer", "durable", "emergency"})
_MAX_BYTES = 2**62
#: The longest error text a failed checkpoint report carries (what the host monitor takes).
MAX_CHECKPOINT_ERROR_CHARS = 1000
_MAX_TOTAL_S = 604_800.0  # what the host monitor takes

# Env variables read by `WorkerClient.from_env` and `at_safe_point`.
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_MONITOR_URL = "HOST_MONITOR_URL"
ENV_TOKEN = "HOST_MONITOR_WORKER_TOKEN"
# The host monitor's TLS: the CA bundle that verifies it, and the name its certificate is
# checked against instead of the URL's host (host_monitor/config.py sets them).
ENV_CA_FILE = "HOST_MONITOR_CA_FILE"
ENV_SERVER_NAME = "HOST_MONITOR_SERVER_NAME"
ENV_REQUEST_FILE = "HOST_MONITOR_REQUEST_FILE"
ENV_JOB = "HOST_MONITOR_JOB"
ENV_ATTEMPT = "WORKLOAD_ATTEMPT"
ENV_INSTANCE = "POD_UID"  # on Kubernetes, from the downward API (metadata.uid)
_ATTEMPT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
DEFAULT_REQUEST_ID = "signal"

_REQUEST_TIMEOUT_S = 2.0
# The stopping report is sent from the SIGTERM handler, before the process goes on
# stopping: each socket operation (connect, send, receive) gets at most this.
_STOPPING_TIMEOUT_S = 0.5
# A host monitor that answers a progress report with 404 does not know this worker (it
# restarted, e.g. a DaemonSet rollout, or was not up at `register()`): register again,
# at most this often.
_REREGISTER_EVERY_S = 2.0
_MAX_QUEUED_REPORTS = 1000
_MAX_ERROR_CHARS = 2000
_MAX_REQUEST_ID_CHARS = 200


class WorkerClient:
    """One training worker's link to its host monitor.

    `report_step` and the checkpoint reports only hand data to a daemon thread, which
    POSTs the newest step every `report_interval_s` (that POST is also the worker's
    heartbeat, so it is sent even when the step did not change), with the mean compute
    time of the steps since the last one. Nothing here raises because the host monitor is
    down or slow: failures are logged (once per kind of failure until one succeeds again)
    and dropped.
    """

    def __init__(
        self,
        rank: int,
        local_rank: int,
        *,
        monitor_url: str | None = None,
        token: str | None = None,
        report_interval_s: float = 0.5,
        job: str | None = None,
        instance: str | None = None,
        ca_file: str | None = None,
        server_name: str | None = None,
    ) -> None:
        """`instance`: what this process runs in, once (its pod's UID on Kubernetes): the
        supervisor assigns worlds to it (`new_world`). An https:// monitor is verified with
        `ca_file` (else the system's trust store), its certificate checked against
        `server_name` (else the URL's host); an unusable `ca_file` raises ValueError."""
        if rank < 0 or local_rank < 0:
            raise ValueError("rank and local_rank must be >= 0")
        if report_interval_s <= 0:
            raise ValueError("report_interval_s must be > 0")
        self.rank = rank
        self.local_rank = local_rank
        self.monitor_url = monitor_url.rstrip("/") if monitor_url else None
        self.report_interval_s = report_interval_s
        self.job = job or None
        self.instance = instance or None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http: httpx.Client | None = None
        self._ssl: ssl.SSLContext | None = None
        if self.monitor_url is not None:
            self._ssl = ssl_context_for(self.monitor_url, ca_file, server_name)
            self._http = httpx.Client(
                base_url=self.monitor_url,
                headers=self._headers,
                timeout=_REQUEST_TIMEOUT_S,
                trust_env=False,  # the monitor is local: never go through a proxy
                verify=self._ssl if self._ssl is not None else True,
            )
        self._lock = threading.Lock()
        self._step: int | None = None
        self._compute_lock = threading.Lock()
        self._compute_sum = 0.0
        self._compute_count = 0
        self._queue: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(_MAX_QUEUED_REPORTS)
        # Reports queued and not yet sent (or given up on): what `flush` waits for.
        self._unsent = 0
        self._sent = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: set[str] = set()
        self._closed = False
        # Emergency checkpoint: the signal handler only sets this flag.
        self._requested = False
        self._callback: Callable[[], int] | None = None
        self._previous_handler: Any = None
        self._handler_installed = False
        # SIGTERM: report `stopping`, then the previous handler (see `_on_term`).
        self._registered: dict[str, Any] | None = None  # pid and pid_namespace, once ok
        self._register_body: dict[str, Any] | None = None
        self._unknown_to_monitor = False  # a progress report got 404: register again
        self._next_register = 0.0  # monotonic
        self._stop_address: tuple[str, int] | None = None  # the monitor, resolved early
        self._previous_term: Any = None
        self._term_installed = False
        self._stopping_reported = False
        self._finishing_reported = False
        # serve_emergency_checkpoints: the thread that serves them, and its wakeup pipe.
        self._serve_lock = threading.Lock()
        self._emergency_thread: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends
        self._term_grace_s = 1.0
        #: The torch.distributed world this worker trains in (WORKLOAD_ATTEMPT), sent with
        #: each progress report; an in-process restart moves it (see `new_world`).
        self.attempt: str | None = None
        self._report_now = False

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, report_interval_s: float = 0.5
    ) -> WorkerClient:
        """RANK, LOCAL_RANK (default 0), HOST_MONITOR_URL, HOST_MONITOR_WORKER_TOKEN,
        HOST_MONITOR_JOB, WORKLOAD_ATTEMPT, POD_UID, HOST_MONITOR_CA_FILE and
        HOST_MONITOR_SERVER_NAME."""
        env = os.environ if env is None else env
        client = cls(
            int(env.get(ENV_RANK, "0")),
            int(env.get(ENV_LOCAL_RANK, "0")),
            monitor_url=env.get(ENV_MONITOR_URL) or None,
            token=env.get(ENV_TOKEN) or None,
            report_interval_s=report_interval_s,
            job=env.get(ENV_JOB) or None,
            instance=env.get(ENV_INSTANCE) or None,
            ca_file=env.get(ENV_CA_FILE) or None,
            server_name=env.get(ENV_SERVER_NAME) or None,
        )
        attempt = env.get(ENV_ATTEMPT, "")
        client.attempt = attempt if _ATTEMPT_RE.match(attempt) else None
        return client

    # --- state read by the training loop ---------------------------------------------

    @property
    def online(self) -> bool:
        return self._http is not None

    @property
    def checkpoint_requested(self) -> bool:
        """True from a SIGUSR1 until `at_safe_point` serves it."""
        return self._requested

    # --- registration and progress ---------------------------------------------------

    def register(
        self, world_size: int | None = None, *, attempts: int = 5, retry_delay_s: float = 0.2
    ) -> bool:
        """Tell the host monitor this process is rank `rank`; True if it answered.

        Retries briefly (the monitor may still be starting); never raises because it is
        down. Starts the reporting thread either way (online).

        Besides its pid, it sends what finds this process from another PID namespace (the
        host monitor's, when this worker runs in its own pod): its PID namespace's inode
        and its start time (host_monitor/pidns.py); and its job, when known.

        Once registered, and when called from the main thread, it installs the SIGTERM
        handler described in the module's docstring (not when SIGTERM is ignored: then
        this process does not stop on it).
        """
        if self._http is None:
            return False
        body: dict[str, Any] = {"rank": self.rank, "local_rank": self.local_rank}
        if self.job is not None:
            body["job"] = self.job
        if self.instance is not None:
            body["instance"] = self.instance
        me = self_identity()
        body["pid"] = me.pid
        if me.pid_namespace is not None:
            body["pid_namespace"] = me.pid_namespace
        if me.start_time is not None:
            body["start_time"] = me.start_time
        if world_size is not None:
            body["world_size"] = world_size
        self._register_body = body
        ok = False
        for attempt in range(max(1, attempts)):
            if self._post("/v1/workers/register", body, kind="register") is not None:
                ok = True
                self._registered = {"pid": me.pid, "pid_namespace": me.pid_namespace}
                break
            if attempt + 1 < attempts:
                time.sleep(attempt_delay(retry_delay_s, attempt + 1))
        # Even when not registered yet: the thread may register later (see _REREGISTER_*),
        # and the handler reports only once registered.
        self._install_term_handler()
        self._ensure_thread()
        return ok

    def report_step(self, step: int, *, compute_s: float | None = None) -> None:
        """Record `step` as the newest finished step. Cheap: call it every step.

        `compute_s`: the seconds this step spent in the rank's own work (data, forward,
        backward) before it waited for the other ranks in a collective. Sent as a mean
        over the steps between two reports; the supervisor scores stragglers on it.
        """
        self._step = step  # one attribute store: atomic under the GIL
        if compute_s is not None and compute_s >= 0:
            with self._compute_lock:
                self._compute_sum += compute_s
                self._compute_count += 1
        if self._thread is None and self._http is not None:
            self._ensure_thread()

    def report_checkpoint_saved(
        self,
        step: int,
        duration_s: float,
        tier: CheckpointTier,
        *,
        size_bytes: int | None = None,
        total_s: float | None = None,
    ) -> None:
        """Queue a `saved` checkpoint report (sent by the background thread).

        `duration_s`: seconds the training loop was blocked; `size_bytes`: this rank's
        checkpoint size; `total_s`: seconds from the start of the save to its commit.
        """
        self._report_checkpoint("saved", step, duration_s, tier, size_bytes, total_s)

    def report_checkpoint_loaded(
        self,
        step: int,
        duration_s: float,
        tier: CheckpointTier,
        *,
        size_bytes: int | None = None,
        total_s: float | None = None,
    ) -> None:
        """Queue a `loaded` checkpoint report (sent by the background thread); `tier` is
        the tier that served the load, the rest as for `report_checkpoint_saved`."""
        self._report_checkpoint("loaded", step, duration_s, tier, size_bytes, total_s)

    def report_checkpoint_failed(
        self, step: int, tier: CheckpointTier, error: str, *, total_s: float | None = None
    ) -> None:
        """Queue a `failed` checkpoint report (sent by the background thread): the save of
        `step` to `tier` did not commit, with the error (cut to a bounded length). The
        supervisor raises a `checkpoint_failed` event for it."""
        self._report_checkpoint("failed", step, 0.0, tier, None, total_s, error=error)

    def _report_checkpoint(
        self,
        event: str,
        step: int,
        duration_s: float,
        tier: CheckpointTier,
        size_bytes: int | None,
        total_s: float | None,
        *,
        error: str | None = None,
    ) -> None:
        if tier not in _TIERS:
            raise ValueError(f"unknown checkpoint tier {tier!r}")
        if size_bytes is not None and (
            isinstance(size_bytes, bool)
            or not isinstance(size_bytes, int)
            or not 0 <= size_bytes <= _MAX_BYTES
        ):
            raise ValueError(f"size_bytes must be an int in [0, 2**62], got {size_bytes!r}")
        if total_s is not None and not (
            isinstance(total_s, int | float)
            and not isinstance(total_s, bool)
            and math.isfinite(total_s)
            and total_s <= _MAX_TOTAL_S
        ):
            raise ValueError(f"total_s must be finite seconds up to a week, got {total_s!r}")
        if self._http is None:
            return
        body: dict[str, Any] = {
            "event": event,
            "step": step,
            "duration_s": max(0.0, duration_s),
            "tier": tier,
        }
        if size_bytes is not None:
            body["bytes"] = size_bytes
        if total_s is not None:
            body["total_s"] = max(0.0, float(total_s))  # like duration_s: clock jitter
        if error is not None:
            body["error"] = error[:MAX_CHECKPOINT_ERROR_CHARS]
        try:
            with self._sent:
                self._queue.put_nowait((f"/v1/workers/{self.rank}/checkpoints", body))
                self._unsent += 1
        except queue.Full:
            log.warning("worker client: report queue full, dropping a checkpoint report")
        self._ensure_thread()
        self._wake.set()

    # --- emergency checkpoint --------------------------------------------------------

    def on_emergency_checkpoint(self, callback: Callable[[], int]) -> None:
        """On SIGUSR1, flag an emergency checkpoint; `at_safe_point` then calls `callback`.

        `callback()` saves and returns the step it saved. Must be called from the main
        thread (Python installs signal handlers only there).
        """
        self._callback = callback
        if not self._handler_installed:
            self._previous_handler = signal.signal(signal.SIGUSR1, self._on_signal)
            self._handler_installed = True

    def serve_emergency_checkpoints(
        self, callback: Callable[[], int], *, term_grace_s: float = 1.0
    ) -> bool:
        """Serve emergency checkpoints from a thread of the client's own (see the module's
        docstring); True if that thread runs, False if it could not take the wakeup fd
        (something else, e.g. an asyncio loop, uses it), in which case requests are served
        at `at_safe_point` as with `on_emergency_checkpoint`.

        `callback()` must be safe to call from another thread while the main thread trains
        (`training.checkpoint.Checkpointer.emergency_save` is). Call from the main thread,
        after `register()` (so that SIGTERM reaches the thread too).
        """
        if term_grace_s < 0:
            raise ValueError("term_grace_s must be >= 0")
        self.on_emergency_checkpoint(callback)
        if self._emergency_thread is not None:
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
        self._emergency_thread = threading.Thread(
            target=self._serve_signals, name=f"emergency-checkpoint-{self.rank}", daemon=True
        )
        self._emergency_thread.start()
        return True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Signal-safe: a single attribute store, no locks, no I/O.
        self._requested = True

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
                self._stop_if_main_thread_stuck()
            if signal.SIGUSR1 in data:
                self._serve()

    def _stop_if_main_thread_stuck(self) -> None:
        deadline = time.monotonic() + self._term_grace_s
        while time.monotonic() < deadline:
            if self._stopping_reported or not self._term_installed:
                return  # the main thread runs the handler: it decides what happens
            time.sleep(0.01)
        if self._stopping_reported:
            return
        self._stopping_reported = True
        log.warning(
            "worker client: SIGTERM while the main thread is blocked (in a collective?): "
            "stopping now"
        )
        self._report_stopping(signal.SIGTERM)
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(128 + signal.SIGTERM)

    def at_safe_point(self) -> bool:
        """Serve a pending emergency checkpoint; True if one was served.

        Calls the callback, then acks it with POST /v1/workers/{rank}/emergency-ack
        {request_id, ok, step, duration_s, error}. A signal carries no data, so the
        request id is read from the file named by env `HOST_MONITOR_REQUEST_FILE` when it
        is set (and readable), else it is "signal". The host monitor matches any ack that
        arrives after it signalled the worker within a round, so the id is informational.
        A failing callback is acked with ok=false and its error; it does not raise.
        """
        if not self._requested or self._emergency_thread is not None:
            return False  # nothing asked, or the client's thread serves it
        return self._serve()

    def _serve(self) -> bool:
        with self._serve_lock:
            self._requested = False  # a signal arriving during the save asks for another
            self._serve_now()
        return True

    def _serve_now(self) -> None:
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
                error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
                log.error("emergency checkpoint failed: %s", error)
        duration = time.monotonic() - started
        if self._http is not None:
            body: dict[str, Any] = {
                "request_id": _request_id(),
                "ok": error is None,
                "step": step if step is not None and step >= 0 else None,
                "duration_s": duration,
                "error": error,
            }
            # Sent now, not queued: the host monitor is waiting for exactly this.
            for _ in range(2):
                if self._post(f"/v1/workers/{self.rank}/emergency-ack", body, "ack") is not None:
                    break

    # --- in-process restart -------------------------------------------------------------

    def new_world(
        self, timeout_s: float, *, poll_s: float = 0.05, first: bool = False
    ) -> tuple[str, dict[str, str]] | None:
        """Wait for the host monitor to hand this worker a new world to join without
        restarting (an in-process restart): (attempt, its environment: MASTER_ADDR,
        MASTER_PORT, WORLD_SIZE, ...), or None after `timeout_s` (or offline).

        `first`: the world to start in, whatever its attempt (a worker whose supervisor
        assigns every world, such as a pod of a JobSet that heals in-process: a
        replacement pod cannot know from its environment which world the others are in).

        Call `joined(attempt)` once the worker trains in it: the host monitor then knows.
        Emergency checkpoints are served meanwhile (by the client's thread, see
        `serve_emergency_checkpoints`).
        """
        if self._http is None:
            return None
        deadline = time.monotonic() + timeout_s
        path = f"/v1/workers/{self.rank}/world"
        while True:
            try:
                response = self._http.get(path)
                response.raise_for_status()
                body = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                body = None
                if "world" not in self._failing:
                    self._failing.add("world")
                    log.warning("worker client: asking for a new world failed: %s", exc)
            if isinstance(body, dict):
                self._failing.discard("world")
                attempt, env = body.get("attempt"), body.get("env")
                if (
                    isinstance(attempt, str)
                    and (first or attempt != self.attempt)
                    and isinstance(env, dict)
                    and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
                ):
                    return attempt, dict(env)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(poll_s, left))

    def joined(self, attempt: str) -> None:
        """This worker now trains in world `attempt`: tell the host monitor at once."""
        if not _ATTEMPT_RE.match(attempt):
            raise ValueError(f"attempt must match {_ATTEMPT_RE.pattern}, got {attempt!r}")
        self.attempt = attempt
        self._report_now = True
        self._ensure_thread()
        self._wake.set()

    # --- SIGTERM: stopped on purpose --------------------------------------------------

    def _install_term_handler(self) -> None:
        if self._term_installed:
            return
        if threading.current_thread() is not threading.main_thread():
            log.info("worker client: register() not on the main thread: no SIGTERM report")
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return  # SIGTERM does not stop this process: nothing to report
        self._stop_address = _resolve(self.monitor_url)
        self._previous_term = previous
        signal.signal(signal.SIGTERM, self._on_term)
        self._term_installed = True

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes (Python's signal handling), so a
        # blocking call is allowed; it is bounded (_STOPPING_TIMEOUT_S per socket step).
        if not self._stopping_reported:
            self._stopping_reported = True
            self._report_stopping(signum)
        previous = self._previous_term
        if callable(previous):
            previous(signum, frame)
        elif previous is not signal.SIG_IGN:
            # SIG_DFL (or a handler not set from Python): the default action, as if we
            # had never been there. The process ends killed by SIGTERM (exit -15 / 143).
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def finishing(self) -> None:
        """This worker left its training loop and is finishing (its last save, its output):
        its host monitor reports it `finishing`, which the supervisor does not watch for
        hangs but bounds by its `finishing_timeout_s`. `close()` and the Checkpointer's
        `close()` call it; call it as the loop ends when the end takes long. Once."""
        if self._finishing_reported or self._registered is None or self._closed:
            return
        self._finishing_reported = True
        self._post(f"/v1/workers/{self.rank}/finishing", dict(self._registered), "finishing")

    def finished(self) -> None:
        """Training is done and this process is about to exit on its own: tell the host
        monitor now, so that its exit counts as stopped on purpose, not as a failure. A
        host monitor that did not launch this process (a pod on Kubernetes) cannot learn
        its exit code: without this, the end of a job looks like a crash."""
        if self._stopping_reported:
            return
        self._stopping_reported = True
        self._report_stopping(None)

    def _report_stopping(self, signum: int | None) -> None:
        """POST /v1/workers/{rank}/stopping on a connection of its own: the interrupted
        main thread may be inside a request of `self._http` and hold its pool's lock."""
        if self.monitor_url is None or self._registered is None:
            return
        url = urllib.parse.urlsplit(self.monitor_url)
        host, port = self._stop_address or (url.hostname or "", url.port or 0)
        connection = (
            http.client.HTTPSConnection(
                host, port or 443, timeout=_STOPPING_TIMEOUT_S, context=self._ssl
            )
            if url.scheme == "https"
            else http.client.HTTPConnection(host, port or 80, timeout=_STOPPING_TIMEOUT_S)
        )
        body = json.dumps(
            {**self._registered, **({"signal": signum} if signum is not None else {})}
        )
        headers = {
            **self._headers,
            "Host": url.netloc,
            "Content-Type": "application/json",
            "Connection": "close",
        }
        try:
            connection.request("POST", f"{url.path}/v1/workers/{self.rank}/stopping", body, headers)
            response = connection.getresponse()
            text = response.read(_MAX_ERROR_CHARS).decode(errors="replace")
            if response.status >= 300:
                log.warning(
                    "worker client: stopping report refused (HTTP %d): %s", response.status, text
                )
        except (OSError, http.client.HTTPException) as exc:
            log.warning("worker client: stopping report to host monitor failed: %r", exc)
        finally:
            connection.close()

    # --- background thread -----------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._http is None or self._closed:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"worker-client-{self.rank}", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        next_progress = time.monotonic()
        while True:
            self._wake.clear()  # before draining: a report queued from now on wakes us
            stopping = self._stop.is_set()
            self._drain()
            now = time.monotonic()
            if now >= next_progress or stopping or self._report_now:
                self._report_now = False
                self._send_progress()
                next_progress = max(next_progress + self.report_interval_s, now)
                if self._unknown_to_monitor and not stopping:
                    self._register_again(now)
            if stopping:
                self._drain()
                return
            self._wake.wait(max(0.0, next_progress - time.monotonic()))

    def _drain(self) -> None:
        while True:
            try:
                path, body = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                self._post(path, body, kind="checkpoint")
            finally:
                with self._sent:
                    self._unsent -= 1
                    self._sent.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the checkpoint reports queued so far are sent to the host monitor
        (or given up on); False on timeout. Before a process ends on an error: the
        reports of what led to it reach the supervisor first."""
        if self._http is None:
            return True
        self._ensure_thread()
        self._wake.set()
        with self._sent:
            return self._sent.wait_for(lambda: self._unsent <= 0, timeout=timeout_s)

    def _register_again(self, now: float) -> None:
        body = self._register_body
        if body is None or now < self._next_register:
            return
        self._next_register = now + _REREGISTER_EVERY_S
        if self._post("/v1/workers/register", body, kind="register") is not None:
            self._unknown_to_monitor = False
            self._registered = {"pid": body["pid"], "pid_namespace": body.get("pid_namespace")}
            log.info("worker client: registered with the host monitor again")

    def _send_progress(self) -> None:
        body: dict[str, Any] = {"step": self._step}
        if self.attempt is not None:
            body["attempt"] = self.attempt
        with self._compute_lock:
            if self._compute_count:
                body["compute_s"] = min(86400.0, self._compute_sum / self._compute_count)
            self._compute_sum, self._compute_count = 0.0, 0
        self._post(f"/v1/workers/{self.rank}/progress", body, kind="progress")

    def _post(self, path: str, body: dict[str, Any], kind: str) -> Any | None:
        """POST; the decoded reply (or {}), or None on any failure (logged once)."""
        if self._http is None:
            return None
        try:
            response = self._http.post(path, json=body)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            if (
                kind == "progress"
                and isinstance(exc, httpx.HTTPStatusError)
                and exc.response.status_code == 404
            ):
                self._unknown_to_monitor = True
            if kind not in self._failing:
                self._failing.add(kind)
                # A refusal says why in its body (e.g. a registration whose pid the host
                # monitor cannot find): show it, not only the status line.
                why = (
                    f": {_error_text(exc.response)}"
                    if isinstance(exc, httpx.HTTPStatusError)
                    else ""
                )
                log.warning("worker client: %s to host monitor failed: %s%s", kind, exc, why)
            return None
        if kind in self._failing:
            self._failing.discard(kind)
            log.info("worker client: %s to host monitor works again", kind)
        try:
            return response.json() if response.content else {}
        except ValueError:
            return {}

    # --- shutdown --------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after flushing pending reports (and a last progress report);
        restore the SIGUSR1 handler this client replaced. Idempotent."""
        if self._closed:
            return
        self.finishing()
        self._closed = True
        if self._wakeup is not None:
            read_end, write_end = self._wakeup
            if threading.current_thread() is threading.main_thread():
                with contextlib.suppress(ValueError):
                    current = signal.set_wakeup_fd(-1)
                    if current != write_end:  # somebody else's since: put it back
                        signal.set_wakeup_fd(current)
            with contextlib.suppress(OSError):
                os.write(write_end, b"\0")
            thread = self._emergency_thread
            if thread is not None:
                thread.join(timeout_s)  # a save in flight finishes first (it has a timeout)
            if thread is None or not thread.is_alive():  # else its fd number must stay taken
                for fd in (read_end, write_end):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._wakeup = None
            self._emergency_thread = None
        thread = self._thread
        if thread is not None:
            self._stop.set()
            self._wake.set()
            thread.join(timeout_s)
        if self._http is not None:
            self._http.close()
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGUSR1, self._previous_handler)
            self._handler_installed = False
        if self._term_installed and threading.current_thread() is threading.main_thread():
            # Only if ours is still the handler: one installed after it stays.
            if signal.getsignal(signal.SIGTERM) == self._on_term:
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(signal.SIGTERM, self._previous_term)
            self._term_installed = False

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _error_text(response: httpx.Response) -> str:
    """The `detail` or `message` of an error body, else its text (shortened)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        text = body.get("message") or body.get("detail")
        if isinstance(text, str):
            return text[:_MAX_ERROR_CHARS]
    return response.text[:_MAX_ERROR_CHARS]


def ssl_context_for(
    url: str, ca_file: str | None, server_name: str | None
) -> ssl.SSLContext | None:
    """How an https:// monitor is verified; None for http://. Never unverified."""
    if urllib.parse.urlsplit(url).scheme != "https":
        return None
    try:
        return client_context(ca_file, server_name=server_name, ca_name=ENV_CA_FILE)
    except TLSError as exc:
        raise ValueError(f"worker client: {exc}") from None


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


def _request_id() -> str:
    path = os.environ.get(ENV_REQUEST_FILE)
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            value = ""
        if value:
            return value[:_MAX_REQUEST_ID_CHARS]
    return DEFAULT_REQUEST_ID
