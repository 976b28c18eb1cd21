"""GPU health through NVML (`nvidia-ml-py`, NVIDIA's own binding), where the driver is.

Every period, for each GPU:
- uncorrected volatile ECC errors (`ecc`, the GPU's total, reported when it grows);
- row remapping (`row_remap`): rows waiting for a GPU reset to be remapped, or a
  remapping that failed; on GPUs without row remapping, retired pages pending;
- NVLink error counters (`nvlink`: replay, recovery and CRC errors of every link, summed;
  reported when the sum grows);
- hardware clock slowdowns for heat or power (`throttle`, when one starts).

XIDs come as NVML events (`nvmlEventTypeXidCriticalError`), waited for in a thread of
their own, and reported at once. A counter NVML does not support on a GPU is skipped
for that GPU; NVML calls run in threads, bounded by a timeout, since a sick GPU can make
them block. Without the NVML library (no driver) `NvmlWatchdog.open` says why and the
host monitor keeps its kernel-log and nvidia-smi watchdogs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from host_monitor.watchdogs import GpuReporter, Watchdog
from host_monitor.wire import GpuReport
from resiliency_protocol.clock import utcnow
from resiliency_protocol.heartbeat import GPU_ECC, GPU_XID

log = logging.getLogger(__name__)

#: The longest one round of NVML calls may take before the round is given up.
NVML_CALL_TIMEOUT_S = 10.0
#: How long one wait for an XID event blocks its thread (it checks for close between).
EVENT_WAIT_MS = 1000

# Hardware slowdowns worth telling (the others are the driver's or the user's choice:
# idle, application clocks, software power cap, sync boost).
_SLOWDOWNS = (
    ("nvmlClocksEventReasonHwSlowdown", "hardware slowdown"),
    ("nvmlClocksEventReasonHwThermalSlowdown", "hardware thermal slowdown"),
    ("nvmlClocksEventReasonSwThermalSlowdown", "software thermal slowdown"),
    ("nvmlClocksEventReasonHwPowerBrakeSlowdown", "power brake"),
)
_NVLINK_COUNTERS = (
    "NVML_NVLINK_ERROR_DL_REPLAY",
    "NVML_NVLINK_ERROR_DL_RECOVERY",
    "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "NVML_NVLINK_ERROR_DL_CRC_DATA",
)


@dataclass
class _Seen:
    """What was last reported of one GPU, so that only changes go out."""

    ecc: int = 0
    remap: tuple[int, bool, bool] = (0, False, False)
    nvlink: int = 0
    throttle: int = 0
    unsupported: set[str] = field(default_factory=set)


class NvmlWatchdog(Watchdog):
    name = "nvml watchdog"

    def __init__(self, nvml: ModuleType, reporter: GpuReporter, period_s: float) -> None:
        super().__init__(period_s)
        self.nvml = nvml
        self.reporter = reporter
        self._seen: dict[int, _Seen] = {}
        self._handles: list[Any] = []
        self._closed = threading.Event()
        self._events: threading.Thread | None = None

    @classmethod
    def open(
        cls, reporter: GpuReporter, period_s: float, nvml: ModuleType | None = None
    ) -> tuple[NvmlWatchdog | None, str]:
        """The watchdog, initialised, or None; and a line saying which, for the log."""
        if nvml is None:
            try:
                import pynvml  # the `nvidia-ml-py` distribution
            except ImportError:
                return None, "nvml watchdog disabled: nvidia-ml-py is not installed"
            nvml = pynvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            return None, f"nvml watchdog disabled: {exc} (no NVIDIA driver here?)"
        watchdog = cls(nvml, reporter, period_s)
        watchdog._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        return watchdog, f"nvml watchdog: {count} GPUs, every {period_s:.1f}s"

    # --- XID events -----------------------------------------------------------------

    def start_events(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Wait for XID events in a thread; each is offered to the reporter on `loop`.
        False when this driver delivers none (the kernel log still does)."""
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
        except nvml.NVMLError as exc:
            log.warning("nvml watchdog: no XID events from NVML (%s)", exc)
            return False

        def wait() -> None:
            while not self._closed.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(events, EVENT_WAIT_MS)
                except nvml.NVMLError as exc:
                    if exc.value == nvml.NVML_ERROR_TIMEOUT:
                        continue
                    log.warning("nvml watchdog: waiting for XID events failed: %s", exc)
                    self._closed.wait(1.0)
                    continue
                try:
                    gpu: int | None = int(nvml.nvmlDeviceGetIndex(data.device))
                except nvml.NVMLError:
                    gpu = None
                report = GpuReport(
                    kind=GPU_XID,
                    gpu=gpu,
                    code=int(data.eventData),
                    message=f"Xid {int(data.eventData)} (NVML event)",
                    time=utcnow(),
                )
                loop.call_soon_threadsafe(self.reporter.offer, report)
            nvml.nvmlEventSetFree(events)

        self._events = threading.Thread(target=wait, name="nvml-xid-events", daemon=True)
        self._events.start()
        return True

    def close(self) -> None:
        self._closed.set()
        if self._events is not None:
            self._events.join(timeout=2 * EVENT_WAIT_MS / 1000)
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    # --- counters -------------------------------------------------------------------

    async def check(self) -> None:
        before = {gpu: dataclasses.replace(seen) for gpu, seen in self._seen.items()}
        reports = await asyncio.wait_for(asyncio.to_thread(self.read), NVML_CALL_TIMEOUT_S)
        for report in reports:
            if not self.reporter.offer(report) and report.gpu in before:
                # Held back by the cooldown: what it tells stays unreported, so that it
                # goes out on the first round after the cooldown.
                self._forget(report, before[report.gpu])

    def _forget(self, report: GpuReport, previous: _Seen) -> None:
        seen = self._seen[report.gpu or 0]
        if report.kind == GPU_ECC:
            seen.ecc = previous.ecc
        elif report.kind == "nvlink":
            seen.nvlink = previous.nvlink
        elif report.kind == "row_remap":
            seen.remap = previous.remap
        elif report.kind == "throttle":
            seen.throttle = previous.throttle

    def read(self) -> list[GpuReport]:
        """One round over every GPU: the reports of what changed since the last round."""
        out: list[GpuReport] = []
        for gpu, handle in enumerate(self._handles):
            seen = self._seen.setdefault(gpu, _Seen())
            out += self._ecc(gpu, handle, seen)
            out += self._remap(gpu, handle, seen)
            out += self._nvlink(gpu, handle, seen)
            out += self._throttle(gpu, handle, seen)
        return out

    def _call(self, seen: _Seen, what: str, fn: Callable[..., Any], *args: Any) -> Any | None:
        """`fn(*args)`, or None where this GPU does not support it (then never again)."""
        if what in seen.unsupported:
            return None
        nvml = self.nvml
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if exc.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT):
                seen.unsupported.add(what)
                return None
            raise

    def _ecc(self, gpu: int, handle: Any, seen: _Seen) -> list[GpuReport]:
        nvml = self.nvml
        total = self._call(
            seen,
            GPU_ECC,
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        if total is None:
            return []
        before, seen.ecc = seen.ecc, int(total)
        if seen.ecc <= before:
            return []
        message = f"uncorrected volatile ECC errors: {before} -> {seen.ecc} (NVML)"
        return [GpuReport(kind=GPU_ECC, gpu=gpu, count=seen.ecc, message=message, time=utcnow())]

    def _remap(self, gpu: int, handle: Any, seen: _Seen) -> list[GpuReport]:
        nvml = self.nvml
        rows = self._call(seen, "remap", nvml.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            _corrected, uncorrected, pending, failed = rows
            state = (int(uncorrected), bool(pending), bool(failed))
        else:
            # Before row remapping (Volta and older): retired pages waiting for a reset.
            retired = self._call(
                seen, "retired", nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle
            )
            if retired is None:
                return []
            state = (0, retired == nvml.NVML_FEATURE_ENABLED, False)
        before, seen.remap = seen.remap, state
        uncorrected, pending, failed = state
        if not ((pending and not before[1]) or (failed and not before[2])):
            return []
        what = "row remapping failed" if failed else "rows pending remapping: reset the GPU"
        if rows is None:
            what = "retired pages pending: reset the GPU"
        return [
            GpuReport(kind="row_remap", gpu=gpu, count=uncorrected, message=what, time=utcnow())
        ]

    def _nvlink(self, gpu: int, handle: Any, seen: _Seen) -> list[GpuReport]:
        nvml = self.nvml
        total, any_link = 0, False
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            for counter in _NVLINK_COUNTERS:
                value = self._call(
                    seen,
                    f"nvlink-{link}-{counter}",
                    nvml.nvmlDeviceGetNvLinkErrorCounter,
                    handle,
                    link,
                    getattr(nvml, counter),
                )
                if value is not None:
                    total, any_link = total + int(value), True
        if not any_link:
            return []
        before, seen.nvlink = seen.nvlink, total
        if total <= before:
            return []
        message = f"NVLink errors: {before} -> {total}"
        return [GpuReport(kind="nvlink", gpu=gpu, count=total, message=message, time=utcnow())]

    def _throttle(self, gpu: int, handle: Any, seen: _Seen) -> list[GpuReport]:
        nvml = self.nvml
        reasons = self._call(seen, "throttle", nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if reasons is None:
            return []
        bits = 0
        for name, _ in _SLOWDOWNS:
            bits |= int(reasons) & getattr(nvml, name)
        before, seen.throttle = seen.throttle, bits
        started = bits & ~before
        if not started:
            return []
        names = [text for name, text in _SLOWDOWNS if bits & getattr(nvml, name)]
        return [GpuReport(kind="throttle", gpu=gpu, message=", ".join(names), time=utcnow())]
