"""XID watchdog: NVIDIA driver errors, read from the kernel log.

The driver logs each error as one kernel line, e.g.

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    NVRM: Xid (0000:3b:00): 13, 0000 00000000 0000c5c0 00000520 00000000 00000000   (older)

wherever the kernel log ends up: /dev/kmsg records (`6,1234,5678901,-;NVRM: ...`),
`dmesg` output (`[12345.678901] NVRM: ...`), the journal or a syslog file
(`... kernel: NVRM: ...`). We search each line for the NVRM part, so all these work.

Sources are read from their end at start: errors logged before we started were already
someone's business (a reboot or a previous agent), and replaying them would make the
supervisor act twice.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from host_monitor.config import DEV_KMSG
from host_monitor.watchdogs import GpuReporter, Watchdog
from host_monitor.watchdogs.nvidia_smi import GpuTopology, normalize_pci
from host_monitor.wire import GpuReport
from resiliency_protocol.clock import utcnow
from resiliency_protocol.heartbeat import GPU_XID, MAX_GPU_CODE, MAX_GPU_MESSAGE_CHARS

log = logging.getLogger(__name__)

_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\)"
    r":\s*(?P<code>\d+)(?:,\s*(?P<rest>.*))?"
)
# What precedes the message on current drivers; either may be absent on older ones.
_PID_NAME_RE = re.compile(r"^(?:pid=[^,]*,\s*)?(?:name=[^,]*,\s*)?")
MAX_READ = 1 << 20  # bytes of a kernel log file read per check; the rest waits
MAX_PARTIAL = 1 << 16  # a "line" longer than this without a newline is dropped

# Messages of XIDs that matter for training, as the driver prints them (for injection).
XID_MESSAGES = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted",
    43: "Ch 00000010, engmask 00000101",
    45: "Ch 00000010, errorString CTX SWITCH TIMEOUT, Info 0x1c001",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
    "at partition 1, subpartition 0.",
    63: "Row Remapper: New row marked for remapping, reboot GPU to activate.",
    64: "Row Remapper: Failed to mark a row for remapping.",
    74: "NVLink: fatal error detected on link 3(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate detected.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout waiting for RPC from GSP! Expected function 76 (GSP_RM_CONTROL).",
}


@dataclass(frozen=True, slots=True)
class XidLine:
    pci: str  # normalized: 0000:3b:00
    code: int
    message: str


def parse_xid_line(line: str) -> XidLine | None:
    """The XID in one kernel log line, or None when the line is not an XID."""
    match = _XID_RE.search(line)
    if match is None:
        return None
    pci = normalize_pci(match["pci"])
    if pci is None:
        return None
    rest = (match["rest"] or "").strip()
    message = _PID_NAME_RE.sub("", rest, count=1).strip()
    return XidLine(pci=pci, code=int(match["code"]), message=message)


def kmsg_text(record: str) -> str:
    """The text of a /dev/kmsg record: `prio,seq,usec,flags[,...];text\\n[ KEY=value\\n]`."""
    head, sep, text = record.partition(";")
    if not sep or "," not in head:
        return record.rstrip("\n")
    return text.split("\n", 1)[0]


def format_xid_line(
    pci: str,
    code: int,
    *,
    pid: int | None = None,
    name: str | None = None,
    message: str | None = None,
    uptime_s: float | None = None,
) -> str:
    """A kernel log line as the driver writes it (dmesg form), for injected faults."""
    if uptime_s is None:
        uptime_s = _uptime_s()
    who = f"pid={pid}, name={name}" if pid is not None else "pid='<unknown>', name=<unknown>"
    text = message or XID_MESSAGES.get(code, "Injected fault.")
    return f"[{uptime_s:12.6f}] NVRM: Xid (PCI:{pci}): {code}, {who}, {text}"


def _uptime_s() -> float:
    # The kernel stamps its log with the monotonic clock since boot, as this one is.
    return time.monotonic()


# --- sources ------------------------------------------------------------------------------


class KernelLogSource(Protocol):
    def read_lines(self) -> list[str]: ...

    def close(self) -> None: ...


class FileTail:
    """New lines of a regular file; follows truncation and replacement (log rotation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._identity: tuple[int, int] | None = None
        self._offset = 0
        self._partial = b""
        try:
            st = path.stat()
        except OSError:
            return  # created later: all of it will be new
        self._identity = (st.st_dev, st.st_ino)
        self._offset = st.st_size  # start at the end: no replay of old history

    def read_lines(self) -> list[str]:
        try:
            st = self.path.stat()
        except OSError:
            self._identity = None
            return []
        identity = (st.st_dev, st.st_ino)
        if identity != self._identity or st.st_size < self._offset:
            # A new file (created or rotated in) or a truncated one: read it from the top.
            self._identity = identity
            self._offset = 0
            self._partial = b""
        if st.st_size == self._offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read(MAX_READ)
        self._offset += len(data)
        *lines, partial = (self._partial + data).split(b"\n")
        self._partial = partial if len(partial) <= MAX_PARTIAL else b""
        return [line.decode("utf-8", errors="replace") for line in lines]

    def close(self) -> None:
        pass


class KmsgReader:
    """New records of /dev/kmsg (one record per read; non-blocking)."""

    def __init__(self, path: str = DEV_KMSG) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        # SEEK_END on /dev/kmsg skips to after the newest record: no replay.
        os.lseek(self._fd, 0, os.SEEK_END)

    def read_lines(self) -> list[str]:
        lines: list[str] = []
        while len(lines) < 100_000:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # records were overwritten before we read them; go on
            if not record:
                break
            lines.append(kmsg_text(record.decode("utf-8", errors="replace")))
        return lines

    def close(self) -> None:
        os.close(self._fd)


def open_kernel_log(kernel_log: str | None, disabled: bool) -> tuple[KernelLogSource | None, str]:
    """The kernel log source for `kernel_log` (see config), and one line saying what it is."""
    if disabled:
        return None, f"xid watchdog disabled: kernel_log is {kernel_log!r}"
    path = kernel_log or DEV_KMSG
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if kernel_log is None:
            return None, f"xid watchdog disabled: {DEV_KMSG} not readable (absent)"
        return FileTail(Path(path)), f"xid watchdog: tailing {path} (not there yet)"
    except OSError as exc:
        return None, f"xid watchdog disabled: {path} not readable ({exc.strerror})"
    if stat.S_ISCHR(mode):
        try:
            return KmsgReader(path), f"xid watchdog: reading {path}"
        except OSError as exc:
            return None, f"xid watchdog disabled: {path} not readable ({exc.strerror})"
    if not stat.S_ISREG(mode):
        return None, f"xid watchdog disabled: {path} is not a regular file or /dev/kmsg"
    return FileTail(Path(path)), f"xid watchdog: tailing {path}"


# --- the watchdog -------------------------------------------------------------------------


class XidWatchdog(Watchdog):
    name = "xid watchdog"

    def __init__(
        self,
        source: KernelLogSource | None,
        topology: GpuTopology,
        reporter: GpuReporter,
        period_s: float,
    ) -> None:
        super().__init__(period_s)
        self.source = source
        self.topology = topology
        self.reporter = reporter

    @property
    def log_file(self) -> Path | None:
        """The regular file we tail, if that is our source (injected XIDs go there)."""
        return self.source.path if isinstance(self.source, FileTail) else None

    async def check(self) -> None:
        if self.source is None:
            return
        for line in self.source.read_lines():
            xid = parse_xid_line(line)
            if xid is not None:
                self.report(xid)

    def report(self, xid: XidLine) -> bool:
        if xid.code > MAX_GPU_CODE:
            log.warning("ignoring XID with out-of-range code %d: %s", xid.code, xid.message)
            return False
        message = f"{xid.message} (PCI {xid.pci})" if xid.message else f"PCI {xid.pci}"
        report = GpuReport(
            kind=GPU_XID,
            gpu=self.topology.gpu_for(xid.pci),
            code=xid.code,
            message=message[:MAX_GPU_MESSAGE_CHARS],
            time=utcnow(),
        )
        return self.reporter.offer(report)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
