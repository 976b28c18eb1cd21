"""The ranks' agreement on the step to restore, and its load on every rank.

The Checkpointer's collaborator for `restore()`: the ranks first exchange the world starts
each sees (fencing.py), so that every rank leaves out the same shadowed commits; then the
steps each can load (all_gather), load the newest common one, and drop it and agree again
when some rank could not load it after all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from training.checkpoint.fencing import WorldStart
from training.checkpoint.restorer import Loaded, Restorer, Source
from training.checkpoint.state import Snapshot, TrainingState
from training.checkpoint.world_fence import WorldFence
from training.worker_client import WorkerClient

log = logging.getLogger("training.checkpoint.checkpointer")

#: Restore rounds before giving up on agreeing (each drops steps some rank cannot load).
MAX_RESTORE_ROUNDS = 16


@dataclass(frozen=True)
class Restored:
    """What `restore()` did on this rank."""

    step: int  # 0: nothing to restore, start fresh
    tier: Source | None  # "memory" or the tier's kind; None when starting fresh
    size: int
    seconds: float
    #: A sharded state's restore: the tier each saving rank's directory was read from.
    sources: dict[int, Source] = field(default_factory=dict)


class RestoreAgreement:
    """Agrees on a step with the other ranks and loads it (`agree_and_load`)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        state: TrainingState,
        restorer: Restorer,
        fence: WorldFence,
        client: WorkerClient | None,
        on_step_completed: Callable[[int], None],
    ) -> None:
        """`state`: what is restored (`Checkpointer.rebind` replaces it);
        `on_step_completed`: called with the step the ranks continue after."""
        self.rank = rank
        self.world_size = world_size
        self.state = state
        self._restorer = restorer
        self._fence = fence
        self.client = client
        self._step_completed = on_step_completed
        #: What the last `restore()` did.
        self.last_restore: Restored | None = None
        #: The optimizer had no state before the restore: it must have none if nothing
        #: is loaded after all (reading a state dict makes one).
        self.fresh_optimizer = False
        #: The restore under way has loaded a step into the state.
        self.state_loaded = False

    def loading(self) -> None:
        self.state_loaded = True  # from here the live tensors may change

    def agree_and_load(
        self, candidates: dict[int, Any], held: Snapshot | None, started: float
    ) -> int:
        self.state_loaded = False
        dropped: set[int] = set()
        loaded_before = False  # this rank's tensors hold a step the ranks then dropped
        for _ in range(MAX_RESTORE_ROUNDS):
            mine = sorted((set(candidates) | ({held.step} if held else set())) - dropped)
            everyone = self._all_gather(
                {"steps": mine, "world_size": self.world_size, "loaded": loaded_before}
            )
            for rank, theirs in enumerate(everyone):
                if theirs["world_size"] != self.world_size:
                    raise RuntimeError(
                        f"rank {rank} restores with world_size={theirs['world_size']}, "
                        f"this rank with {self.world_size}"
                    )
            common = set(mine)
            for theirs in everyone:
                common &= set(theirs["steps"])
            if not common and any(theirs["loaded"] for theirs in everyone):
                # Starting from step 0 would keep the weights some rank already loaded.
                raise RuntimeError(
                    "no step is left that every rank can load, and some ranks hold a step "
                    "the others could not load: start the job again (it starts fresh)"
                )
            if not common:
                if self.fresh_optimizer and self.state.optimizer is not None:
                    self.state.optimizer.state.clear()
                self.last_restore = Restored(0, None, 0, time.monotonic() - started)
                log.info("checkpoint: no step every rank can load; starting from step 0")
                self._step_completed(0)
                return 0
            step = max(common)
            _say_newer_steps_left_out(step, everyone)
            if held is not None and held.step == step:
                self.state.rewind(held)
                loaded: Loaded | None = Loaded("memory", 0, {})
            else:
                loaded = self._restorer.load(step, candidates.get(step, []))
            oks = self._all_gather(loaded is not None)
            if all(oks):
                assert loaded is not None
                if loaded.tier != "memory":
                    self._restorer.apply_loaded()
                tier, size = loaded.tier, loaded.size
                seconds = time.monotonic() - started
                self.last_restore = Restored(step, tier, size, seconds, loaded.sources)
                if self.client is not None and tier != "memory":  # nothing was loaded
                    self.client.report_checkpoint_loaded(
                        step,
                        seconds,
                        tier,
                        size_bytes=size,
                        total_s=seconds,
                    )
                log.info("checkpoint: restored step %d from %s (%d bytes)", step, tier, size)
                self._step_completed(step)
                return step
            failed = [rank for rank, ok in enumerate(oks) if not ok]
            log.warning(
                "checkpoint: step %d could not be loaded by ranks %s: agreeing again", step, failed
            )
            if loaded is None:
                dropped.add(step)
            elif not self.state.gathered:  # a gathered state is applied only once agreed
                loaded_before = True
        raise RuntimeError(f"no checkpoint could be loaded after {MAX_RESTORE_ROUNDS} rounds")

    def agreed_starts(self) -> list[WorldStart]:
        """The starts every rank sees, together: a start recorded in one node's RAM tier
        fences the commits other nodes hold too."""
        mine = [(start.world, start.step) for start in self._fence.starts()]
        return sorted({WorldStart(*pair) for theirs in self._all_gather(mine) for pair in theirs})

    def _all_gather(self, mine: Any) -> list[Any]:
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return [mine]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, mine)
        return out


def _say_newer_steps_left_out(step: int, everyone: list[dict[str, Any]]) -> None:
    """Steps newer than the one agreed that some ranks could load and others could not:
    the work a restore loses beyond the newest save, and which ranks lacked it (a shard
    whose copies were lost with its node, refused from an older world, not yet found)."""
    newer = {rank: [s for s in theirs["steps"] if s > step] for rank, theirs in enumerate(everyone)}
    if not any(newer.values()):
        return
    lacking = [rank for rank, steps in newer.items() if not steps]
    log.warning(
        "checkpoint: step %d is the newest every rank can load; newer steps held: %s; "
        "ranks with none newer: %s",
        step,
        {rank: steps for rank, steps in newer.items() if steps},
        lacking,
    )
