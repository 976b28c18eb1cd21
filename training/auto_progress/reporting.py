"""The automatic step count at work in one worker process: torch's global optimizer hook
counts (`counter.StepCounter`), and a thread of its own registers with the host monitor,
then steps aside as soon as the script's own WorkerClient shows up.

Imported when torch.optim is, so it may import what it needs: torch is loaded already.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from training.auto_progress.counter import StepCounter

if TYPE_CHECKING:
    from training.auto_progress.client import CounterClient

log = logging.getLogger("training.auto_progress")


class AutoProgress:
    """The count of one process. `install()` once torch.optim is imported."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        # None: the process's own, read when registering (what WorkerClient.from_env reads).
        self._env = env
        self.counter = StepCounter()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: The client steps go to, once registered (set by the thread).
        self.client: CounterClient | None = None
        #: Set for good: the script's own client took over, or the count failed, or this
        #: is a forked child (its optimizer steps are not the worker's).
        self.off = False
        #: The thread has ended: registered and then stepped aside, or never registered.
        self.done = threading.Event()

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self.on_optimizer_step)
        os.register_at_fork(after_in_child=self._forked)

    def on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's post-step hook, in the training thread: cheap, and never raises into
        the step (report_step only stores the step; the client's thread sends it)."""
        if self.off:
            return
        try:
            steps = self.counter.optimizer_stepped(optimizer)
            client = self.client
            if client is not None:
                client.report_step(steps)
            elif self._thread is None:
                # Registering is a blocking HTTP call, retried: not in the training thread.
                self._thread = threading.Thread(target=self._run, name="auto-progress", daemon=True)
                self._thread.start()
        except Exception:
            self.off = True
            log.exception("training.auto_progress: the step count stopped")

    def _run(self) -> None:
        try:
            self._register_then_step_aside()
        except Exception:
            self.off = True
            log.exception("training.auto_progress: the step count stopped")
        finally:
            self.done.set()

    def _register_then_step_aside(self) -> None:
        from training import worker_client
        from training.auto_progress.client import CounterClient

        script_client = worker_client.script_client_seen
        if script_client.is_set():
            self.off = True  # the script registered before its first step: its own count
            return
        env = os.environ if self._env is None else self._env
        client = CounterClient.from_env(env)
        assert isinstance(client, CounterClient)  # from_env builds its class's
        if not client.online:
            self.off = True
            return
        client.register(world_size=_world_size(env))
        client.report_step(self.counter.steps)  # the steps taken while registering
        self.client = client
        atexit.register(self._exiting)
        # From here the hook reports. The script's client, if one comes: its register()
        # stops ours first (step_aside); one that only reports steps, this thread.
        worker_client.step_aside.append(self._step_aside)
        script_client.wait()
        self._step_aside()

    def _step_aside(self) -> None:
        # Also run by the script's register() (step_aside): never raises into it.
        self.off = True
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            try:
                # Without `finishing` (CounterClient): the worker trains on, the script's
                # client speaks for it now.
                client.close()
            except Exception:
                log.exception("training.auto_progress: stopping the count's client failed")

    def _exiting(self) -> None:
        # The script's main module has returned (or raised): the worker is finishing, and
        # torch's own exit can take seconds with no step, which is no hang. Said while the
        # client's thread still runs: once the interpreter finalizes, no report goes out.
        with self._lock:
            client = None if self.off else self.client
        if client is not None:
            client.exiting()

    def _forked(self) -> None:
        self.off = True


def _world_size(env: Mapping[str, str]) -> int | None:
    raw = env.get("WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None
