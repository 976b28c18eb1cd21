"""torchrun's command line as `supervisor run` takes it: each of torchrun's flags (in both
its spellings, `--nproc-per-node` and `--nproc_per_node`) accepted, mapped onto the local
cluster, or refused in one line that says what to use instead. docs/local-mode.md keeps
the table.

Every node of the job runs on this machine and the supervisor forms each world, so the
rendezvous flags have nothing to do here; they are accepted (a line says so) unless they
point elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resiliency_protocol.launch import NAME_PATTERN
from supervisor.errors import SupervisorError

#: Addresses that are this machine, as --master-addr and --rdzv-endpoint may name it.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", ""})


class FlagRefused(SupervisorError, ValueError):
    """One of torchrun's flags cannot work here: the message names it and what to use."""


@dataclass(frozen=True)
class TorchrunFlags:
    """What torchrun's flags come to on the local cluster."""

    nnodes: int
    #: The fewest nodes the job may shrink to (`--nnodes MIN:MAX`); nnodes: no shrinking.
    min_nnodes: int
    nproc_per_node: int
    #: The job's name from `--rdzv-id`, when given.
    rdzv_id: str | None = None
    #: How often the host monitors report (`--monitor-interval`), when given.
    monitor_interval_s: float | None = None
    #: The command runs as given (`--no-python`).
    no_python: bool = False
    #: The ranks whose output shows on the terminal; None: every rank.
    shown_ranks: frozenset[int] | None = None
    #: One line each: a flag accepted with nothing to do here.
    notes: list[str] = field(default_factory=list)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's flags, with its defaults, on `parser` (`supervisor run`'s)."""

    def flag(name: str, **kwargs: Any) -> None:
        underscored = "--" + name[2:].replace("-", "_")
        names = (name, underscored) if underscored != name else (name,)
        parser.add_argument(*names, **kwargs)

    flag(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="Nodes of the job (default 1). MIN:MAX: MAX nodes, and a node lost with no "
        "spare left shrinks the job, down to MIN (workload scaling).",
    )
    flag(
        "--nproc-per-node",
        default="1",
        metavar="N|gpu|cpu|auto",
        help="Workers per node (default 1): a number (at most the GPUs NVML counts, where it "
        "counts any), gpu (one per GPU), cpu (one per CPU), auto (gpu where there is one, "
        "else cpu).",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="Accepted: every run is one machine's, and the supervisor forms each world.",
    )
    flag("--node-rank", type=int, default=0, help="0 only: every node runs here.")
    flag("--master-addr", help="This machine only (the ranks meet at 127.0.0.1).")
    flag("--master-port", type=int, help="Accepted: each attempt gets a free port.")
    flag("--rdzv-backend", help="Accepted, not used: the supervisor forms each world.")
    flag("--rdzv-endpoint", help="This machine only; not used.")
    flag("--rdzv-id", help="The job's name (as --job).")
    flag("--rdzv-conf", help="Accepted, not used.")
    flag(
        "--monitor-interval",
        type=float,
        help="Seconds between the host monitors' reports (setting heartbeat_polling_period_s; "
        "less than half of --heartbeat-timeout-s).",
    )
    flag("--start-method", help="Accepted: each worker is a process of its own.")
    parser.add_argument("--role", help="Accepted, not used.")
    flag(
        "--no-python",
        action="store_true",
        help="Run COMMAND as it is, not with this Python (as -- COMMAND).",
    )
    flag("--run-path", action="store_true", help="Accepted: the script runs as a file.")
    flag("--log-dir", help="Refused: each rank's log is in the run folder (--run-dir).")
    parser.add_argument(
        "--redirects",
        default="0",
        help="3 with --tee 0: no rank's output on the terminal (each keeps its log file).",
    )
    parser.add_argument(
        "--tee", default="0", help="Accepted: each rank's output is in its log file."
    )
    flag(
        "--local-ranks-filter",
        default="",
        metavar="RANKS",
        help="Only these ranks' output on the terminal (0,1,...); every rank keeps its log.",
    )


def gpus_by_nvml() -> int | None:
    """The GPUs NVML counts; None where there is no NVML (no driver, or no pynvml)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError: no library or no driver
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _local(host: str) -> bool:
    return host.strip("[]") in LOCAL_HOSTS or host in (socket.gethostname(), socket.getfqdn())


def _nnodes(value: str) -> tuple[int, int]:
    low, sep, high = value.partition(":")
    try:
        least, most = (int(low), int(high)) if sep else (int(value), int(value))
    except ValueError:
        raise FlagRefused(f"--nnodes {value!r}: expected N or MIN:MAX") from None
    if least < 1 or most < least:
        raise FlagRefused(f"--nnodes {value!r}: expected 1 <= MIN <= MAX")
    return least, most


