"""GPU watchdogs (xid.py: kernel log; ecc.py: nvidia-smi), and what they share here.

- `Watchdog`: a loop that checks its source every period, or at once when poked (a fault
  injected through our API is seen without waiting a whole period).
- `GpuReporter`: the per-(kind, gpu, code) cooldown in front of the heartbeat sender, so
  a GPU that logs the same XID a hundred times a second costs one report.

nvidia_smi.py runs nvidia-smi and maps PCI addresses to GPU indices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from host_monitor.wire import GpuReport

log = logging.getLogger(__name__)

ReportKey = tuple[str, int | None, int | None]


class GpuReporter:
    """Cooldown per (kind, gpu, code) between the watchdogs and the heartbeat sender."""

    def __init__(
        self,
        cooldown_s: float,
        deliver: Callable[[GpuReport], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cooldown_s = cooldown_s
        self._deliver = deliver
        self._clock = clock
        self._last: dict[ReportKey, float] = {}

    def offer(self, report: GpuReport) -> bool:
        """Deliver `report` unless the same one went out less than the cooldown ago."""
        key = (report.kind, report.gpu, report.code)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.cooldown_s:
            log.debug("gpu report %s within cooldown: dropped", key)
            return False
        self._last[key] = now
        log.warning(
            "gpu report: %s gpu=%s code=%s count=%s %s",
            report.kind,
            report.gpu,
            report.code,
            report.count,
            report.message or "",
        )
        self._deliver(report)
        return True


class Watchdog(ABC):
    """Checks a source every `period_s`, or at once when poked."""

    name = "watchdog"

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._poke = asyncio.Event()
        self._last_error: str | None = None

    def poke(self) -> None:
        self._poke.set()

    @property
    def healthy(self) -> bool:
        """Whether the last check ran (False after one raised, until one runs again)."""
        return self._last_error is None

    @abstractmethod
    async def check(self) -> None:
        """Look at the source once and report what is new."""

    async def run(self) -> None:
        while True:
            self._poke.clear()
            try:
                await self.check()
            except Exception as exc:
                # Log a failure once, not once per period, until it changes.
                text = f"{type(exc).__name__}: {exc}"
                if text != self._last_error:
                    log.exception("%s check failed", self.name)
                    self._last_error = text
            else:
                self._last_error = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self.period_s)
