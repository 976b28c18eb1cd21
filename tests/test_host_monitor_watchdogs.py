"""GPU watchdogs of the host monitor: parsers on real-looking fixture files, the kernel
log tail, the cooldown, and the ECC comparison (real nvidia-smi stand-in, no mocks)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from host_monitor.watchdogs import GpuReporter
from host_monitor.watchdogs.ecc import EccWatchdog, SyntheticEcc, parse_ecc_csv
from host_monitor.watchdogs.nvidia_smi import (
    GpuTopology,
    NvidiaSmiError,
    normalize_pci,
    parse_pci_csv,
    run_nvidia_smi,
    synthetic_pci,
)
from host_monitor.watchdogs.xid import (
    FileTail,
    XidLine,
    XidWatchdog,
    format_xid_line,
    kmsg_text,
    open_kernel_log,
    parse_xid_line,
)
from host_monitor.wire import GpuReport

FIXTURES = Path(__file__).parent / "fixtures" / "host_monitor"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _xids(lines: list[str]) -> list[XidLine]:
    return [x for x in map(parse_xid_line, lines) if x is not None]


# --- parsers ----------------------------------------------------------------------------


def test_xid_lines_of_a_dmesg_log() -> None:
    xids = _xids((FIXTURES / "kernel.log").read_text().splitlines())
    assert [(x.pci, x.code) for x in xids] == [
        ("0000:3b:00", 79),
        ("0000:18:00", 48),
        ("0000:18:00", 63),
        ("0000:86:00", 13),  # the older form, without "PCI:"
        ("0000:ab:00", 31),
        ("0000:db:00", 94),
        ("0000:5d:00", 74),
        ("0000:9a:00", 119),
        ("0000:2a:00", 45),  # an older driver: no pid/name
    ]
    by_code = {x.code: x.message for x in xids}
    assert by_code[79] == "GPU has fallen off the bus."
    assert by_code[48].startswith("An uncorrectable double bit error (DBE)")
    assert by_code[13] == "0000 00000000 0000c5c0 00000520 00000000 00000000"
    assert by_code[31].startswith("Ch 00000008, intr 10000000. MMU Fault")
    assert by_code[45] == "Ch 00000010, errorString CTX SWITCH TIMEOUT, Info 0x1c001"
    assert by_code[119].startswith("Timeout waiting for RPC from GSP!")


def test_xid_lines_of_kmsg_records_and_the_journal() -> None:
    records = (FIXTURES / "kmsg.txt").read_text().splitlines()
    texts = [kmsg_text(r + "\n") for r in records]
    assert texts[0].startswith("NVRM: Xid (PCI:0000:3b:00): 79")
    assert texts[2] == "usb 1-1: new high-speed USB device number 2 using xhci_hcd"
    assert [(x.pci, x.code) for x in _xids(texts)] == [("0000:3b:00", 79), ("0000:86:00", 13)]
    # Continuation lines of a record (" SUBSYSTEM=...") are not part of its text.
    assert kmsg_text("6,1,2,-;NVRM: hello\n SUBSYSTEM=pci\n") == "NVRM: hello"

    journal = _xids((FIXTURES / "journal.log").read_text().splitlines())
    assert [(x.pci, x.code) for x in journal] == [("0000:b7:00", 48), ("0000:b7:00", 64)]
    assert journal[1].message == "Row Remapper: Failed to mark a row for remapping."


def test_injected_xid_line_reads_back_as_written() -> None:
    line = format_xid_line("0000:3b:00", 79, pid=1234, name="python", uptime_s=12345.678901)
    assert line == (
        "[12345.678901] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, "
        "GPU has fallen off the bus."
    )
    assert parse_xid_line(line) == XidLine("0000:3b:00", 79, "GPU has fallen off the bus.")
    anonymous = parse_xid_line(format_xid_line("0000:18:00", 48))
    assert anonymous is not None and anonymous.message.startswith("An uncorrectable")


def test_nvidia_smi_ecc_csv_with_missing_values() -> None:
    counts = parse_ecc_csv((FIXTURES / "nvidia-smi-ecc.csv").read_text())
    assert counts == {0: 0, 1: 2, 2: None, 3: None, 4: 17, 5: 0, 6: None, 7: 0}
    noise = "No devices were found\n\n0, 3\nWARNING: infoROM is corrupted at gpu 0000:3B:00.0\n"
    assert parse_ecc_csv(noise) == {0: 3}


def test_pci_addresses() -> None:
    assert normalize_pci("00000000:3B:00.0") == "0000:3b:00"
    assert normalize_pci("0000:3b:00") == "0000:3b:00"
    assert normalize_pci("3b:00.0") == "0000:3b:00"
    assert normalize_pci("not a pci address") is None
    by_pci = parse_pci_csv((FIXTURES / "nvidia-smi-pci.csv").read_text())
    assert by_pci["0000:3a:00"] == 2 and len(by_pci) == 8
    topology = GpuTopology(by_pci)
    assert topology.gpu_for("0000:DB:00") == 7
    assert topology.pci_for(7) == "0000:db:00"
    # Without nvidia-smi, injected faults use synthetic addresses that map back.
    bare = GpuTopology()
    for gpu in (0, 3, 7, 8, 200):
        assert bare.gpu_for(bare.pci_for(gpu)) == gpu
    assert synthetic_pci(0) == "0000:18:00"
    assert bare.gpu_for("0000:86:00") is None


# --- kernel log tail --------------------------------------------------------------------


def test_file_tail_starts_at_the_end_and_follows_rotation(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old line 1\nold line 2\n")
    tail = FileTail(log)
    assert tail.read_lines() == []  # no replay of what was there before
    with log.open("a") as f:
        f.write("new 1\nnew 2 is still being wri")
    assert tail.read_lines() == ["new 1"]
    with log.open("a") as f:
        f.write("tten\n")
    assert tail.read_lines() == ["new 2 is still being written"]
    # Rotation: a new file under the same name is read from its start.
    log.rename(tmp_path / "kern.log.1")
    log.write_text("after rotation\n")
    assert tail.read_lines() == ["after rotation"]
    # Truncation (copytruncate).
    log.write_text("")
    assert tail.read_lines() == []
    log.write_text("after truncation\n")
    assert tail.read_lines() == ["after truncation"]


def test_file_tail_of_a_file_created_later(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    tail = FileTail(log)
    assert tail.read_lines() == []
    log.write_text("first\n")
    assert tail.read_lines() == ["first"]


def test_kernel_log_sources(tmp_path: Path) -> None:
    regular = tmp_path / "kern.log"
    regular.write_text("")
    source, line = open_kernel_log(str(regular), disabled=False)
    assert isinstance(source, FileTail) and line == f"xid watchdog: tailing {regular}"
    source, line = open_kernel_log("none", disabled=True)
    assert source is None and line.startswith("xid watchdog disabled")
    source, line = open_kernel_log(str(tmp_path), disabled=False)
    assert source is None and "not a regular file" in line
    source, line = open_kernel_log(None, disabled=False)
    if os.access("/dev/kmsg", os.R_OK):
        assert source is not None and line == "xid watchdog: reading /dev/kmsg"
        source.close()
    else:
        assert source is None
        assert line.startswith("xid watchdog disabled: /dev/kmsg not readable")


# --- reporting ----------------------------------------------------------------------------


def test_cooldown_per_kind_gpu_and_code() -> None:
    clock = Clock()
    sent: list[GpuReport] = []
    reporter = GpuReporter(60.0, sent.append, clock=clock)
    assert reporter.offer(GpuReport(kind="xid", gpu=0, code=79))
    assert not reporter.offer(GpuReport(kind="xid", gpu=0, code=79))
    assert reporter.offer(GpuReport(kind="xid", gpu=1, code=79))  # another GPU
    assert reporter.offer(GpuReport(kind="xid", gpu=0, code=48))  # another code
    clock.now += 60.0
    assert reporter.offer(GpuReport(kind="xid", gpu=0, code=79))
    assert [(r.gpu, r.code) for r in sent] == [(0, 79), (1, 79), (0, 48), (0, 79)]


async def test_xid_watchdog_reports_new_kernel_lines(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("[1.0] NVRM: Xid (PCI:0000:3a:00): 79, pid=1, name=x, old, not replayed\n")
    sent: list[GpuReport] = []
    topology = GpuTopology(parse_pci_csv((FIXTURES / "nvidia-smi-pci.csv").read_text()))
    watchdog = XidWatchdog(FileTail(log), topology, GpuReporter(60.0, sent.append), 0.01)
    await watchdog.check()
    assert sent == []
    with log.open("a") as f:
        f.write((FIXTURES / "kernel.log").read_text())
    await watchdog.check()
    assert [(r.gpu, r.code) for r in sent] == [
        (None, 79),  # 0000:3b:00 is not one of this node's GPUs
        (0, 48),
        (0, 63),
        (None, 13),
        (5, 31),
        (7, 94),
        (3, 74),
        (4, 119),
        (1, 45),
    ]
    assert sent[1].message is not None and sent[1].message.endswith("(PCI 0000:18:00)")
    assert all(r.kind == "xid" and r.time is not None for r in sent)


def _fake_nvidia_smi(tmp_path: Path, csv: Path) -> Path:
    """A stand-in for nvidia-smi: prints `csv` for the ECC query, fails otherwise."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if '--query-gpu=index,ecc.errors.uncorrected.volatile.total' not in sys.argv:\n"
        "    sys.exit('unexpected arguments: ' + ' '.join(sys.argv[1:]))\n"
        f"sys.stdout.write(open({str(csv)!r}).read())\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


