"""Faults acted out on this node's real processes and real GPU error paths.

Each fault goes through the path a real failure takes, so what it tests is the real
detection:

- worker_crash: SIGKILL the worker's process group; the process monitor sees the exit.
- worker_hang: SIGSTOP it; it stops reporting progress and turns `lost`.
- straggler: the worker's process group is stopped and continued (SIGSTOP, SIGCONT) ten
  times a second, so that it runs `1 + slowdown` times slower with no help from it: any
  workload, the torch one included. Until `duration_s` ends, the worker exits, or another
  straggler fault on it replaces this one.
- xid: a kernel line in the driver's format is appended to the kernel log file, which
  the XID watchdog tails (when the source is /dev/kmsg or nothing, the report goes to
  the watchdog's reporter directly: we do not write into the real kernel log).
- ecc: `count` is added to the synthetic ECC counter the ECC watchdog adds to
  nvidia-smi's counts.
- node_down: SIGKILL every worker, stop heartbeating, and (after the HTTP answer) the
  agent exits with 137 as if the node had died.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar

from host_monitor.node import Node
from host_monitor.request_checks import InvalidRequest
from host_monitor.watchdogs.ecc import EccWatchdog, SyntheticEcc
from host_monitor.watchdogs.xid import XidWatchdog, format_xid_line, parse_xid_line
from host_monitor.workers import Worker, WorkerConflict
from resiliency_protocol.faults import FaultKind
from resiliency_protocol.node_commands import FaultOutcome, ProcessFault

log = logging.getLogger(__name__)

NODE_DOWN_EXIT_CODE = 137  # what a shell reports for a SIGKILLed process
#: A straggler's stop-and-continue cycle, and how much slower it runs by default.
DUTY_PERIOD_S = 0.1
DEFAULT_SLOWDOWN = 0.5


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "python"
    except OSError:
        return "python"


async def _duty_cycle(worker: Worker, slowdown: float, duration_s: float | None) -> None:
    """Run `worker` 1/(1 + slowdown) of the time, stopped the rest, until the end."""
    running_s = DUTY_PERIOD_S / (1 + slowdown)
    stopped_s = DUTY_PERIOD_S - running_s
    loop = asyncio.get_running_loop()
    ends = None if duration_s is None else loop.time() + duration_s
    try:
        while worker.alive and (ends is None or loop.time() < ends):
            if not worker.signal(signal.SIGSTOP):
                return
            await asyncio.sleep(stopped_s)
            worker.signal(signal.SIGCONT)
            await asyncio.sleep(running_s)
    finally:
        worker.signal(signal.SIGCONT)  # never left stopped: that would be a hang instead
        log.info("straggler fault on rank %d ended", worker.rank)


class FaultActor:
    def __init__(
        self,
        node: Node,
        xid: XidWatchdog,
        ecc: EccWatchdog,
        synthetic_ecc: SyntheticEcc,
        silence: Callable[[], None],
    ) -> None:
        self.node = node
        self.xid = xid
        self.ecc = ecc
        self.synthetic_ecc = synthetic_ecc
        self._silence = silence
        self._stragglers: dict[int, asyncio.Task[None]] = {}

    def apply(self, fault: ProcessFault) -> FaultOutcome:
        log.warning("injected fault: %s", fault.model_dump(mode="json", exclude_none=True))
        return self.acts[fault.kind](self, fault)

    def _crash(self, fault: ProcessFault) -> FaultOutcome:
        return self._signal(fault, signal.SIGKILL)

    def _hang(self, fault: ProcessFault) -> FaultOutcome:
        return self._signal(fault, signal.SIGSTOP)

    def _signal(self, fault: ProcessFault, sig: signal.Signals) -> FaultOutcome:
        worker = self.node.registry.target(fault.rank)
        if not worker.alive:
            raise WorkerConflict(f"rank {worker.rank} is not running ({worker.state.value})")
        worker.signal(sig)
        return FaultOutcome(
            kind=fault.kind,
            rank=worker.rank,
            pid=worker.pid,
            detail=f"{sig.name} sent to rank {worker.rank}'s process group",
        )

    def _straggler(self, fault: ProcessFault) -> FaultOutcome:
        worker = self.node.registry.target(fault.rank)
        if not worker.alive:
            raise WorkerConflict(f"rank {worker.rank} is not running ({worker.state.value})")
        slowdown = fault.slowdown if fault.slowdown is not None else DEFAULT_SLOWDOWN
        previous = self._stragglers.pop(worker.rank, None)
        if previous is not None:
            previous.cancel()
        self._stragglers[worker.rank] = asyncio.get_running_loop().create_task(
            _duty_cycle(worker, slowdown, fault.duration_s), name=f"straggler-{worker.rank}"
        )
        return FaultOutcome(
            kind=fault.kind,
            rank=worker.rank,
            pid=worker.pid,
            detail=f"rank {worker.rank} stopped {slowdown / (1 + slowdown):.0%} of every "
            f"{DUTY_PERIOD_S:g}s (SIGSTOP, SIGCONT): {1 + slowdown:g} times slower"
            + (f" for {fault.duration_s:g}s" if fault.duration_s else ""),
        )

    def close(self) -> None:
        """End the stragglers (each continues its worker as it ends)."""
        for task in self._stragglers.values():
            task.cancel()
        self._stragglers.clear()

    def _xid(self, fault: ProcessFault) -> FaultOutcome:
        if fault.code is None:
            raise InvalidRequest("code", "required for an xid fault")
        pci = self.xid.topology.pci_for(fault.gpu)
        # The driver names the process that was using the GPU; take the worker's, by its
        # pid in our namespace (the kernel's), as the driver would.
        live = self.node.registry.live()
        worker = self.node.registry.target(fault.rank) if fault.rank is not None or live else None
        pid = worker.host_pid if worker is not None else None
        path = self.xid.log_file
        if path is not None:
            line = format_xid_line(
                pci, fault.code, pid=pid, name=_comm(pid) if pid is not None else None
            )
            with path.open("a") as f:
                f.write(line + "\n")
            self.xid.poke()
            detail = f"appended to {path}: {line}"
        else:
            # Through the same parser as a line read from the kernel log.
            parsed = parse_xid_line(format_xid_line(pci, fault.code, pid=pid))
            assert parsed is not None
            self.xid.report(parsed)
            detail = "no kernel log file to write to: reported to the xid watchdog directly"
        return FaultOutcome(kind=fault.kind, gpu=fault.gpu, pid=pid, detail=detail)

    def _ecc(self, fault: ProcessFault) -> FaultOutcome:
        if fault.count is None:
            raise InvalidRequest("count", "required for an ecc fault")
        total = self.synthetic_ecc.add(fault.gpu, fault.count)
        self.ecc.poke()
        return FaultOutcome(
            kind=fault.kind,
            gpu=fault.gpu,
            detail=f"synthetic uncorrected ECC count of gpu {fault.gpu} is now {total}",
        )

    def _node_down(self, fault: ProcessFault) -> FaultOutcome:
        # Silence first: a dead node does not report its workers dying.
        self._silence()
        ranks = self.node.registry.kill_all()
        return FaultOutcome(
            kind=fault.kind,
            detail=f"SIGKILL sent to ranks {ranks}; the agent exits with {NODE_DOWN_EXIT_CODE} now",
            exiting=True,
        )

    #: Each kind a host monitor acts out (`on_processes` in the protocol's table).
    acts: ClassVar[Mapping[FaultKind, Callable[[FaultActor, ProcessFault], FaultOutcome]]] = {
        FaultKind.WORKER_CRASH: _crash,
        FaultKind.WORKER_HANG: _hang,
        FaultKind.STRAGGLER: _straggler,
        FaultKind.XID: _xid,
        FaultKind.ECC: _ecc,
        FaultKind.NODE_DOWN: _node_down,
    }
