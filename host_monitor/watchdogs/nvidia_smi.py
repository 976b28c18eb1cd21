"""nvidia-smi: one bounded call, and the GPU topology it tells.

- `run_nvidia_smi`: nvidia-smi can hang on a sick GPU, so every call has a timeout.
- `GpuTopology`: PCI bus id <-> GPU index. The kernel log names GPUs by PCI address, the
  supervisor by index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from host_monitor.errors import HostMonitorError

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 10.0

# Where GPUs sit on a DGX H100; used as the PCI address of GPU i when nvidia-smi cannot
# tell (no GPU here: injected XIDs still need a real-looking, invertible address).
_SYNTHETIC_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<device>[0-9a-fA-F]{2})"
    r"(?:\.[0-7])?$"
)


class NvidiaSmiError(HostMonitorError):
    """nvidia-smi failed, timed out or printed something we cannot read."""


def normalize_pci(address: str) -> str | None:
    """`00000000:3B:00.0` (nvidia-smi) and `0000:3b:00` (kernel log) -> `0000:3b:00`."""
    match = _PCI_RE.match(address.strip())
    if match is None:
        return None
    domain = int(match["domain"] or "0", 16) & 0xFFFF
    return f"{domain:04x}:{match['bus'].lower()}:{match['device'].lower()}"


def synthetic_pci(gpu: int) -> str:
    if gpu < len(_SYNTHETIC_BUSES):
        return f"0000:{_SYNTHETIC_BUSES[gpu]}:00"
    return f"0001:{gpu:02x}:00"


class GpuTopology:
    def __init__(self, by_pci: dict[str, int] | None = None) -> None:
        self._by_pci = dict(by_pci or {})
        self._by_gpu = {gpu: pci for pci, gpu in self._by_pci.items()}
        self._synthetic = {synthetic_pci(i): i for i in range(256)}

    @classmethod
    async def discover(cls, nvidia_smi: str | None) -> GpuTopology:
        """Ask nvidia-smi for the PCI address of each GPU; empty without it."""
        if nvidia_smi is None:
            return cls()
        try:
            out = await run_nvidia_smi(
                nvidia_smi, "--query-gpu=index,pci.bus_id", "--format=csv,noheader,nounits"
            )
        except NvidiaSmiError as exc:
            log.warning("cannot map GPU PCI addresses to indices: %s", exc)
            return cls()
        return cls(parse_pci_csv(out))

    def gpu_for(self, pci: str) -> int | None:
        address = normalize_pci(pci)
        if address is None:
            return None
        if address in self._by_pci:
            return self._by_pci[address]
        return self._synthetic.get(address)  # an injected XID for a GPU nvidia-smi lacks

    def pci_for(self, gpu: int) -> str:
        return self._by_gpu.get(gpu) or synthetic_pci(gpu)


def parse_pci_csv(text: str) -> dict[str, int]:
    """`index, pci.bus_id` rows -> {normalized pci: index}; unreadable rows are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        pci = normalize_pci(parts[1])
        if pci is not None:
            out[pci] = int(parts[0])
    return out


async def run_nvidia_smi(command: str, *args: str, timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(
            command,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise NvidiaSmiError(f"cannot run {command}: {exc}") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise NvidiaSmiError(f"{command} did not answer within {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        detail = (err or out).decode(errors="replace").strip().splitlines()
        raise NvidiaSmiError(
            f"{command} exited with {proc.returncode}: {detail[0] if detail else ''}"
        )
    return out.decode(errors="replace")
