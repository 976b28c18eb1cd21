"""What a launcher gives each worker, shared by the supervisor's local cluster and the
host monitor's `--launch`: torchrun's environment, the command as given (refused when it
cannot be found), and what a host monitor that launched its node's workers tells the
supervisor (`HostJoin`).

Both launchers compute the environment here, so that a rank started by its host monitor at
boot and one started again by the supervisor get the same variables.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from resiliency_protocol import worker_env
from resiliency_protocol.exceptions import ProtocolError

#: torchrun's default MASTER_PORT; attempt N of a job launched by its hosts uses
#: MASTER_PORT + (N - 1) % PORT_SPAN, so that a new world never meets ranks of the old.
DEFAULT_MASTER_PORT = 29500
PORT_SPAN = 100
MAX_PORT = 65535
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"  # a node's or job's name


class CommandNotFound(ProtocolError, ValueError):
    """The command cannot be run here (the message says why, in one line)."""


def resolve_command(given: list[str], *, prog: str, module: bool = False) -> list[str]:
    """What each worker runs for `given` (torchrun's forms): `train.py ARGS` with this
    Python, `-m` a module, else `-- COMMAND ARGS` as it is (a leading `--` is dropped).
    Raises CommandNotFound when there is nothing to run (`prog`: for its usage line)."""
    dashes = bool(given) and given[0] == "--"
    if dashes:
        given = given[1:]
    if not given:
        raise CommandNotFound(f"no command: {prog} [OPTIONS] -- COMMAND...")
    first = given[0]
    if module:
        try:
            spec = importlib.util.find_spec(first)
        except (ImportError, ValueError):  # its package is missing, or a bad name
            spec = None
        if spec is None:
            raise CommandNotFound(f"no module named {first!r}")
        return [sys.executable, "-u", "-m", *given]
    if first.endswith(".py") and not dashes:
        if not Path(first).is_file():
            raise CommandNotFound(f"no such script: {first}")
        return [sys.executable, "-u", os.path.abspath(first), *given[1:]]
    found = shutil.which(first)
    if found is None:
        raise CommandNotFound(f"command not found: {first}")
    # Absolute (the workers run elsewhere), but not through symlinks: a virtual
    # environment's `python` is a link whose own path selects the environment.
    return [os.path.abspath(found) if "/" in first else first, *given[1:]]


def ranks_of(group_rank: int, nproc_per_node: int) -> range:
    """The global ranks the node of `group_rank` runs (torchrun's order)."""
    return range(group_rank * nproc_per_node, (group_rank + 1) * nproc_per_node)


def thread_default(env: dict[str, str], nproc_per_node: int) -> dict[str, str]:
    """`env` with torchrun's default of one OpenMP thread per rank when a node runs several
    ranks and nobody chose a count (`OMP_NUM_THREADS` unset): without it every rank starts
    a thread per core, and the node's ranks spin on each other's cores."""
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        return {**env, "OMP_NUM_THREADS": "1"}
    return env


def master_port(base: int, attempt: int) -> int:
    """MASTER_PORT of `attempt` (1 = the first) of a job whose hosts agree on `base`."""
    return base + (max(1, attempt) - 1) % PORT_SPAN


def rendezvous_env(
    master_addr: str, port: int, nproc_per_node: int, attempt: int
) -> dict[str, str]:
    """torch.distributed's rendezvous, as torchrun sets it (RANK and LOCAL_RANK are each
    worker's, GROUP_RANK its node's)."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        # Restarts of the job so far (the boot is attempt 1).
        "TORCHELASTIC_RESTART_COUNT": str(max(0, attempt - 1)),
    }


def job_env(nnodes: int, nproc_per_node: int, attempt: int) -> dict[str, str]:
    """The job's shape and world, as the project's workers read them (one node per data
    parallel replica)."""
    return {
        worker_env.WORKLOAD_ATTEMPT: str(attempt),
        "NUM_DP_REPLICAS": str(nnodes),
        "NUM_NODES_PER_DP": "1",
        "WORLD_SIZE": str(nnodes * nproc_per_node),
    }


class HostJoin(BaseModel):
    """POST /api/v1/local/hosts: a host monitor started with `--launch` tells the
    supervisor (local backend) its node, its address and the job it launched, so that the
    supervisor's actions reach its workers."""

    model_config = ConfigDict(extra="forbid")

    node: str = Field(pattern=NAME_PATTERN, description="The node (its host monitor's name).")
    address: str = Field(
        pattern=r"^https?://[^\s/]+$",
        max_length=300,
        description="Where the supervisor reaches the host monitor's API.",
    )
    checkpoint_root: str | None = Field(
        None, max_length=4096, description="The host monitor's checkpoint_root."
    )
    job: str = Field(pattern=NAME_PATTERN, description="The job it launched.")
    command: list[str] = Field(
        min_length=1, max_length=10_000, description="What each worker runs."
    )
    nnodes: int = Field(ge=1, le=100_000, description="Nodes of the job (torchrun's --nnodes).")
    nproc_per_node: int = Field(ge=1, le=1024, description="Workers per node.")
    node_rank: int = Field(
        ge=0,
        le=100_000,
        description="This node's GROUP_RANK; from nnodes on, a spare's place in the line.",
    )
    spares: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Spare hosts beside the job's: node ranks nnodes to nnodes + spares - 1 "
        "stand by, each to take a lost host's place.",
    )
    master_addr: str = Field(
        min_length=1, max_length=253, pattern=r"^[^\s]+$", description="Rank 0's host."
    )
    master_port: int = Field(
        ge=1, le=MAX_PORT - PORT_SPAN, description="The first attempt's MASTER_PORT."
    )
    attempt: int = Field(ge=1, le=2**31, description="The attempt it launched (1 at boot).")


class HostJoined(BaseModel):
    job: str = Field(description="The job the host joined.")
    complete: bool = Field(
        description="Every node rank of the job has joined: the supervisor acts on it."
    )
    attempt: int | None = Field(description="The job's attempt once complete, else null.")
    waiting_for: list[int] = Field(description="Node ranks that have not joined yet.")
    start: bool = Field(
        description="The host starts its node's workers now (the job's first attempt); "
        "false while the job is not complete, and once the supervisor started an attempt."
    )
    spare: bool = Field(
        False,
        description="The host stands by as a spare of the job (its node rank is nnodes or "
        "more) and has not been swapped in: the supervisor starts its workers when it is.",
    )
    finished: bool = Field(
        False, description="The job finished (every rank exited 0): a spare may exit."
    )