async def test_ecc_watchdog_reports_increases_only(tmp_path: Path) -> None:
    csv = tmp_path / "ecc.csv"
    csv.write_text((FIXTURES / "nvidia-smi-ecc.csv").read_text())
    smi = _fake_nvidia_smi(tmp_path, csv)
    clock = Clock()
    sent: list[GpuReport] = []
    synthetic = SyntheticEcc()
    watchdog = EccWatchdog(str(smi), synthetic, GpuReporter(30.0, sent.append, clock), 0.01)

    await watchdog.check()  # errors already there at start are news too
    assert [(r.gpu, r.count) for r in sent] == [(1, 2), (4, 17)]
    await watchdog.check()
    assert len(sent) == 2  # unchanged counts are not sent again

    synthetic.add(2, 3)  # an injected fault on a GPU whose nvidia-smi count is [N/A]
    await watchdog.check()
    assert (sent[-1].gpu, sent[-1].count) == (2, 3)

    csv.write_text(csv.read_text().replace("4, 17", "4, 19"))
    await watchdog.check()
    assert len(sent) == 3  # within gpu 4's cooldown: held back, not lost
    clock.now += 30.0
    await watchdog.check()
    assert (sent[-1].gpu, sent[-1].count) == (4, 19)
    assert sent[-1].message == "uncorrected volatile ECC errors: 17 -> 19"


async def test_nvidia_smi_failures_are_errors_not_crashes(tmp_path: Path) -> None:
    with pytest.raises(NvidiaSmiError, match="cannot run"):
        await run_nvidia_smi(str(tmp_path / "absent"), "-L")
    smi = _fake_nvidia_smi(tmp_path, tmp_path / "unused.csv")
    with pytest.raises(NvidiaSmiError, match="exited with 1: unexpected arguments"):
        await run_nvidia_smi(str(smi), "-L")
    sent: list[GpuReport] = []
    synthetic = SyntheticEcc()
    watchdog = EccWatchdog(str(tmp_path / "absent"), synthetic, GpuReporter(0, sent.append), 1)
    synthetic.add(0, 1)
    await watchdog.check()  # nvidia-smi failing does not hide the injected errors
    assert [(r.gpu, r.count) for r in sent] == [(0, 1)]
