"""The functions stored jobs call (module-level: APScheduler keeps them by reference).

Each finds the acting supervisor by the job's `host` key (supervisor.schedules.registry)
and does one turn of its work there; with no supervisor registered under the key, or
one that may no longer act (it lost the Lease: its fence is closed), the turn is not
done here: a write from an older leader never wins.
"""

from __future__ import annotations

import logging
from typing import Any

from supervisor.actuator import Fenced
from supervisor.schedules import registry
from supervisor.schedules.maintenance import Window, run_step

log = logging.getLogger(__name__)


def _acting(host: str, what: str) -> Any | None:
    supervisor = registry.lookup(host)
    try:
        if supervisor is None or not supervisor.ready:
            raise Fenced("not acting")
        supervisor.fence()
    except Fenced as exc:
        log.warning("%s: not run here (%s)", what, exc)
        return None
    return supervisor


async def run_drill(host: str, fault: int) -> None:
    """One turn of a fault drill: inject one fault of its kinds."""
    supervisor = _acting(host, f"drill {fault}")
    if supervisor is not None:
        await supervisor.faults.drill_turn(fault)


async def run_window(host: str, window: dict[str, Any]) -> None:
    """A maintenance window's start or end."""
    supervisor = _acting(host, f"maintenance window {window.get('id')}")
    if supervisor is not None:
        await run_step(supervisor, Window.of({"window": window}))
