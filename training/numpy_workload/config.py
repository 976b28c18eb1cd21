"""The workload's settings, all from environment variables.

| Variable | Default | Meaning |
|---|---|---|
| `RANK` | `0` | This worker's rank: replica * NUM_NODES_PER_DP + shard. |
| `NUM_DP_REPLICAS` | `1` | Data-parallel replicas (R). |
| `NUM_NODES_PER_DP` | `1` | Nodes per replica (N): the model is sharded N ways. |
| `WORLD_SIZE` | R x N | Checked against R x N when set. |
| `SEED` | `0` | Seeds the ground truth, the initial weights and every micro-batch. |
| `TOTAL_STEPS` | `200` | Steps to train. |
| `STEP_TIME_S` | `0.05` | Simulated extra compute per step (seconds). |
| `RUN_DIR` | `./workload-run` | Shared directory; the collective lives in `RUN_DIR/collective`. |
| `WORKLOAD_ATTEMPT` | `0` | Separates restarts: each attempt has its own collective directory. |
| `LOCAL_CKPT_DIR` | `RUN_DIR/local/rank-<RANK>` | Local checkpoint tier (per node). |
| `DURABLE_CKPT_DIR` | `RUN_DIR/durable` | Durable tier (shared); emergency ones in `emergency/`. |
| `IN_MEMORY_CHECKPOINTING_FREQ` | `10` | Save to the local tier every this many steps (0: never). |
| `S3_CHECKPOINTING_FREQ` | `20` | Save to the durable tier every this many steps (0: never). |
| `KEEP_CHECKPOINTS` | `3` | Newest steps kept per tier. |
| `MAX_CONSECUTIVE_SAVE_FAILURES` | `3` | Refused saves in a row before the worker stops. |
| `OUTPUT_DIR` | `RUN_DIR/output` | Replica 0 writes the final weights here, `shard-<k>.npy`. |
| `COLLECTIVE_TIMEOUT_S` | `600` | A collective waiting longer than this exits with code 3. |
| `LOG_EVERY_STEPS` | `10` | One progress line every this many steps. |
| `MODEL_DIM` | `64` | Parameters per shard. |
| `BATCH_SIZE` | `32` | Micro-batch rows per replica and shard. |
| `LEARNING_RATE` | `0.05` | SGD learning rate. |
| `MOMENTUM` | `0.9` | SGD momentum. |

A numeric `WORKLOAD_ATTEMPT` is also the world the checkpoints are written in: a save is
refused once a newer world has started in its tier (training/checkpoint/fencing.py), and
`MAX_CONSECUTIVE_SAVE_FAILURES` refusals in a row to one tier stop the worker (0: never).

The worker client reads `LOCAL_RANK`, `HOST_MONITOR_URL`, `HOST_MONITOR_WORKER_TOKEN`
and `HOST_MONITOR_REQUEST_FILE` (see `training.worker_client`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from resiliency_protocol import worker_env
from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint.fencing import world_from_env
from training.errors import TrainingError

T = TypeVar("T")


class ConfigError(TrainingError, ValueError):
    """A setting is missing or invalid; the message names it."""


@dataclass(frozen=True)
class WorkloadConfig:
    rank: int
    num_replicas: int
    num_shards: int
    seed: int
    total_steps: int
    step_time_s: float
    run_dir: Path
    attempt: str
    #: The world this worker's checkpoints are written in (None: WORKLOAD_ATTEMPT is
    #: not a number, nothing is fenced until a restore finds a world in the tiers).
    world: int | None
    local_ckpt_dir: Path
    durable_ckpt_dir: Path
    local_freq: int
    durable_freq: int
    keep_checkpoints: int
    max_consecutive_save_failures: int
    output_dir: Path
    collective_timeout_s: float
    log_every: int
    model_dim: int
    batch_size: int
    learning_rate: float
    momentum: float

    @property
    def world_size(self) -> int:
        return self.num_replicas * self.num_shards

    @property
    def replica(self) -> int:
        return self.rank // self.num_shards

    @property
    def shard(self) -> int:
        return self.rank % self.num_shards

    @property
    def emergency_ckpt_dir(self) -> Path:
        return self.durable_ckpt_dir / "emergency"

    @property
    def collective_dir(self) -> Path:
        return self.run_dir / "collective" / self.attempt

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkloadConfig:
        env = os.environ if env is None else env

        def get(name: str, parse: Callable[[str], T], default: T, ok: Callable[[T], bool]) -> T:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = parse(raw)
            except ValueError:
                raise ConfigError(f"invalid {name}={raw!r}") from None
            if not ok(value):
                raise ConfigError(f"invalid {name}={raw!r}")
            return value

        def positive(v: float) -> bool:
            return v > 0

        def non_negative(v: float) -> bool:
            return v >= 0

        rank = get(worker_env.RANK, int, 0, non_negative)
        replicas = get(worker_env.NUM_DP_REPLICAS, int, 1, positive)
        shards = get(worker_env.NUM_NODES_PER_DP, int, 1, positive)
        world = get(worker_env.WORLD_SIZE, int, replicas * shards, positive)
        if world != replicas * shards:
            raise ConfigError(
                f"WORLD_SIZE={world} but NUM_DP_REPLICAS x NUM_NODES_PER_DP = {replicas * shards}"
            )
        if rank >= world:
            raise ConfigError(f"RANK={rank} is not below the world size {world}")
        run_dir = Path(env.get(worker_env.RUN_DIR) or "workload-run")
        attempt = env.get(worker_env.WORKLOAD_ATTEMPT, "").strip() or "0"
        if "/" in attempt or attempt in (".", ".."):
            raise ConfigError(f"invalid WORKLOAD_ATTEMPT={attempt!r}")
        durable = Path(env.get(worker_env.DURABLE_CKPT_DIR) or run_dir / Tier.DURABLE)
        return cls(
            rank=rank,
            num_replicas=replicas,
            num_shards=shards,
            seed=get("SEED", int, 0, non_negative),
            total_steps=get("TOTAL_STEPS", int, 200, non_negative),
            step_time_s=get("STEP_TIME_S", float, 0.05, non_negative),
            run_dir=run_dir,
            attempt=attempt,
            world=world_from_env(env),
            local_ckpt_dir=Path(
                env.get(worker_env.LOCAL_CKPT_DIR) or run_dir / "local" / f"rank-{rank}"
            ),
            durable_ckpt_dir=durable,
            local_freq=get("IN_MEMORY_CHECKPOINTING_FREQ", int, 10, non_negative),
            durable_freq=get("S3_CHECKPOINTING_FREQ", int, 20, non_negative),
            keep_checkpoints=get("KEEP_CHECKPOINTS", int, 3, positive),
            max_consecutive_save_failures=get(
                "MAX_CONSECUTIVE_SAVE_FAILURES", int, 3, non_negative
            ),
            output_dir=Path(env.get(worker_env.OUTPUT_DIR) or run_dir / "output"),
            collective_timeout_s=get("COLLECTIVE_TIMEOUT_S", float, 600.0, positive),
            log_every=get("LOG_EVERY_STEPS", int, 10, positive),
            model_dim=get("MODEL_DIM", int, 64, positive),
            batch_size=get("BATCH_SIZE", int, 32, positive),
            learning_rate=get("LEARNING_RATE", float, 0.05, positive),
            momentum=get("MOMENTUM", float, 0.9, lambda v: 0 <= v < 1),
        )
