"""ECC watchdog: uncorrected volatile ECC errors per GPU, from nvidia-smi.

    nvidia-smi --query-gpu=index,ecc.errors.uncorrected.volatile.total \\
               --format=csv,noheader,nounits

prints `0, 0` per GPU, or `[N/A]` / `[Not Supported]` where ECC is off or unknown. The
count is cumulative since the driver loaded, so we report a GPU when its count goes up,
and send the total (the supervisor computes the new errors from its last count).

Injected faults add to a per-node synthetic counter (`SyntheticEcc`) that is read in
addition to nvidia-smi, so a fault goes through the same comparison and cooldown as a
real error, on machines with or without GPUs. A GPU already showing errors when we start
is reported too: volatile counts reset with the driver, so a non-zero count means this
GPU failed since its last reset.

An increase that falls within the cooldown is not lost: the count stays above the last
one reported, so it goes out on the first check after the cooldown.
"""

from __future__ import annotations

import logging

from host_monitor.watchdogs import GpuReporter, Watchdog
from host_monitor.watchdogs.nvidia_smi import NvidiaSmiError, run_nvidia_smi
from host_monitor.wire import GpuReport
from resiliency_protocol.clock import utcnow
from resiliency_protocol.heartbeat import GPU_ECC

log = logging.getLogger(__name__)

ECC_QUERY = (
    "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
    "--format=csv,noheader,nounits",
)


def parse_ecc_csv(text: str) -> dict[int, int | None]:
    """Rows `index, count` -> {gpu: count}; None where nvidia-smi has no number."""
    counts: dict[int, int | None] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue  # blank lines, warnings nvidia-smi mixes into its output
        gpu, value = int(parts[0]), parts[1]
        counts[gpu] = int(value) if value.isdigit() else None  # [N/A], [Not Supported]
    return counts


class SyntheticEcc:
    """Uncorrected ECC errors added by fault injection, per GPU index."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, gpu: int, count: int) -> int:
        self.counts[gpu] = self.counts.get(gpu, 0) + count
        return self.counts[gpu]


class EccWatchdog(Watchdog):
    name = "ecc watchdog"

    def __init__(
        self,
        nvidia_smi: str | None,
        synthetic: SyntheticEcc,
        reporter: GpuReporter,
        period_s: float,
    ) -> None:
        super().__init__(period_s)
        self.nvidia_smi = nvidia_smi  # None: only injected errors are watched
        self.synthetic = synthetic
        self.reporter = reporter
        self._reported: dict[int, int] = {}
        self._smi_error: str | None = None

    async def read_counts(self) -> dict[int, int]:
        """Current totals per GPU: nvidia-smi's plus the synthetic ones."""
        measured: dict[int, int | None] = {}
        if self.nvidia_smi is not None:
            try:
                measured = parse_ecc_csv(await run_nvidia_smi(self.nvidia_smi, *ECC_QUERY))
            except NvidiaSmiError as exc:
                if str(exc) != self._smi_error:  # once per distinct failure, not per period
                    log.warning("ecc watchdog: %s", exc)
                    self._smi_error = str(exc)
            else:
                self._smi_error = None
        totals: dict[int, int] = {}
        for gpu in sorted(set(measured) | set(self.synthetic.counts)):
            count = measured.get(gpu)
            extra = self.synthetic.counts.get(gpu, 0)
            if count is None and not extra:
                continue
            totals[gpu] = (count or 0) + extra
        return totals

    async def check(self) -> None:
        for gpu, total in (await self.read_counts()).items():
            before = self._reported.get(gpu, 0)
            if total < before:
                # The driver was reloaded (volatile counts reset): count from here.
                self._reported[gpu] = total
            if total <= before:
                continue
            report = GpuReport(
                kind=GPU_ECC,
                gpu=gpu,
                count=total,
                message=f"uncorrected volatile ECC errors: {before} -> {total}",
                time=utcnow(),
            )
            if self.reporter.offer(report):
                self._reported[gpu] = total
