"""The entry point of each command of the distribution: its CLI, or one line saying which
extra to install when a dependency of that extra is missing.

The base install is the training side's (what every process imports); the service and
the node agent come with extras (`server`, `host-monitor`). Without one, its command says
so rather than ending in a traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

OURS = frozenset({"supervisor", "host_monitor", "training", "resiliency_protocol", "policies"})


def run_cli(target: str, prog: str, extra: str, what: str) -> None:
    """Import `target` ("module:function") and call it; a missing third-party module ends
    the process with one line naming the extra (`what` says what needs it), whether the
    command's module imports it or the subcommand run (a command imports the parts of
    each subcommand as it runs them)."""
    module, _, name = target.partition(":")
    try:
        main: Callable[[], None] = getattr(importlib.import_module(module), name)
        main()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in OURS:
            raise  # a bug of ours, not a missing extra
        raise SystemExit(
            f"{prog}: {exc.name} is not installed; {what} needs "
            f"pip install 'resiliency-supervisor[{extra}]'"
        ) from None
