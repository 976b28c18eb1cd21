"""The node's workers: the ones we launched and the ones that registered themselves.

A launched worker is our child (`subprocess.Popen`, in its own session, so its process
group holds whatever it forks), or the child of the job's warm standby on this node
(`host_monitor/standby.py`, in a session of its own too): its exit code comes from
`poll()`. A worker that only
registered (e.g. a training process in a Kubernetes pod) is not our child: it has exited
when its pid is gone, and its exit code is unknown.

A worker that registers from another PID namespace (its own pod) gives its pid there; we
find its pid in ours once, at registration (host_monitor/pidns.py), and poll and signal
that one (`host_pid`). What we report, in the local API and in heartbeats, is `pid`: the
pid the worker knows itself by, as its own logs and `ps` in its pod show it.

`poll()` is meant to be called often (~0.1 s, as torchelastic polls its workers): one
`waitpid(WNOHANG)` or `kill(pid, 0)` per live worker."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from host_monitor import pidns
from host_monitor.errors import HostMonitorError
from host_monitor.processes import LaunchedProcess, pid_alive, proc_start_time
from resiliency_protocol.node_commands import WorkerStatus
from resiliency_protocol.states import WorkerState
from resiliency_protocol.worker_wire import WorkerFinishing, WorkerRegistration, WorkerStopping

log = logging.getLogger(__name__)

ALIVE = frozenset(
    {WorkerState.STARTING, WorkerState.RUNNING, WorkerState.LOST, WorkerState.FINISHING}
)
# After SIGKILL, how long we wait for the kernel to reap a process before giving up on it
# (a process in uninterruptible sleep, e.g. stuck in a GPU driver call, can outlive it).
KILL_WAIT_S = 5.0
STOP_POLL_S = 0.02


class WorkerNotFound(HostMonitorError, KeyError):
    """No worker with this rank on this node."""


class WorkerConflict(HostMonitorError):
    """The request does not fit the workers' current state (HTTP 409)."""


@dataclass(slots=True)
class Worker:
    rank: int
    local_rank: int
    state: WorkerState
    pid: int | None = None  # the pid the worker registered with, else the one we launched
    # The same process in our PID namespace: the one polled and signalled. Differs from
    # `pid` only for a worker that registered from another PID namespace.
    host_pid: int | None = None
    pid_namespace: int | None = None  # as registered; None for pids of our namespace
    proc: LaunchedProcess | None = None  # set when we launched it
    start_time: str | None = None  # of a registered-only host_pid, see proc_start_time
    step: int | None = None
    compute_s: float | None = None
    exit_code: int | None = None
    registered: bool = False
    last_progress: float = 0.0  # monotonic; registration counts as progress
    # Stopped on purpose (by us, or it reported a SIGTERM from kubelet): its exit is
    # `stopped`, not `exited`.
    stopping: bool = False
    log_path: Path | None = None
    request_file: Path | None = None  # HOST_MONITOR_REQUEST_FILE of a launched worker
    attempt: str | None = None  # the world it reported training in
    # An in-process restart: (attempt, env) of the world to join, until it reports it.
    world: tuple[str, dict[str, str]] | None = None
    instance: str | None = None  # as registered (a pod's UID): see AssignWorldRequest
    emergency_checkpoints: bool = False  # it handles SIGUSR1: only then is it signalled

    @property
    def alive(self) -> bool:
        return self.state in ALIVE

    @property
    def launched(self) -> bool:
        return self.proc is not None

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            rank=self.rank,
            local_rank=self.local_rank,
            pid=self.pid,
            host_pid=self.host_pid,
            state=self.state,
            step=self.step,
            exit_code=self.exit_code,
            attempt=self.attempt,
            compute_s=self.compute_s,
        )

    def signal(self, sig: signal.Signals, *, group: bool = True) -> bool:
        """Send `sig`; to the whole process group when we launched it and `group`.

        Returns False when there was no process to signal.
        """
        try:
            if self.proc is not None and group:
                # start_new_session made the worker a group leader: pgid == its pid.
                os.killpg(self.proc.pid, sig)
            elif self.host_pid is not None:
                os.kill(self.host_pid, sig)
            else:
                return False
        except ProcessLookupError:
            return False
        except PermissionError:  # an adopted process of another user
            log.warning(
                "not allowed to send %s to rank %d (host pid %s)",
                sig.name,
                self.rank,
                self.host_pid,
            )
            return False
        return True


class WorkerRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        on_change: Callable[[Worker], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # Called on every state change: the agent heartbeats at once instead of waiting.
        self._on_change = on_change
        self._clock = clock
        self.workers: dict[int, Worker] = {}
        self.starts = 0  # workers launched (or standbys taken over), for metrics
        self.pid_namespace = pidns.pid_namespace("self")  # ours, to compare workers' with

    # --- queries ------------------------------------------------------------------------

    def get(self, rank: int) -> Worker:
        worker = self.workers.get(rank)
        if worker is None:
            raise WorkerNotFound(rank)
        return worker

    def live(self) -> list[Worker]:
        return [w for _, w in sorted(self.workers.items()) if w.alive]

    def statuses(self) -> list[WorkerStatus]:
        return [w.status() for _, w in sorted(self.workers.items())]

    def target(self, rank: int | None) -> Worker:
        """The worker a fault hits: `rank`, else the lowest live one."""
        if rank is not None:
            return self.get(rank)
        live = self.live()
        if not live:
            raise WorkerConflict("no live worker on this node")
        return live[0]

    # --- changes ------------------------------------------------------------------------

    def launch(
        self,
        rank: int,
        local_rank: int,
        command: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        request_file: Path | None = None,
        *,
        standby: LaunchedProcess | None = None,
    ) -> Worker:
        """Start one worker in its own session, output appended to `log_path`; or adopt
        `standby`, the worker a warm standby forked for it (standby.py).

        Raises OSError when the command cannot be run (nothing is registered then).
        """
        existing = self.workers.get(rank)
        if existing is not None and existing.alive:
            raise WorkerConflict(f"rank {rank} is already running (pid {existing.pid})")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        proc: LaunchedProcess
        if standby is not None:
            proc = standby
        else:
            with log_path.open("ab") as out:
                proc = subprocess.Popen(
                    list(command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: signals reach children
                    close_fds=True,
                )
        worker = Worker(
            rank=rank,
            local_rank=local_rank,
            state=WorkerState.STARTING,
            pid=proc.pid,
            host_pid=proc.pid,
            proc=proc,
            last_progress=self._clock(),
            log_path=log_path,
            request_file=request_file,
        )
        self.workers[rank] = worker
        self.starts += 1
        how = "standby forked" if standby is not None else "launched"
        log.info("%s rank %d (pid %d), log %s", how, rank, proc.pid, log_path)
        return worker

    def register(self, reg: WorkerRegistration) -> Worker:
        """Raises WorkerConflict, changing nothing, when the worker's process is not found."""
        host_pid = self._host_pid(reg)
        now = self._clock()
        worker = self.workers.get(reg.rank)
        if worker is not None and worker.launched and worker.alive:
            # One of ours: it may have registered from a child (a wrapper script), so keep
            # the Popen for its exit code and remember the pid that handles our signals.
            worker.pid = reg.pid
            worker.host_pid = host_pid
            worker.pid_namespace = reg.pid_namespace
            worker.local_rank = reg.local_rank
        else:
            # A process we did not start (or a new one for a rank whose worker is gone).
            worker = Worker(
                rank=reg.rank,
                local_rank=reg.local_rank,
                state=WorkerState.RUNNING,
                pid=reg.pid,
                host_pid=host_pid,
                pid_namespace=reg.pid_namespace,
                start_time=proc_start_time(host_pid),
            )
            self.workers[reg.rank] = worker
        worker.registered = True
        worker.instance = reg.instance
        worker.emergency_checkpoints = reg.emergency_checkpoints
        worker.last_progress = now
        self._set(worker, WorkerState.RUNNING)
        if host_pid == reg.pid:
            log.info("rank %d registered (pid %d)", reg.rank, reg.pid)
        else:
            log.info(
                "rank %d registered (pid %d in PID namespace %s = host pid %d)",
                reg.rank,
                reg.pid,
                reg.pid_namespace,
                host_pid,
            )
        return worker

    def _host_pid(self, reg: WorkerRegistration) -> int:
        """`reg.pid` in our PID namespace: itself, unless the worker is in another one.

        One /proc scan per registration from another namespace; polls never scan.
        """
        if (
            reg.pid_namespace is None
            or self.pid_namespace is None
            or reg.pid_namespace == self.pid_namespace
        ):
            return reg.pid
        identity = pidns.PidIdentity(reg.pid, reg.pid_namespace, reg.start_time)
        try:
            return pidns.find_host_pid(identity, own_pid_namespace=self.pid_namespace)
        except pidns.PidNotFound as exc:
            log.warning("registration of rank %d refused: %s", reg.rank, exc)
            raise WorkerConflict(f"pid: {exc}") from None

    def progress(
        self,
        rank: int,
        step: int | None,
        attempt: str | None = None,
        compute_s: float | None = None,
    ) -> Worker:
        worker = self.get(rank)
        if not worker.alive:
            return worker  # a late report from a worker we already saw go
        worker.last_progress = self._clock()
        if step is not None:
            worker.step = step
        if compute_s is not None:
            worker.compute_s = compute_s
        if attempt is not None:
            worker.attempt = attempt
            if worker.world is not None and worker.world[0] == attempt:
                worker.world = None  # joined
        worker.registered = True
        if worker.state not in (WorkerState.RUNNING, WorkerState.FINISHING):
            self._set(worker, WorkerState.RUNNING)
        return worker

    def finishing(self, rank: int, report: WorkerFinishing) -> Worker:
        """The worker left its loop and is finishing: `finishing` until it exits (its last
        progress reports keep it so). WorkerConflict for another process's report."""
        worker = self.get(rank)
        self.check_same_process(rank, worker, report.pid, report.pid_namespace)
        if worker.alive and worker.state is not WorkerState.FINISHING:
            log.info("rank %d (pid %s) is finishing", rank, worker.pid)
            self._set(worker, WorkerState.FINISHING)
        return worker

    def check_same_process(
        self, rank: int, worker: Worker, pid: int, pid_namespace: int | None
    ) -> None:
        same_namespace = (
            pid_namespace is None
            or worker.pid_namespace is None
            or pid_namespace == worker.pid_namespace
        )
        if pid != worker.pid or not same_namespace:
            raise WorkerConflict(
                f"pid: rank {rank} is pid {worker.pid} (namespace {worker.pid_namespace}), "
                f"not pid {pid} (namespace {pid_namespace}): report ignored"
            )

    def stopping(self, rank: int, report: WorkerStopping) -> Worker:
        """The worker says it is being stopped (SIGTERM): its exit will be `stopped`.

        Raises WorkerConflict when `report` is from another process than the registered
        one (e.g. the old pod of a rank whose new pod registered already).
        """
        worker = self.get(rank)
        self.check_same_process(rank, worker, report.pid, report.pid_namespace)
        if worker.alive and not worker.stopping:
            worker.stopping = True
            log.info(
                "rank %d (pid %s) is stopping (signal %s): its exit will not be a failure",
                rank,
                worker.pid,
                report.signal,
            )
        return worker

    def poll(self) -> bool:
        """Look at every live worker's process and progress; True if any state changed."""
        changed = False
        now = self._clock()
        for worker in list(self.workers.values()):
            if not worker.alive:
                continue
            if self._check_exit(worker):
                changed = True
            elif (
                worker.registered
                and not worker.stopping  # shutting down: silence is expected
                and worker.state is WorkerState.RUNNING
                and now - worker.last_progress > self.heartbeat_timeout_s
            ):
                self._set(worker, WorkerState.LOST)
                changed = True
        return changed

    async def stop(
        self,
        grace_s: float,
        *,
        launched_only: bool = False,
        only: Iterable[Worker] | None = None,
    ) -> dict[int, int | None]:
        """SIGTERM the live workers, SIGKILL those still alive after `grace_s`.

        Their state becomes `stopped` (not `exited`: the supervisor must not treat our own
        stop as a failure). `launched_only` spares the workers we did not start; `only`
        limits the stop to these. Returns the exit code of every worker, by rank.
        """
        candidates = self.live() if only is None else [w for w in only if w.alive]
        targets = [w for w in candidates if w.launched or not launched_only]
        for worker in targets:
            worker.stopping = True
            worker.signal(signal.SIGTERM)
            # A SIGSTOPped (hung) worker only acts on SIGTERM once continued.
            worker.signal(signal.SIGCONT)
        deadline = self._clock() + grace_s
        while any(w.alive for w in targets) and self._clock() < deadline:
            self.poll()
            await asyncio.sleep(STOP_POLL_S)
        stubborn = [w for w in targets if w.alive]
        for worker in stubborn:
            log.warning("rank %d still alive %.1fs after SIGTERM: SIGKILL", worker.rank, grace_s)
            worker.signal(signal.SIGKILL)
        deadline = self._clock() + KILL_WAIT_S
        while any(w.alive for w in stubborn) and self._clock() < deadline:
            self.poll()
            await asyncio.sleep(STOP_POLL_S)
        for worker in targets:
            if worker.launched:
                # The leader is gone; leave none of its children behind.
                worker.signal(signal.SIGKILL)
        return {rank: w.exit_code for rank, w in sorted(self.workers.items())}

    def kill_all(self) -> list[int]:
        """SIGKILL every live worker at once (node_down). Returns their ranks."""
        hit = []
        for worker in self.live():
            worker.stopping = True
            if worker.signal(signal.SIGKILL):
                hit.append(worker.rank)
        return hit

    def forget(self, ranks: Iterable[int] | None = None) -> None:
        """Drop finished workers (all of them when `ranks` is None)."""
        for rank in list(self.workers if ranks is None else ranks):
            worker = self.workers.get(rank)
            if worker is not None and not worker.alive:
                del self.workers[rank]

    # --- internals ----------------------------------------------------------------------

    def _check_exit(self, worker: Worker) -> bool:
        if worker.proc is not None:
            code = worker.proc.poll()
            if code is None:
                return False
            worker.exit_code = code
        elif worker.host_pid is not None:
            if pid_alive(worker.host_pid, worker.start_time):
                return False
            worker.exit_code = None  # not our child: nobody tells us
        else:
            return False
        finishing = worker.state is WorkerState.FINISHING
        # A worker that was finishing and exited with code 0 ended the job: `exited 0`,
        # which every later heartbeat carries, so that a supervisor that did not hear the
        # `finishing` (down or unreachable at the time) still learns the job's end.
        # Stopped on purpose, or finishing with an exit code nobody tells us (not our
        # child): stopped, not a crash.
        succeeded = finishing and worker.exit_code == 0
        ended = not succeeded and (worker.stopping or (finishing and worker.exit_code is None))
        self._set(worker, WorkerState.STOPPED if ended else WorkerState.EXITED)
        return True

    def _set(self, worker: Worker, state: WorkerState) -> None:
        if worker.state is state:
            return
        if state in (WorkerState.EXITED, WorkerState.STOPPED):
            log.info(
                "rank %d (pid %s) %s with exit code %s",
                worker.rank,
                worker.pid,
                state.value,
                worker.exit_code,
            )
        elif state is WorkerState.LOST:
            log.warning(
                "rank %d (pid %s) lost: no progress for %.1fs",
                worker.rank,
                worker.pid,
                self.heartbeat_timeout_s,
            )
        elif worker.state is WorkerState.LOST:
            log.info("rank %d reports progress again", worker.rank)
        worker.state = state
        if self._on_change is not None:
            self._on_change(worker)
