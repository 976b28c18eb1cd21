"""In-process healing for a training script of your own: its processes outlive a fault.

When a rank fails, the supervisor (asked to heal in-process: `supervisor run
--in-process`, the local backend's `JobSpec.in_process_restart`, a JobSet's annotation)
stops and starts anew only the failed node's ranks and hands every other rank a new
world through its host monitor: MASTER_ADDR, a fresh MASTER_PORT, WORLD_SIZE and the
attempt. A surviving rank leaves the failed process group, joins the new one, and goes
on from the state it holds (`Checkpointer.restore(in_memory=True)` rewinds the failed
step); the new ranks load that step from the tiers. Python's start, torch's import and
the load of every survivor are saved.

The script's loop becomes one pass per world::

    healing = InProcessHealing(client, backend="gloo")
    for world in healing.worlds():  # the first world, then one per in-process heal
        start = ckpt.restore(in_memory=world.rejoined)
        ddp = DistributedDataParallel(model)  # wrapped again in each world
        with world.train():  # a collective that fails ends this world, not the process
            for step in range(start + 1, total + 1):
                ...
        del ddp  # its hooks on the parameters go with it

A failed collective (a peer gone) ends `world.train()` quietly; `worlds()` then leaves
the process group and waits, up to `peer_loss_wait_s` (PEER_LOSS_WAIT_S, 120 s), for the
next world; meanwhile the worker client's thread serves the supervisor's emergency
checkpoint from the last completed step. No world within that time (the supervisor
restarts every rank with new processes instead, or no host monitor is there to ask):
`NoNewWorld`, with the collective's error as its cause, and the process ends.

With `world_wait_s` (WORLD_WAIT_S) above 0, even the first world comes from the host
monitor: the pods of a JobSet that heals in-process, where a replacement pod, created by
its Job like any other, cannot tell from its environment which world the survivors are
in. The rank registers (with its POD_UID), waits up to that long for its world, and
raises `NoNewWorld` without one.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from resiliency_protocol import worker_env
from training.errors import TrainingError
from training.worker_client import WorkerClient

log = logging.getLogger(__name__)

#: How long a rank whose collective failed waits for a new world (seconds).
DEFAULT_PEER_LOSS_WAIT_S = 120.0


class NoNewWorld(TrainingError):
    """A collective failed and no new world came within `peer_loss_wait_s`."""


@dataclass
class World:
    """One world this process trains in: `attempt` (WORKLOAD_ATTEMPT), and whether this
    process came into it from an older one holding its state (`rejoined`)."""

    attempt: str
    rejoined: bool
    #: The collective error that ended it, if one did.
    failure: RuntimeError | None = field(default=None, repr=False)

    @contextmanager
    def train(self) -> Iterator[None]:
        """The body that trains in this world: a RuntimeError (what torch.distributed
        raises when a peer is gone) ends it and is kept as `failure`."""
        try:
            yield
        except RuntimeError as exc:
            self.failure = exc
            log.warning("world %s ended: %s", self.attempt, first_line(exc))


class InProcessHealing:
    """The worlds of one rank: the first from its environment, each next one from its
    host monitor after a collective failed."""

    def __init__(
        self,
        client: WorkerClient,
        *,
        backend: str = "gloo",
        timeout: timedelta | None = None,
        peer_loss_wait_s: float | None = None,
        world_wait_s: float | None = None,
    ) -> None:
        self.client = client
        self.backend = backend
        self.timeout = timeout
        self.peer_loss_wait_s = _seconds(
            "peer_loss_wait_s", peer_loss_wait_s, "PEER_LOSS_WAIT_S", DEFAULT_PEER_LOSS_WAIT_S
        )
        self.world_wait_s = _seconds("world_wait_s", world_wait_s, "WORLD_WAIT_S", 0.0)
        self.rank = int(os.environ.get("RANK", "0"))

    def worlds(self) -> Iterator[World]:
        """Yield the first world, then a new one each time the last ended on a failed
        collective; return once a world's training ended without one."""
        world = self._first_world()
        while True:
            yield world
            if world.failure is None:
                return
            failure = world.failure
            abandon_process_group(failure)
            assigned = self._next_world()
            if assigned is None:
                raise NoNewWorld(
                    f"rank {self.rank}: a collective failed and no new world came within "
                    f"PEER_LOSS_WAIT_S={self.peer_loss_wait_s:g}s"
                ) from failure
            world = self._enter(assigned, self.peer_loss_wait_s, rejoined=True)

    def _first_world(self) -> World:
        if self.world_wait_s > 0 and self.client.online:
            # Registered first: the host monitor hands a world to a registered worker.
            self.client.register(world_size=int(os.environ.get("WORLD_SIZE", "1")))
            assigned = self.client.new_world(self.world_wait_s, first=True)
            if assigned is None:
                raise NoNewWorld(
                    f"rank {self.rank}: no world assigned within "
                    f"WORLD_WAIT_S={self.world_wait_s:g}s"
                )
            return self._enter(assigned, self.world_wait_s, rejoined=False)
        self._join()
        # Registered once in the process group: the supervisor then knows this rank
        # trains in this attempt's world.
        self.client.register(world_size=dist.get_world_size())
        return World(self.client.attempt or os.environ.get(worker_env.WORKLOAD_ATTEMPT, "0"), False)

    def _enter(
        self, assigned: tuple[str, dict[str, str]], wait_s: float, *, rejoined: bool
    ) -> World:
        """Join the world the host monitor handed: (attempt, its environment)."""
        attempt, env = assigned
        os.environ.update(env)
        wait_for_master(self.rank, wait_s)
        self._join(wait_s)  # the others may start later still: as long as it waits for them
        self.client.joined(attempt)
        return World(attempt, rejoined)

    def _join(self, join_timeout_s: float = 0.0) -> None:
        join_process_group(self.backend, self.timeout, join_timeout_s)
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if dist.get_rank() != self.rank or dist.get_world_size() != size:
            raise TrainingError(
                f"the process group gives this process rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, its environment RANK={self.rank} of WORLD_SIZE={size}"
            )

    def _next_world(self) -> tuple[str, dict[str, str]] | None:
        """Hold the state (the emergency checkpoint may save it) until the host monitor
        hands a new world; None without one in time, or without a host monitor."""
        if not self.client.online:
            return None
        log.warning("rank %d: waiting for a new world", self.rank)
        return self.client.new_world(self.peer_loss_wait_s)


