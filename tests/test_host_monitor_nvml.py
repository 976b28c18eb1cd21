"""The NVML watchdog against a fake NVML at the library boundary (tests/fake_nvml.py: the
real pynvml module, its calls into the driver answered from states set here)."""

from __future__ import annotations

import asyncio

import pynvml
import pytest

from host_monitor.watchdogs import GpuReporter
from host_monitor.watchdogs.nvml import NvmlWatchdog
from host_monitor.wire import GpuReport
from tests.fake_nvml import FakeGpu, FakeNvml
from tests.timing import scaled


def opened(fake: FakeNvml) -> tuple[NvmlWatchdog, list[GpuReport]]:
    sent: list[GpuReport] = []
    watchdog, line = NvmlWatchdog.open(GpuReporter(0.0, sent.append), 10.0, fake.module)
    assert watchdog is not None, line
    assert line == f"nvml watchdog: {len(fake.gpus)} GPUs, every 10.0s"
    return watchdog, sent


def test_without_a_driver_the_watchdog_says_so_and_is_off() -> None:
    watchdog, line = NvmlWatchdog.open(
        GpuReporter(0.0, print), 10.0, FakeNvml([], driver=False).module
    )
    assert watchdog is None
    assert line.startswith("nvml watchdog disabled:") and "no NVIDIA driver" in line


def test_the_real_binding_without_a_driver_is_off_too() -> None:
    """This machine has nvidia-ml-py and no driver: what a CPU node sees."""
    watchdog, line = NvmlWatchdog.open(GpuReporter(0.0, print), 10.0)
    if watchdog is not None:  # a GPU machine: the real driver answered
        watchdog.close()
        pytest.skip("an NVIDIA driver is present")
    assert "nvml watchdog disabled" in line


def test_ecc_errors_are_reported_when_the_count_grows() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(ecc_uncorrected=2), FakeGpu(ecc_supported=False)])
    watchdog, _ = opened(fake)
    first = watchdog.read()
    # Non-zero at start: volatile counts reset with the driver, so these are new.
    assert [(r.kind, r.gpu, r.count) for r in first] == [("ecc", 1, 2)]
    assert watchdog.read() == []  # unchanged
    fake.gpus[0].ecc_uncorrected = 1
    [report] = watchdog.read()
    assert (report.kind, report.gpu, report.count) == ("ecc", 0, 1)
    assert report.message == "uncorrected volatile ECC errors: 0 -> 1 (NVML)"


def test_rows_pending_remapping_and_a_failed_remapping_are_reported_once_each() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(remapped_rows=None)])
    watchdog, _ = opened(fake)
    assert watchdog.read() == []
    fake.gpus[0].remapped_rows = (0, 1, True, False)
    [pending] = watchdog.read()
    assert (pending.kind, pending.gpu, pending.count) == ("row_remap", 0, 1)
    assert "pending" in (pending.message or "")
    assert watchdog.read() == []  # still pending: told already
    fake.gpus[0].remapped_rows = (0, 1, True, True)
    [failed] = watchdog.read()
    assert failed.message == "row remapping failed"
    # A GPU before row remapping: its retired pages pending a reset.
    fake.gpus[1].retired_pending = True
    [retired] = watchdog.read()
    assert (retired.kind, retired.gpu) == ("row_remap", 1)
    assert retired.message == "retired pages pending: reset the GPU"


def test_nvlink_errors_of_every_link_are_summed_and_reported_when_they_grow() -> None:
    replay, crc = pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT
    fake = FakeNvml([FakeGpu(nvlink={0: {}, 3: {}}), FakeGpu()])  # GPU 1: no NVLink
    watchdog, _ = opened(fake)
    assert watchdog.read() == []
    fake.gpus[0].nvlink[0][replay] = 2
    fake.gpus[0].nvlink[3][crc] = 5
    [report] = watchdog.read()
    assert (report.kind, report.gpu, report.count) == ("nvlink", 0, 7)
    assert report.message == "NVLink errors: 0 -> 7"
    assert watchdog.read() == []


def test_a_hardware_slowdown_is_reported_when_it_starts() -> None:
    fake = FakeNvml([FakeGpu()])
    watchdog, _ = opened(fake)
    # Idle and a software power cap are not the hardware's: nothing to tell.
    fake.gpus[0].clocks_event_reasons = (
        pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonSwPowerCap
    )
    assert watchdog.read() == []
    fake.gpus[0].clocks_event_reasons |= pynvml.nvmlClocksEventReasonHwThermalSlowdown
    [report] = watchdog.read()
    assert (report.kind, report.gpu) == ("throttle", 0)
    assert report.message == "hardware thermal slowdown"
    assert watchdog.read() == []  # still slowed: told already
    fake.gpus[0].clocks_event_reasons = 0
    assert watchdog.read() == []
    fake.gpus[0].clocks_event_reasons = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
    assert [r.message for r in watchdog.read()] == ["power brake"]


async def test_xid_events_are_reported_as_they_come_and_the_wait_ends_on_close() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu()])
    watchdog, sent = opened(fake)
    assert watchdog.start_events(asyncio.get_running_loop())
    fake.xid(1, 79)
    deadline = asyncio.get_running_loop().time() + scaled(2)
    while not sent:
        assert asyncio.get_running_loop().time() < deadline, "the XID was not reported"
        await asyncio.sleep(0.01)
    assert [(r.kind, r.gpu, r.code) for r in sent] == [("xid", 1, 79)]
    watchdog.close()
    assert "event-set-free" in fake.calls and fake.calls[-1] == "shutdown"


async def test_an_increase_held_back_by_the_cooldown_goes_out_after_it() -> None:
    fake = FakeNvml([FakeGpu(ecc_uncorrected=1)])
    sent: list[GpuReport] = []
    clock = [0.0]
    reporter = GpuReporter(60.0, sent.append, clock=lambda: clock[0])
    watchdog, _ = NvmlWatchdog.open(reporter, 10.0, fake.module)
    assert watchdog is not None
    await watchdog.check()
    fake.gpus[0].ecc_uncorrected = 2
    await watchdog.check()  # within the cooldown of (ecc, gpu 0): held back
    assert [r.count for r in sent] == [1]
    clock[0] = 61.0
    await watchdog.check()
    assert [r.count for r in sent] == [1, 2]
    assert sent[1].message == "uncorrected volatile ECC errors: 1 -> 2 (NVML)"
