"""What a `Checkpointer` is told besides its settings, tiers and client: this rank's place
in the job, and which of its services it runs. Each is found out when not given
(torch.distributed, the worker client, the model)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypedDict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint.peer import PeerTier
from training.worker_client import WorkerClient


@dataclass(frozen=True)
class CheckpointerOptions:
    """`rank`, `world_size`: default torch.distributed's (0 and 1 without a process
    group); `job`: default the worker client's; `replicated`: every rank holds the same
    state (default: the model is a DDP model); `emergency`: serve the host monitor's
    emergency checkpoint requests (default: when the client is online; needs the
    optimizer, and the call from the main thread, after `client.register()`);
    `hook_optimizer`: mark the start of each parameter update with a pre-hook on
    `optimizer.step()`. Pass False where `optimizer.step()` runs the forward and backward
    itself, in a closure (Lightning's automatic optimization), and call
    `optimizer_step_starts()` right before the update instead: the pre-hook would hold
    emergency saves during the backward."""

    rank: int | None = None
    world_size: int | None = None
    job: str | None = None
    replicated: bool | None = None
    emergency: bool | None = None
    hook_optimizer: bool = True

    def resolve(self, model: torch.nn.Module, client: WorkerClient | None) -> Resolved:
        """Each option, found out where not given."""
        distributed = dist.is_available() and dist.is_initialized()
        return Resolved(
            rank=self.rank if self.rank is not None else (dist.get_rank() if distributed else 0),
            world_size=(
                self.world_size
                if self.world_size is not None
                else (dist.get_world_size() if distributed else 1)
            ),
            job=self.job if self.job is not None else (client.job if client else None),
            replicated=(
                self.replicated
                if self.replicated is not None
                else isinstance(model, DistributedDataParallel)
            ),
            emergency=(
                self.emergency
                if self.emergency is not None
                else (client is not None and client.online)
            ),
        )


@dataclass(frozen=True)
class Resolved:
    rank: int
    world_size: int
    job: str | None
    replicated: bool
    emergency: bool


class OptionKeywords(TypedDict, total=False):
    """The options given one keyword each (`Checkpointer(model, rank=0, ...)`), and `peer`:
    the host monitor's client for the partner's copy, when the Checkpointer opens its
    tiers itself."""

    rank: int | None
    world_size: int | None
    job: str | None
    replicated: bool | None
    emergency: bool | None
    hook_optimizer: bool
    peer: PeerTier | None


_NAMES = {f.name for f in fields(CheckpointerOptions)}


def from_keywords(
    options: CheckpointerOptions | None, keywords: OptionKeywords
) -> tuple[CheckpointerOptions, PeerTier | None]:
    """The options, given whole or one keyword each (not both), and the `peer` keyword."""
    given = {name: value for name, value in keywords.items() if name in _NAMES}
    unknown = set(keywords) - set(OptionKeywords.__annotations__)
    if unknown:
        raise TypeError(f"Checkpointer() got unexpected keywords: {', '.join(sorted(unknown))}")
    if options is not None and given:
        raise TypeError(f"Checkpointer(): give `options` or {', '.join(sorted(given))}, not both")
    peer = keywords.get(Tier.PEER.value)  # the keyword is named after the tier
    return options or CheckpointerOptions(**given), peer  # type: ignore[arg-type]
