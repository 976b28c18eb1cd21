"""`python -m training.pod_launch --nproc-per-node N -- COMMAND...`: the ranks of one pod
of a JobSet (one node of the job), started as torchrun starts a node's workers, for a pod
that runs several ranks (a pod per node, a rank per GPU).

Each rank runs COMMAND with torchrun's environment: RANK (the node's GROUP_RANK times N,
plus LOCAL_RANK), LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, WORLD_SIZE (NNODES times N),
and the pod's own MASTER_ADDR / MASTER_PORT, which a job that heals in-process replaces
with each world the supervisor hands it (WORLD_WAIT_S). There is no rendezvous of its own
and no restart: the pod is the unit Kubernetes replaces, so when a rank fails, the others
are stopped and the pod ends with that rank's exit code (the JobSet's podFailurePolicy
then decides: exit code 2, bad settings, fails the Job; any other failure gets the pod
replaced alone). SIGTERM (the pod being deleted or evicted) goes to every rank.

The node's rank and the job's node count come from `--node-rank` / `--nnodes`, else from
GROUP_RANK / NNODES in the environment (the JobSet example computes them from its labels).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

from resiliency_protocol.launch import CommandNotFound, ranks_of, resolve_command, thread_default
from resiliency_protocol.worker_env import HOST_MONITOR_URL
from training.auto_progress import startup_env

PROG = "python -m training.pod_launch"
#: How long the other ranks get to end after SIGTERM, once one failed, before SIGKILL.
STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def rank_env(
    base: Mapping[str, str], *, node_rank: int, nnodes: int, nproc_per_node: int, local: int
) -> dict[str, str]:
    """The environment of the rank of `local` on the node of `node_rank` (torchrun's)."""
    rank = ranks_of(node_rank, nproc_per_node)[local]
    return {
        **thread_default(dict(base), nproc_per_node),
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "GROUP_RANK": str(node_rank),
        "WORLD_SIZE": str(nnodes * nproc_per_node),
        "TORCHELASTIC_RESTART_COUNT": base.get("TORCHELASTIC_RESTART_COUNT", "0"),
    }


def exit_code(returncode: int) -> int:
    """A shell's exit code for a child's: 128 + the signal that ended it."""
    return 128 - returncode if returncode < 0 else returncode


class PodRanks:
    """The pod's rank processes: started together, ended together."""

    def __init__(self, command: Sequence[str], envs: Sequence[dict[str, str]]) -> None:
        self._command = list(command)
        self._envs = list(envs)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stopping = False

    def start(self) -> None:
        for env in self._envs:
            self.procs.append(subprocess.Popen(self._command, env=env, preexec_fn=_die_with_parent))

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        """The pod is being stopped: every rank is told, and ends on its own."""
        self._stopping = True
        self.signal_all(signum)

    def wait(self) -> int:
        """The pod's exit code: the first failed rank's, else 0 once every rank ended."""
        while True:
            running = [p for p in self.procs if p.poll() is None]
            failed = [p for p in self.procs if p.returncode not in (None, 0)]
            if failed:
                first = failed[0]
                code = exit_code(int(first.returncode))
                if running:
                    rank = self._envs[self.procs.index(first)]["RANK"]
                    self._stop(running, why=f"rank {rank} (pid {first.pid}) exited {code}")
                return code
            if not running:
                return 0
            time.sleep(0.1)

    def _stop(self, running: list[subprocess.Popen[bytes]], why: str) -> None:
        if not self._stopping:
            print(f"{PROG}: {why}; stopping the pod's other ranks", file=sys.stderr, flush=True)
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _die_with_parent() -> None:
    """In the rank's process before it runs COMMAND: killed with the launcher. In a
    container the kernel ends every process of the pod with its first; elsewhere (a
    launcher SIGKILLed on a host) a rank would otherwise train on, unsupervised."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() else default


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, default=_env_int("LOCAL_WORLD_SIZE", 1))
    parser.add_argument("--nnodes", type=int, default=_env_int("NNODES", 1))
    parser.add_argument("--node-rank", type=int, default=_env_int("GROUP_RANK", 0))
    parser.add_argument("-m", "--module", action="store_true", help="COMMAND is a module")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, not {args.nproc_per_node}")
    if args.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, not {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} is not a node of --nnodes {args.nnodes}")
    try:
        command = resolve_command(list(args.command), prog=PROG, module=args.module)
    except CommandNotFound as exc:
        parser.error(str(exc))
    return args, command


def main(argv: Sequence[str] | None = None) -> int:
    args, command = parse(sys.argv[1:] if argv is None else argv)
    base = dict(os.environ)
    if base.get(HOST_MONITOR_URL):
        # The ranks count their optimizer steps as progress, unless their script reports
        # its own or RESILIENCY_AUTO_PROGRESS=0 (training.auto_progress).
        base.update(startup_env(base))
    envs = [
        rank_env(
            base,
            node_rank=args.node_rank,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            local=local,
        )
        for local in range(args.nproc_per_node)
    ]
    ranks = PodRanks(command, envs)
    signal.signal(signal.SIGTERM, ranks.on_signal)
    signal.signal(signal.SIGINT, ranks.on_signal)
    ranks.start()
    return ranks.wait()


if __name__ == "__main__":
    sys.exit(main())