def _seconds(name: str, given: float | None, variable: str, default: float) -> float:
    value = float(os.environ.get(variable) or default) if given is None else float(given)
    if value < 0:
        raise ValueError(f"{name} ({variable}) must be >= 0, got {value:g}")
    return value


def join_process_group(backend: str, timeout: timedelta | None, join_timeout_s: float) -> None:
    """`dist.init_process_group(backend, timeout=timeout)` from the environment, as `env://`
    joins (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; torchrun's agent store under
    torchrun), but rank 0's store waits up to `join_timeout_s` for the other ranks to
    connect when that is longer than `timeout`. In a new world the survivors wait there for
    a replacement that starts a new process and imports torch first (a new pod is
    scheduled and started before that): a collective's timeout, short so that a hang shows
    early, had the survivors give up on it and the heal fall back to a full restart.
    `timeout` stays the collectives' (None: torch's default, which is long)."""
    if timeout is None or timeout.total_seconds() >= join_timeout_s:
        dist.init_process_group(backend, timeout=timeout)
        return
    joined = rendezvous("env://", timeout=timedelta(seconds=join_timeout_s))
    store, rank, world_size = next(joined)
    store.set_timeout(timeout)
    dist.init_process_group(
        backend,
        # The key prefix `env://` gives the default group's store.
        store=PrefixStore("default_pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def wait_for_master(rank: int, timeout_s: float) -> None:
    """Until rank 0's rendezvous store accepts connections (rank 0 itself opens it).

    In a new world the ranks are told at once but start unevenly (a replacement imports
    torch first). A rank that reaches the store before it listens is sent by
    torch.distributed into a randomised retry delay that reached 40 s here: probing with
    a plain connection first keeps the join to the moment rank 0 is up."""
    if rank == 0:
        return
    host, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.02)


def abandon_process_group(failure: BaseException | None = None) -> None:
    """Leave a process group whose peer is gone (its collectives already failed), so that
    its connections close now: a rank still waiting on this one in a collective then
    fails too, rather than wait for the collective's timeout.

    The group closes its connections only once nothing refers to it, and `failure` (the
    error of the failed collective) does through the frames of its traceback (the DDP
    module, the autograd graph): their locals are cleared first, and what is left in
    reference cycles is collected after."""
    seen: set[int] = set()
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        traceback.clear_frames(failure.__traceback__)
        failure = failure.__cause__ or failure.__context__
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a broken group may fail to tear down: it is left behind
        log.warning("leaving the failed process group: %s", first_line(exc))
    gc.collect()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
