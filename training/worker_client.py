"""What a training loop imports to talk to its node's host monitor.

Nothing of the supervisor or the host monitor: the bodies sent are the models of
resiliency_protocol (`worker_wire`, `checkpoint_reports`, `emergency`: the worker routes,
`/v1/workers/...`), which the host monitor's routes take.

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

import os
import threading
from collections.abc import Callable, Mapping

from resiliency_protocol import worker_env
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.worker_wire import WorkerFinishing, worker_path
from training.monitor_link.connection import MonitorConnection
from training.monitor_link.connection import ssl_context_for as ssl_context_for
from training.monitor_link.emergency import DEFAULT_REQUEST_ID as DEFAULT_REQUEST_ID
from training.monitor_link.emergency import EmergencyServer
from training.monitor_link.lease import LEASE_EXIT_CODE as LEASE_EXIT_CODE
from training.monitor_link.lease import HostLease, HostLeaseExpired, LeaseSettings
from training.monitor_link.registration import Registration
from training.monitor_link.reporter import Reporter
from training.monitor_link.stopping import TermHandler
from training.monitor_link.worlds import ATTEMPT_RE, Worlds

__all__ = ["CheckpointTier", "HostLeaseExpired", "LeaseSettings", "WorkerClient"]

#: A checkpoint's tier; the report methods take its members or their strings ("ram").
CheckpointTier = Tier

# Env variables read by `WorkerClient.from_env` and `at_safe_point`.
ENV_RANK = worker_env.RANK
ENV_LOCAL_RANK = worker_env.LOCAL_RANK
ENV_MONITOR_URL = worker_env.HOST_MONITOR_URL
ENV_TOKEN = worker_env.HOST_MONITOR_WORKER_TOKEN
# The host monitor's TLS (host_monitor/config.py sets them).
ENV_CA_FILE = worker_env.HOST_MONITOR_CA_FILE
ENV_SERVER_NAME = worker_env.HOST_MONITOR_SERVER_NAME
ENV_REQUEST_FILE = worker_env.HOST_MONITOR_REQUEST_FILE
ENV_JOB = worker_env.HOST_MONITOR_JOB
ENV_ATTEMPT = worker_env.WORKLOAD_ATTEMPT
ENV_INSTANCE = worker_env.POD_UID  # on Kubernetes, from the downward API (metadata.uid)

#: Set once a client of the script's own registers or reports a step in this process.
#: `training.auto_progress` (which counts optimizer steps for a script that reports none)
#: then steps aside: the script's steps and registration win, no step is counted twice.
script_client_seen = threading.Event()
#: Run by the script's first `register()`, in its thread, before its registration goes
#: out: the count stops its own client there, so that no report of it comes after.
step_aside: list[Callable[[], None]] = []


class WorkerClient:
    """One training worker's link to its host monitor.

    `report_step` and the checkpoint reports only hand data to a daemon thread, which
    POSTs the newest step every `report_interval_s` (that POST is also the worker's
    heartbeat, so it is sent even when the step did not change), with the mean compute
    time of the steps since the last one. Nothing here raises because the host monitor is
    down or slow: failures are logged (once per kind of failure until one succeeds again)
    and dropped.

    Its parts live in `training.monitor_link`: the connection, the registration, the
    reporting thread, the SIGTERM handling, the emergency checkpoints and the worlds.
    """

    #: False only for `training.auto_progress`'s own client (see `script_client_seen`).
    reports_for_script = True

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
        lease: LeaseSettings | None = None,
    ) -> None:
        """`lease`: the rank's lease on its host monitor's word of the supervisor
        (training/monitor_link/lease.py; default `LeaseSettings()`). `instance`: what
        this process runs in, once (its pod's UID on Kubernetes): the
        supervisor assigns worlds to it (`new_world`). An https:// monitor is verified with
        `ca_file` (else the system's trust store), its certificate checked against
        `server_name` (else the URL's host); an unusable `ca_file` raises ValueError."""
        if rank < 0 or local_rank < 0:
            raise ValueError("rank and local_rank must be >= 0")
        if report_interval_s <= 0:
            raise ValueError("report_interval_s must be > 0")
        self.rank = rank
        self.local_rank = local_rank
        self.report_interval_s = report_interval_s
        self.job = job or None
        self.instance = instance or None
        self._connection = MonitorConnection(monitor_url, token, ca_file, server_name)
        self.monitor_url = self._connection.url
        self._registration = Registration(
            self._connection, rank, local_rank, self.job, self.instance
        )
        #: Runs out `host_lease_s` after the supervisor last answered the host monitor.
        self.lease = HostLease(
            lease if lease is not None else LeaseSettings(), rank, grace_s=report_interval_s
        )
        self._reporter = Reporter(
            self._connection, self._registration, rank, report_interval_s, self.lease
        )
        self._term = TermHandler(self._connection, self._registration, rank)
        self._emergency = EmergencyServer(
            self._connection,
            rank,
            self._term.stop_if_main_thread_stuck,
            self._registration.take_emergency_checkpoints,
        )
        self._worlds = Worlds(self._connection, self._reporter, rank)
        self._finishing_reported = False
        self._closed = False

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, report_interval_s: float = 0.5
    ) -> WorkerClient:
        """RANK, LOCAL_RANK (default 0), HOST_MONITOR_URL, HOST_MONITOR_WORKER_TOKEN,
        HOST_MONITOR_JOB, WORKLOAD_ATTEMPT, POD_UID, HOST_MONITOR_CA_FILE and
        HOST_MONITOR_SERVER_NAME, HOST_LEASE_S."""
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
            lease=LeaseSettings.from_env(env),
        )
        attempt = env.get(ENV_ATTEMPT, "")
        client.attempt = attempt if ATTEMPT_RE.match(attempt) else None
        return client

    # --- state read by the training loop ---------------------------------------------

    @property
    def online(self) -> bool:
        return self._connection.http is not None

    @property
    def checkpoint_requested(self) -> bool:
        """True from a SIGUSR1 until `at_safe_point` serves it."""
        return self._emergency.requested

    @property
    def attempt(self) -> str | None:
        """The torch.distributed world this worker trains in (WORKLOAD_ATTEMPT), sent with
        each progress report; an in-process restart moves it (see `new_world`)."""
        return self._reporter.attempt

    @attempt.setter
    def attempt(self, attempt: str | None) -> None:
        self._reporter.attempt = attempt

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
        if self._connection.http is None:
            return False
        if self.reports_for_script and not script_client_seen.is_set():
            script_client_seen.set()
            for callback in step_aside:
                callback()
        ok = self._registration.register(world_size, attempts, retry_delay_s)
        # Even when not registered yet: the thread may register later (Registration), and
        # the handler reports only once registered.
        self._term.install()
        self._reporter.ensure_thread()
        return ok

    def report_step(self, step: int, *, compute_s: float | None = None) -> None:
        """Record `step` as the newest finished step. Cheap: call it every step.

        Once the rank's lease ran out (training/monitor_link/lease.py), the process ends
        with status LEASE_EXIT_CODE within one report interval, whatever it is doing.

        `compute_s`: the seconds this step spent in the rank's own work (data, forward,
        backward) before it waited for the other ranks in a collective. Sent as a mean
        over the steps between two reports; the supervisor scores stragglers on it.
        """
        if self.reports_for_script and not script_client_seen.is_set():
            script_client_seen.set()
        self._reporter.report_step(step, compute_s)

    def report_checkpoint_saved(
        self,
        step: int,
        duration_s: float,
        tier: Tier | str,
        *,
        size_bytes: int | None = None,
        total_s: float | None = None,
    ) -> None:
        """Queue a `saved` checkpoint report (sent by the background thread).

        `duration_s`: seconds the training loop was blocked; `size_bytes`: this rank's
        checkpoint size; `total_s`: seconds from the start of the save to its commit.
        """
        self._reporter.report_checkpoint("saved", step, duration_s, tier, size_bytes, total_s)

    def report_checkpoint_loaded(
        self,
        step: int,
        duration_s: float,
        tier: Tier | str,
        *,
        size_bytes: int | None = None,
        total_s: float | None = None,
    ) -> None:
        """Queue a `loaded` checkpoint report (sent by the background thread); `tier` is
        the tier that served the load, the rest as for `report_checkpoint_saved`."""
        self._reporter.report_checkpoint("loaded", step, duration_s, tier, size_bytes, total_s)

    def report_checkpoint_failed(
        self, step: int, tier: Tier | str, error: str, *, total_s: float | None = None
    ) -> None:
        """Queue a `failed` checkpoint report (sent by the background thread): the save of
        `step` to `tier` did not commit, with the error (cut to a bounded length). The
        supervisor raises a `checkpoint_failed` event for it."""
        self._reporter.report_checkpoint("failed", step, 0.0, tier, None, total_s, error=error)

    def check_lease(self, what: str) -> None:
        """HostLeaseExpired when the rank's lease ran out: `what` (a durable write) must
        not happen."""
        self.lease.check(what)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the checkpoint reports queued so far are sent to the host monitor
        (or given up on); False on timeout. Before a process ends on an error: the
        reports of what led to it reach the supervisor first."""
        return self._reporter.flush(timeout_s)

    # --- emergency checkpoint --------------------------------------------------------

    def on_emergency_checkpoint(self, callback: Callable[[], int]) -> None:
        """On SIGUSR1, flag an emergency checkpoint; `at_safe_point` then calls `callback`.

        `callback()` saves and returns the step it saved. Must be called from the main
        thread (Python installs signal handlers only there).
        """
        self._emergency.on_emergency_checkpoint(callback)

    def serve_emergency_checkpoints(
        self,
        callback: Callable[[], int],
        *,
        term_grace_s: float = 1.0,
        on_exit: Callable[[], None] = lambda: None,
        exit_wait_s: float = 60.0,
    ) -> bool:
        """Serve emergency checkpoints from a thread of the client's own (see the module's
        docstring); True if that thread runs, False if it could not take the wakeup fd
        (something else, e.g. an asyncio loop, uses it), in which case requests are served
        at `at_safe_point` as with `on_emergency_checkpoint`.

        `callback()` must be safe to call from another thread while the main thread trains
        (`training.checkpoint.Checkpointer.emergency_save` is). Call from the main thread,
        after `register()` (so that SIGTERM reaches the thread too). A request taken when
        the process ends (the training loop raised) is finished before it does, within
        `exit_wait_s`, `on_exit()` called first.
        """
        return self._emergency.serve_from_thread(
            callback, term_grace_s, on_exit=on_exit, exit_wait_s=exit_wait_s
        )

    def at_safe_point(self) -> bool:
        """Serve a pending emergency checkpoint; True if one was served.

        Calls the callback, then acks it with POST /v1/workers/{rank}/emergency-ack
        {request_id, ok, step, duration_s, error}. A signal carries no data, so the
        request id is read from the file named by env `HOST_MONITOR_REQUEST_FILE` when it
        is set (and readable), else it is "signal". The host monitor matches any ack that
        arrives after it signalled the worker within a round, so the id is informational.
        A failing callback is acked with ok=false and its error; it does not raise.
        """
        return self._emergency.at_safe_point()

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
        return self._worlds.new_world(timeout_s, poll_s, first)

    def joined(self, attempt: str) -> None:
        """This worker now trains in world `attempt`: tell the host monitor at once."""
        self._worlds.joined(attempt)

    # --- the end: finishing, stopped on purpose --------------------------------------

    def finishing(self) -> None:
        """This worker left its training loop and is finishing (its last save, its output):
        its host monitor reports it `finishing`, which the supervisor does not watch for
        hangs but bounds by its `finishing_timeout_s`. `close()` and the Checkpointer's
        `close()` call it; call it as the loop ends when the end takes long. Once."""
        registered = self._registration.registered
        if self._finishing_reported or registered is None or self._closed:
            return
        self._finishing_reported = True
        body = self._connection.body(
            WorkerFinishing,
            "finishing",
            pid=registered.pid,
            pid_namespace=registered.pid_namespace,
        )
        if body is not None:
            self._connection.post(worker_path(self.rank, "finishing"), body, "finishing")

    def finished(self) -> None:
        """Training is done and this process is about to exit on its own: tell the host
        monitor now, so that its exit counts as stopped on purpose, not as a failure. A
        host monitor that did not launch this process (a pod on Kubernetes) cannot learn
        its exit code: without this, the end of a job looks like a crash."""
        self._term.finished()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after flushing pending reports (and a last progress report);
        restore the SIGUSR1 handler this client replaced. Idempotent."""
        if self._closed:
            return
        self.finishing()
        self._closed = True
        self._reporter.closed = True
        self._emergency.stop_thread(timeout_s)
        self._reporter.stop(timeout_s)
        self.lease.close()
        # Before the connection closes: putting the handler back tells the host monitor.
        self._emergency.restore_handler()
        self._connection.close()
        self._term.restore()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
