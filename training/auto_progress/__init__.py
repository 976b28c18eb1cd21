"""Training progress for a script that reports none: its optimizer steps, counted.

A PyTorch script that imports nothing of this project, run under `supervisor run` or
`training.pod_launch`, has its steps reported to the host monitor all the same, so that a
rank that stops making progress (frozen, stuck) is detected, not only one that exits:

- Activation: those launchers put `STARTUP_DIR` first on each worker's PYTHONPATH
  (`startup_env`); its `sitecustomize` calls `activate()` at interpreter start, then runs
  the `sitecustomize` it shadows, if any. `activate()` imports nothing heavy: it waits
  for torch.optim to be imported (a meta path finder, `imports.after_import`), then
  installs torch's global hook `register_optimizer_step_post_hook`. A process that never
  imports torch pays for a few small modules and nothing more.
- Counting: one training step per round of optimizer steps (`counter.StepCounter`: an
  optimizer that steps again starts the next step), counted from 1 in each process.
- Reporting: at the first optimizer step, a thread of its own registers a WorkerClient
  (from the worker's environment; world size WORLD_SIZE) with the host monitor; the hook
  then hands each count to the client (`report_step`, which only stores it: the client's
  thread sends it). At the interpreter's exit (atexit) it says the worker is finishing:
  torch's own exit can take seconds without a report, which is no hang.
- A script with a WorkerClient of its own (one that registers or reports a step, in the
  same process) is its own count: the automatic one never registers when the script's
  client came first, and steps aside (stops its own client, without `finishing`) as that
  client registers, before its registration goes out
  (`training.worker_client.script_client_seen`, `step_aside`).
- Only the worker process itself: the startup directory is taken off PYTHONPATH for the
  processes it starts, and a forked child does not count.

Off: RESILIENCY_AUTO_PROGRESS=0 in the worker's environment (or `supervisor run
--no-auto-progress`). Nothing happens either without a host monitor (HOST_MONITOR_URL).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from resiliency_protocol.worker_env import AUTO_PROGRESS, HOST_MONITOR_URL

TYPE_CHECKING = False  # typing's, without importing typing at every interpreter start
if TYPE_CHECKING:
    from training.auto_progress.reporting import AutoProgress

#: The directory with the `sitecustomize` that activates the count, for PYTHONPATH.
STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
_OFF = frozenset({"0", "false", "no", "off"})

#: This process's count, once torch.optim is imported (after `activate()`).
active: AutoProgress | None = None
_activated = False


def enabled(env: Mapping[str, str]) -> bool:
    """Whether `env` leaves the count on (RESILIENCY_AUTO_PROGRESS not 0/false/no/off)."""
    return env.get(AUTO_PROGRESS, "").strip().lower() not in _OFF


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a worker started with `env` gets to activate the count at its interpreter's
    start: PYTHONPATH with `STARTUP_DIR` first. Nothing when `env` turns it off."""
    if not enabled(env):
        return {}
    rest = env.get("PYTHONPATH", "")
    if rest.split(os.pathsep)[0] == STARTUP_DIR:
        return {"PYTHONPATH": rest}
    return {"PYTHONPATH": STARTUP_DIR + (os.pathsep + rest if rest else "")}


def activate(env: Mapping[str, str] | None = None) -> bool:
    """Count this process's optimizer steps as its progress, from the moment torch.optim
    is imported (now, if it is already). False, doing nothing, when `env` (default: the
    process's) turns it off, names no host monitor, or when already activated."""
    global _activated
    env = os.environ if env is None else env
    if _activated or not enabled(env) or not env.get(HOST_MONITOR_URL):
        return False
    _activated = True
    from training.auto_progress.imports import after_import

    after_import("torch.optim", lambda _module: _install(None if env is os.environ else env))
    return True


def activate_in_forked_worker() -> bool:
    """In a worker forked by a warm standby (training/warm_start.py), with the worker's
    environment in place: the count activated at the standby's start is its parent's (a
    forked child does not count); this process's own starts now, as `activate()` at an
    interpreter's start, and the startup directory leaves PYTHONPATH as the startup's
    `sitecustomize` takes it off."""
    global _activated, active
    from training.auto_progress.imports import cancel_waiting

    cancel_waiting()  # the standby's, still waiting for torch.optim
    _activated, active = False, None
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in entries if not p or os.path.abspath(p) != STARTUP_DIR]
    if len(kept) != len(entries):
        if any(kept):
            os.environ["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            del os.environ["PYTHONPATH"]
    return activate()


def _install(env: Mapping[str, str] | None) -> None:
    global active
    try:
        from training.auto_progress.reporting import AutoProgress

        count = AutoProgress(env)
        count.install()
        active = count
    except Exception as exc:  # torch's import must not fail for it
        print(f"training.auto_progress: no step count: {exc!r}", file=sys.stderr)


__all__ = ["STARTUP_DIR", "activate", "activate_in_forked_worker", "enabled", "startup_env"]
