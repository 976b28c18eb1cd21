"""A fake NVML at the library boundary: NVIDIA's own `pynvml` module (its constants, its
error classes, its event-data struct) with the calls that would enter libnvidia-ml.so
answered from GPU states a test sets. Errors are raised as pynvml raises them
(`pynvml.NVMLError(code)` returns the code's subclass), so what is caught is real.
"""

from __future__ import annotations

import queue
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    ecc_uncorrected: int = 0
    #: (corrected rows, uncorrected rows, pending, failure); None: no row remapping.
    remapped_rows: tuple[int, int, bool, bool] | None = (0, 0, False, False)
    retired_pending: bool = False
    #: link -> counter -> value; a link absent is NOT_SUPPORTED.
    nvlink: dict[int, dict[int, int]] = field(default_factory=dict)
    clocks_event_reasons: int = 0
    ecc_supported: bool = True


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu], *, driver: bool = True) -> None:
        self.gpus = gpus
        self.driver = driver
        self.events: queue.Queue[tuple[int, int]] = queue.Queue()
        self.calls: list[str] = []
        self.module = self._module()

    def xid(self, gpu: int, code: int) -> None:
        """The driver raises an XID on `gpu`: an event for whoever waits."""
        self.events.put((gpu, code))

    def _module(self) -> types.ModuleType:
        """pynvml without its calls into the library (any left unanswered here is absent,
        so a call the fake does not know fails loudly), with this fake's instead."""
        fake = types.ModuleType("pynvml")
        for name, value in vars(pynvml).items():
            if not (name.startswith("nvml") and callable(value)):
                setattr(fake, name, value)
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(fake, name, getattr(self, name))
        return fake

    def _gpu(self, handle: Any) -> FakeGpu:
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[handle.index]

    # --- the calls the watchdog makes -----------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if not self.driver:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        self._gpu(handle)
        return int(handle.index)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int) -> int:
        gpu = self._gpu(handle)
        if error_type != pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            raise AssertionError("the watchdog reads uncorrected errors")
        if counter != pynvml.NVML_VOLATILE_ECC:
            raise AssertionError("the watchdog reads volatile counts")
        if not gpu.ecc_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        if gpu.remapped_rows is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        corrected, uncorrected, pending, failed = gpu.remapped_rows
        return corrected, uncorrected, int(pending), int(failed)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        return pynvml.NVML_FEATURE_ENABLED if gpu.retired_pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        gpu = self._gpu(handle)
        if link >= pynvml.NVML_NVLINK_MAX_LINKS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link not in gpu.nvlink:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.nvlink[link].get(counter, 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle).clocks_event_reasons

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: Any, types_: int, event_set: object) -> None:
        self._gpu(handle)
        assert types_ & pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> Any:
        try:
            gpu, code = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        data = pynvml.c_nvmlEventData_t()
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = code
        result: Any = types.SimpleNamespace(
            device=_Handle(gpu), eventType=data.eventType, eventData=data.eventData
        )
        return result

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.calls.append("event-set-free")
