"""Tiered checkpoints of one shard, like HyperPod's managed tiered checkpointing.

Tiers: `local` (per node, `LOCAL_CKPT_DIR`, frequent), `durable` (shared,
`DURABLE_CKPT_DIR`, less frequent) and `emergency` (shared, `DURABLE_CKPT_DIR/emergency`,
written on SIGUSR1 so that a replacement node can read it). The file layout, the atomic
write and the verification are `training.npz_format`'s (`checkpoint_file`,
`write_checkpoint_file`, `read_checkpoint`): `<tier>/step-<s:08d>/shard-<k>-of-<N>.npz`,
with a sha256 per array checked on load, so a partial or corrupt file is never taken as a
checkpoint.

Fenced by world (training/checkpoint/fencing.py, through `fence.TierFence`): each file
records the world it was written in, a save is refused (StaleWorldCommit) when a newer
world has started in its tier, and a step shadowed by a newer world's start is never
offered for a restore and is removed before retention counts the steps it keeps.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import fencing
from training.checkpoint.fencing import WorldStart
from training.npz_format import (
    CheckpointData,
    checkpoint_file,
    checkpoint_steps,
    list_checkpoints,
    read_checkpoint,
    step_dir,
    write_checkpoint_file,
)
from training.numpy_workload.fence import TierFence
from training.numpy_workload.model import ShardState, Vector
from training.worker_client import CheckpointTier

# Where to load from first when several tiers hold a step: the fastest.
LOAD_ORDER: tuple[CheckpointTier, ...] = (Tier.LOCAL, Tier.DURABLE, Tier.EMERGENCY)


@dataclass(frozen=True)
class Available:
    step: int
    tier: CheckpointTier
    path: Path


def _npy_bytes(array: Vector) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _npy_array(data: bytes) -> Vector:
    array: Vector = np.load(io.BytesIO(data), allow_pickle=False)
    return array


class CheckpointStore:
    """Saves, lists and loads the checkpoints of one shard across the three tiers."""

    def __init__(
        self,
        tiers: dict[CheckpointTier, Path],
        *,
        shard: int,
        num_shards: int,
        keep: int = 3,
        fence: TierFence | None = None,
    ) -> None:
        """`fence`: the worker's side of the fence between worlds (None: not fenced)."""
        self.tiers = tiers
        self.shard = shard
        self.num_shards = num_shards
        self.keep = keep
        self.fence = fence

    def save(self, state: ShardState, tier: CheckpointTier) -> tuple[Path, float]:
        """Write the state atomically to `tier`, prune old steps; (path, seconds).
        StaleWorldCommit, nothing written, when a newer world has started in `tier`."""
        started = time.monotonic()
        tier_dir = self.tiers[tier]
        if self.fence is not None:
            self.fence.check(tier)
        path = write_checkpoint_file(
            tier_dir,
            state.step,
            self.shard,
            self.num_shards,
            {"w.npy": _npy_bytes(state.w), "v.npy": _npy_bytes(state.v)},
            world=self.fence.world if self.fence is not None else None,
        )
        if self.fence is not None:
            self.drop_shadowed(tier_dir, self.fence.tier_starts(tier))
        self.prune(tier_dir, state.step)
        return path, time.monotonic() - started

    def drop_shadowed(self, tier_dir: Path, starts: list[WorldStart]) -> list[int]:
        """Remove this shard's files shadowed by a newer world's start, before retention
        keeps the newest steps (a shadowed step must not push a newer world's out); the
        steps removed. Only this shard's: another shard's file of the step may be good."""
        removed: list[int] = []
        if not starts:
            return removed
        earliest = min(start.step for start in starts)
        for step in checkpoint_steps(tier_dir):
            if step <= earliest:
                continue  # no start shadows it: spare the read
            path = checkpoint_file(tier_dir, step, self.shard, self.num_shards)
            data = read_checkpoint(path, step=step, shard=self.shard, num_shards=self.num_shards)
            if data is not None and fencing.shadowed(data.world, step, starts):
                with contextlib.suppress(OSError):
                    path.unlink()
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # fails while other shards' files are there
                removed.append(step)
        return removed

    def prune(self, tier_dir: Path, current_step: int) -> None:
        """Keep the newest `keep` steps up to `current_step`; never touch newer ones.

        Steps above the current one are left alone: they belong to a run that went
        further before it was rolled back, and are overwritten when this run gets there.
        """
        older = [s for s in checkpoint_steps(tier_dir) if s <= current_step]
        for step in older[: -self.keep]:
            shutil.rmtree(step_dir(tier_dir, step), ignore_errors=True)

    def available(self, starts: Iterable[WorldStart] = ()) -> dict[int, Available]:
        """Every step this shard can be loaded from (verified), by step; a file shadowed by
        one of `starts` is left out (the step may still come from another tier)."""
        fenced = list(starts)

        def unshadowed(data: CheckpointData) -> bool:
            return not fencing.shadowed(data.world, data.step, fenced)

        order = [self.tiers[t] for t in LOAD_ORDER if t in self.tiers]
        found = list_checkpoints(order, self.shard, self.num_shards, accept=unshadowed)
        by_dir = {d.resolve(): t for t, d in self.tiers.items()}
        out: dict[int, Available] = {}
        for step, path in found.items():
            tier = by_dir.get(path.parent.parent.resolve())
            if tier is not None:
                out[step] = Available(step, tier, path)
        return out

    def load(self, available: Available, dim: int) -> tuple[ShardState, float]:
        """Load and verify one checkpoint; (state, seconds). Raises if it went bad."""
        started = time.monotonic()
        data = read_checkpoint(
            available.path, step=available.step, shard=self.shard, num_shards=self.num_shards
        )
        if data is None:
            raise RuntimeError(f"checkpoint {available.path} is no longer valid")
        try:
            w = _npy_array(data.members["w.npy"])
            v = _npy_array(data.members["v.npy"])
        except (KeyError, ValueError) as exc:
            raise RuntimeError(f"checkpoint {available.path} is unreadable: {exc}") from exc
        if w.shape != (dim,) or v.shape != (dim,) or w.dtype != np.float64:
            raise RuntimeError(f"checkpoint {available.path} holds shape {w.shape}, not ({dim},)")
        return ShardState(step=data.step, w=w, v=v), time.monotonic() - started


def write_output(output_dir: Path, shard: int, w: Vector) -> Path:
    """Final weights as `shard-<k>.npy`, written atomically."""
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"shard-{shard}.npy"
    tmp = output_dir / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.save(f, w, allow_pickle=False)
        tmp.replace(final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return final
