"""A warm standby: imports the training code once, then forks a worker per order.

A worker's start is mostly Python starting and importing torch (1.1-1.5 s per process on
a 2-core machine, far more with CUDA on a large node), all of it on the critical path of
a recovery. The host monitor keeps one standby per job on its node:

    python -m training.warm_start --reply-fd 5 --preload training.torch_workload.train

It imports the `--preload` modules, says it is ready on the reply pipe, then reads orders
on stdin, one JSON line each (`resiliency_protocol.standby_orders.WorkerOrder`). For each
it forks: the child starts a session of its own (its process group, as a launched
worker's), sends its output to the order's log (appended), replaces its environment with
the order's, and runs the module or the script as `python -m module` or `python script.py`
would (`runpy`), exiting as that interpreter would (atexit handlers, threads joined). The
standby answers each order with the child's pid and, when a child ends, its exit code, on
the reply pipe; so every start of the job on this node after the first costs a fork, not
an import. Anything that reads the environment only when imported (OMP_NUM_THREADS in
torch) comes from the environment the standby was started with, which the host monitor
makes the job's. A module it could not preload is said in its log, and left for the
worker to import. The random generators a new interpreter seeds from the OS's entropy are
seeded afresh in each child, and the automatic step count is the child's own. What the
standby holds when it forks is frozen for the collector (`gc.freeze`, as Python's
documentation advises before a fork without exec): a worker's collections walk only its
own objects, and leave the standby's pages shared.

When stdin closes (the host monitor dropped it), the standby takes no more orders, waits
for the workers it forked and exits 64; it dies with its host monitor (PR_SET_PDEATHSIG,
set by the host monitor), its workers do not, as launched workers do not.

Standard library only, besides what it preloads.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import importlib
import os
import runpy
import select
import signal
import sys
import types

from resiliency_protocol.standby_orders import (
    Exited,
    Forked,
    Ready,
    Reply,
    WorkerOrder,
    reply_line,
)

EXIT_DROPPED = 64

#: What a preloaded package imports only on first use, in every worker that uses it: torch
#: imports `torch._dynamo` when the first optimizer is made (half a second of CPU per
#: worker here). Imported once here, after the preloads, when the package is among them.
FIRST_USE_IMPORTS = {"torch": ("torch._dynamo",)}


class ForkServer:
    def __init__(self, reply_fd: int) -> None:
        self.reply_fd = reply_fd
        self.children: set[int] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # SIGCHLD wakes the select below through the pipe: no polling while idle.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def serve(self) -> WorkerOrder | None:
        """Take orders until stdin closes (then None, once every child is reaped); in a
        forked child, return its order."""
        stdin = sys.stdin.buffer
        self._reply(Ready())
        buffered = b""
        open_ = True
        while open_ or self.children:
            watched = [self._wake_r] + ([stdin.fileno()] if open_ else [])
            try:
                ready, _, _ = select.select(watched, [], [])
            except InterruptedError:
                ready = []
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 512)
            self._reap()
            if open_ and stdin.fileno() in ready:
                chunk = os.read(stdin.fileno(), 65536)
                if not chunk:
                    open_ = False
                buffered += chunk
                while b"\n" in buffered:
                    line, buffered = buffered.split(b"\n", 1)
                    order = self._fork(line)
                    if order is not None:
                        return order  # the child
        return None

    def _fork(self, line: bytes) -> WorkerOrder | None:
        try:
            order = WorkerOrder.parse(line)
        except ValueError as exc:
            print(f"warm start: bad order: {exc}", file=sys.stderr, flush=True)
            self._reply(Forked(error=f"bad order: {exc}"))
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        # What the standby holds is the workers' too, for their whole life: frozen, their
        # collector never walks it (a full collection of a forked torch worker walked
        # every object the imports made, and wrote to each page it touched, unsharing it).
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            self._become_child()
            return order
        self.children.add(pid)
        self._reply(Forked(pid=pid))
        return None

    def _become_child(self) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (self._wake_r, self._wake_w, self.reply_fd):
            os.close(fd)
        os.setsid()  # as a launched worker: its own session and process group

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self._reply(Exited(pid, os.waitstatus_to_exitcode(status)))

    def _reply(self, reply: Reply) -> None:
        try:
            os.write(self.reply_fd, reply_line(reply))
        except OSError as exc:  # the host monitor is gone: nobody to tell
            if exc.errno not in (errno.EPIPE, errno.EBADF):
                raise


def _run(order: WorkerOrder) -> None:
    if order.log is not None:
        fd = os.open(order.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # as a launched worker: nothing on stdin
    os.close(null)
    os.environ.clear()
    os.environ.update(order.env)
    if order.cwd is not None:
        os.chdir(order.cwd)
    _seed_afresh()
    _count_progress_afresh()
    program = order.program
    if program.module is not None:
        sys.argv = [program.module, *program.args]
        _keep_as_main(runpy.run_module(program.module, run_name="__main__", alter_sys=True))
        return
    script = os.path.abspath(program.script or "")
    sys.argv = [program.script or "", *program.args]
    # As `python script.py`: the script's directory first on the path, not the standby's
    # working directory.
    sys.path[0] = os.path.dirname(script)
    _keep_as_main(runpy.run_path(script, run_name="__main__"))


def _keep_as_main(namespace: dict[str, object]) -> None:
    """The worker's namespace, as `runpy` returns it, kept as `__main__` until the
    interpreter ends, as `python script.py` keeps its own: its objects (a DDP model, its
    process group) are destroyed after the exit hooks, where the automatic step count says
    the worker is finishing. Dropped here, they were destroyed first, and such a
    destruction that blocked left a worker with no step and no `finishing` said: a hang
    to its host monitor. A module of its own: the standby's was frozen before the fork
    (`gc.freeze`), and what it holds would never be collected."""
    main = types.ModuleType("__main__")
    main.__dict__.update(namespace)
    sys.modules["__main__"] = main


def _count_progress_afresh() -> None:
    """The automatic step count (training.auto_progress) activated in the standby at its
    start, as in any worker: a forked process does not count (the count of its parent's
    process), so the worker activates its own, with its own environment."""
    auto_progress = sys.modules.get("training.auto_progress")
    if auto_progress is not None:
        auto_progress.activate_in_forked_worker()


def _seed_afresh() -> None:
    """Seed the generators a launched interpreter seeds from the OS's entropy: torch's
    CPU generator and NumPy's global one, when preloaded, would otherwise be the
    standby's, the same in every worker it forks (the same dropout masks on every rank,
    the same again after each restart). Python's `random` CPython reseeds after a fork;
    a script that seeds its generators itself is not affected."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _preload(module: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # the worker imports it itself, and fails as it would
        print(f"warm start: not preloaded: {module}: {exc!r}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m training.warm_start")
    parser.add_argument("--preload", action="append", default=[], help="A module to import now.")
    parser.add_argument("--reply-fd", type=int, required=True, help="The pipe replies go to.")
    args = parser.parse_args()
    for module in args.preload:
        _preload(module)
    for package, modules in FIRST_USE_IMPORTS.items():
        if package in sys.modules:
            for module in modules:
                _preload(module)
    gc.collect()  # the imports' garbage, before freezing what is left (ForkServer._fork)
    order = ForkServer(args.reply_fd).serve()
    if order is None:
        return EXIT_DROPPED
    _run(order)
    return 0


if __name__ == "__main__":
    sys.exit(main())