def _nproc(value: str, gpus: Callable[[], int | None]) -> int:
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        found = gpus()
        if found:
            return found
        if value == "gpu":
            raise FlagRefused("--nproc-per-node gpu: no GPU found (NVML); give a number, or cpu")
        return os.cpu_count() or 1
    if value == "xpu":
        raise FlagRefused("--nproc-per-node xpu: XPUs are not supported; give a number")
    try:
        count = int(value)
    except ValueError:
        raise FlagRefused(
            f"--nproc-per-node {value!r}: expected a number, gpu, cpu or auto"
        ) from None
    if count < 1:
        raise FlagRefused(f"--nproc-per-node must be at least 1, got {count}")
    found = gpus()
    if found and count > found:
        raise FlagRefused(
            f"--nproc-per-node {count}: this machine has {found} GPU(s) (NVML); "
            "at most one worker per GPU"
        )
    return count


def _ranks(value: str) -> frozenset[int] | None:
    if not value:
        return None
    try:
        ranks = frozenset(int(r) for r in value.split(","))
    except ValueError:
        raise FlagRefused(f"--local-ranks-filter {value!r}: expected ranks, as 0,1") from None
    if min(ranks) < 0:
        raise FlagRefused(f"--local-ranks-filter {value!r}: a rank is 0 or more")
    return ranks


def _streams(flag: str, value: str) -> int:
    try:
        streams = int(value)
    except ValueError:
        raise FlagRefused(
            f"{flag} {value!r}: per-rank settings are not supported here (each rank's "
            "output is one file); use --local-ranks-filter for the terminal"
        ) from None
    if streams not in range(4):
        raise FlagRefused(f"{flag} {value!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both)")
    return streams


def flags_of(
    args: argparse.Namespace, gpus: Callable[[], int | None] = gpus_by_nvml
) -> TorchrunFlags:
    """What `args`' torchrun flags come to here; FlagRefused for one that cannot work."""
    least, most = _nnodes(args.nnodes)
    nproc = _nproc(args.nproc_per_node, gpus)
    if args.node_rank != 0:
        raise FlagRefused(
            f"--node-rank {args.node_rank}: every node of the job runs on this machine, "
            "started by this one command; leave --node-rank out"
        )
    if args.master_addr is not None and not _local(args.master_addr):
        raise FlagRefused(
            f"--master-addr {args.master_addr}: every rank runs on this machine and meets "
            "at 127.0.0.1; leave --master-addr out"
        )
    if args.log_dir is not None:
        raise FlagRefused(
            f"--log-dir {args.log_dir}: each rank's output is in the run folder "
            "(RUN_DIR/nodes/NODE/NODE.JOB.rankN.log); choose it with --run-dir"
        )
    notes = []
    if args.master_port is not None:
        notes.append(
            f"--master-port {args.master_port}: each attempt gets a free MASTER_PORT, so a "
            "restart never waits for the last one's"
        )
    if not args.standalone:  # as torchrun: --standalone makes the rendezvous flags moot
        endpoint = args.rdzv_endpoint
        if endpoint is not None and not _local(endpoint.rpartition(":")[0] or endpoint):
            raise FlagRefused(
                f"--rdzv-endpoint {endpoint}: every rank runs on this machine; leave "
                "--rdzv-endpoint out (the supervisor forms each world)"
            )
        for name, value in (
            ("--rdzv-backend", args.rdzv_backend),
            ("--rdzv-endpoint", endpoint),
            ("--rdzv-conf", args.rdzv_conf),
        ):
            if value is not None:
                notes.append(f"{name} {value}: not used, the supervisor forms each world")
    redirects, tee = _streams("--redirects", args.redirects), _streams("--tee", args.tee)
    shown = _ranks(args.local_ranks_filter)
    if redirects == 3 and tee == 0:
        shown = frozenset()  # every stream to the log files only
    rdzv_id = None if args.standalone else args.rdzv_id
    if rdzv_id is not None and not re.fullmatch(NAME_PATTERN, rdzv_id):
        raise FlagRefused(
            f"--rdzv-id {rdzv_id!r}: the job's name, letters, digits, '.', '_' and '-'"
        )
    monitor = args.monitor_interval
    if monitor is not None and not 0 < monitor < args.heartbeat_timeout_s / 2:
        raise FlagRefused(
            f"--monitor-interval {monitor:g}: must be more than 0 and less than half of "
            f"--heartbeat-timeout-s ({args.heartbeat_timeout_s:g})"
        )
    return TorchrunFlags(
        nnodes=most,
        min_nnodes=least,
        nproc_per_node=nproc,
        rdzv_id=rdzv_id,
        monitor_interval_s=monitor,
        no_python=args.no_python,
        shown_ranks=shown,
        notes=notes,
    )
