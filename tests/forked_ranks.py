"""The rank processes of tests that start a job's ranks themselves, forked by a warm standby.

Each rank is a real process of its own that runs its job module as `python -m` would (or
a user's script as `python script.py` would), in its own session, with its own
environment; but it is forked by the product's warm standby (training/warm_start.py,
host_monitor/standby.py), one per pytest process, which imported torch once, rather than
started as a new interpreter that imports torch again. The import is
2.5-4 s of CPU per process on CI's 2-core machine, most of a short rank's life, and these
modules start hundreds of ranks. What they check (what a rank saves, restores, and exits
with) does not depend on how its interpreter started; the tests of the launchers
themselves (torchrun, the host monitor's launch and its standby) start fresh interpreters.

Only the job's code runs in the fork: what torch reads from the environment when it is
imported comes from the standby's environment, made here as the ranks' is
(OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

from host_monitor.standby import ForkedWorker, Standby, Standbys
from resiliency_protocol.standby_orders import WorkerOrder
from tests.timing import scaled
from training.warm_start import EXIT_DROPPED

ROOT = Path(__file__).resolve().parent.parent

#: What the job modules import from torch: the standby's import, once (and what torch
#: imports on first use: training/warm_start.py). Nothing of the training package: its
#: modules come fresh in each rank, as in a script's own imports.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.nn.parallel",
)

#: This process's standbys, by what they import.
_standbys: dict[tuple[str, ...], Standbys] = {}
_run_dir: Path | None = None
_forking = threading.Lock()
#: What the one thread that starts every standby is asked (`_started`).
_to_start: queue.Queue[tuple[tuple[str, ...], Future[Standby]]] = queue.Queue()


class RankProcess:
    """A forked rank (or service: tests/forked_services.py), with what the tests use of
    `subprocess.Popen`: its output is its log file (stdout and stderr together)."""

    def __init__(self, worker: ForkedWorker, log_path: Path) -> None:
        self._worker = worker
        self.pid = worker.pid
        self.log_path = log_path

    @property
    def returncode(self) -> int | None:
        return self._worker.returncode

    def poll(self) -> int | None:
        return self._worker.poll()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.output(), None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _standby_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CHECKPOINT_", "HOST_", "JOB_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def _warm_standby(preload: tuple[str, ...] = PRELOAD) -> Standby:
    """This pytest process's warm standby that imported `preload`, started and warm: one
    for every job module and script that imports no more, since a standby imports only
    its preload, whatever it forks."""
    global _run_dir
    if _run_dir is None:
        _run_dir = Path(tempfile.mkdtemp(prefix="forked-ranks-"))
        atexit.register(_drop_all)
    standbys = _standbys.get(preload)
    if standbys is None:
        name = f"ranks-{len(_standbys)}"
        standbys = _standbys[preload] = Standbys(_run_dir, name)
    # The command names the standby only: each order says what the rank runs.
    command = [sys.executable, "-m", "training.warm_start"]
    # False once it died: a standby is not started again (host_monitor/standby.py).
    assert standbys.prepare("tests", command, _standby_env(), preload), (
        f"the ranks' standby died: see {_run_dir}"
    )
    deadline = time.monotonic() + scaled(120)
    while not standbys.warm:
        assert standbys.ready is not None, f"the ranks' standby exited: see {_run_dir}"
        assert time.monotonic() < deadline, f"the ranks' standby is not warm: see {_run_dir}"
        time.sleep(0.05)
    standby = standbys.ready
    assert standby is not None, f"the ranks' standby exited: see {_run_dir}"
    return standby


def _started(preload: tuple[str, ...]) -> Standby:
    """`_warm_standby(preload)`, from the thread that starts every standby. The kernel
    kills a standby (its PR_SET_PDEATHSIG) when the thread that started it ends, not the
    process: one started from a test's own thread (a ThreadPoolExecutor's, which ends with
    its pool) died with it, and every later fork failed. A daemon thread, so it outlives
    the session's end, where its standbys are dropped (`_drop_all`)."""
    if not any(t.name == "standby-starter" for t in threading.enumerate()):
        threading.Thread(target=_start_standbys, name="standby-starter", daemon=True).start()
    done: Future[Standby] = Future()
    _to_start.put((preload, done))
    return done.result()


def _start_standbys() -> None:
    while True:
        preload, done = _to_start.get()
        try:
            done.set_result(_warm_standby(preload))
        except BaseException as exc:  # the asker raises it
            done.set_exception(exc)


def start_rank(
    module: str, env: Mapping[str, str], log_path: Path, argv: Sequence[str] = ()
) -> RankProcess:
    """One rank of `module` (run as `python -m module *argv` in the checkout) with `env`
    (replacing the environment), its output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    order = WorkerOrder(("-m", module, *argv), dict(env), str(ROOT), str(log_path))
    return RankProcess(fork(order), log_path)


def start_script(
    script: Path,
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path | None = None,
    preload: tuple[str, ...] = PRELOAD,
) -> RankProcess:
    """One rank of a user's `script` (run as `python script.py` in `cwd`, by default its
    folder) with `env` (replacing the environment), its output appended to `log_path`,
    forked by a standby that imported `preload` (more than torch where the script imports
    more, as Lightning)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    folder = str(cwd or script.parent)
    order = WorkerOrder((str(script),), dict(env), folder, str(log_path))
    return RankProcess(fork(order, preload), log_path)


def fork(order: WorkerOrder, preload: tuple[str, ...] = PRELOAD) -> ForkedWorker:
    """`order`, forked by this process's standby of `preload`: one order at a time, from
    whatever thread (a standby's replies come in its orders' order, and a test may start
    its processes side by side)."""
    with _forking:
        return _started(preload).fork(order)


def torchrun_env(world: int, port: int) -> list[dict[str, str]]:
    """Each rank's variables, in rank order, as `torchrun --standalone --nproc-per-node
    world` sets them on its one node (its rendezvous on `port` of the loopback)."""
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    return [{**common, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world)]


def wait_all(ranks: Sequence[RankProcess], timeout_s: float) -> list[int]:
    """Each rank's exit code, in order, each waited for `timeout_s` at most; every rank
    killed afterwards (one that did not end: the wait's TimeoutExpired)."""
    try:
        return [rank.wait(timeout_s) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()


def log_path(directory: Path, rank: int) -> Path:
    """A new log file for `rank` in `directory` (a run started again there gets its own)."""
    n = 0
    while (path := directory / f"rank-{rank}.{n}.log").exists():
        n += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def standby_pids() -> list[int]:
    """The standbys of this pytest process still running (their CPU and that of the ranks
    they reaped reach this process only when it reaps them, at its end)."""
    return [standby.proc.pid for s in _standbys.values() if (standby := s.ready) is not None]


def _drop_all() -> None:
    """At the session's end: each standby takes no more orders and exits after its ranks.
    Their logs are kept only when one did not exit cleanly (its log says why)."""
    clean = True
    for standbys in _standbys.values():
        standby = standbys.ready
        standbys.drop()
        if standby is None:
            clean = False  # it died before the end
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            standby.proc.wait(scaled(10))
        clean = clean and standby.proc.returncode == EXIT_DROPPED
    if clean and _run_dir is not None:
        shutil.rmtree(_run_dir, ignore_errors=True)
