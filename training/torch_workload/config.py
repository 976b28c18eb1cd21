"""The torch workload's settings, from environment variables.

| Variable | Default | Meaning |
|---|---|---|
| `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` | (torchrun) | The process group. |
| `LOCAL_RANK` | `0` | The rank's GPU on its node (torchrun's; CUDA only). |
| `SEED` | `0` | Seeds the initial weights and every batch. |
| `TOTAL_STEPS` | `200` | Steps to train. |
| `STOP_AFTER_STEP` | `0` | Stop (exit 0) after this step; 0: train to the end. |
| `VOCAB_SIZE` | `256` | Tokens. |
| `D_MODEL`, `N_LAYERS`, `N_HEADS` | `256`, `4`, `4` | The transformer's size (3.3M parameters). |
| `SEQ_LEN`, `BATCH_SIZE` | `64`, `8` | Each rank's batch: sequences of tokens. |
| `LEARNING_RATE` | `0.001` | AdamW, with a cosine schedule over TOTAL_STEPS. |
| `STEP_TIME_S` | `0` | Extra seconds per step (to pace a demo). |
| `OUTPUT_DIR` | unset | Rank 0 writes `weights.sha256` there at the end. |
| `LOG_EVERY_STEPS` | `10` | One progress line every this many steps. |
| `WORKLOAD_ATTEMPT` | torchrun's restart count, else `0` | Names the attempt in the log. |
| `PEER_LOSS_WAIT_S` | `120` | After a failed collective: seconds to stay up (see train.py). |
| `WORLD_WAIT_S` | `0` | See below. |
| `PARALLELISM` | `ddp` | `ddp`, `fsdp` (FSDP2 over every rank), `hsdp` (FSDP2, 2-D mesh). |
| `DP_REPLICATE` | `2` | `hsdp`: replica groups (WORLD_SIZE a multiple of it). |
| `COLLECTIVE_TIMEOUT_S` | `600` | A collective waiting longer fails (every group). |
| `DATA_REPLICAS` | `WORLD_SIZE` | `ddp`: batches per step, in any world (elastic.py). |

`WORLD_WAIT_S` above 0, with a host monitor: the supervisor assigns the world to start in
(a JobSet that heals in-process); wait this long for it, and exit 4 without one.

The checkpoint tiers read their own settings (`training.checkpoint.CheckpointSettings`:
`IN_MEMORY_CHECKPOINTING_FREQ`, `S3_CHECKPOINTING_FREQ`, `CHECKPOINT_RAM_DIR`,
`CHECKPOINT_DURABLE_DIR`, ...); the worker client `HOST_MONITOR_URL` and the others.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from resiliency_protocol import worker_env
from training.errors import TrainingError

PARALLELISMS = ("ddp", "fsdp", "hsdp")


class ConfigError(TrainingError, ValueError):
    """A setting is missing or invalid; the message names it."""


@dataclass(frozen=True)
class TorchWorkloadConfig:
    rank: int
    world_size: int
    seed: int = 0
    total_steps: int = 200
    stop_after_step: int = 0
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    batch_size: int = 8
    learning_rate: float = 1e-3
    step_time_s: float = 0.0
    output_dir: Path | None = None
    log_every_steps: int = 10
    peer_loss_wait_s: float = 120.0
    world_wait_s: float = 0.0
    parallelism: str = "ddp"
    dp_replicate: int = 2
    collective_timeout_s: float = 600.0
    attempt: str = "0"
    local_rank: int = 0
    #: Batches per step (`ddp`), fixed for the job's life: a smaller world trains on all
    #: of them (elastic.py). 0: the world size.
    data_replicas: int = 0

    @property
    def batches_per_step(self) -> int:
        return self.data_replicas or self.world_size

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank} must be in [0, WORLD_SIZE={self.world_size})")
        for name in ("total_steps", "vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.upper()} must be >= 1")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"D_MODEL={self.d_model} must be a multiple of N_HEADS={self.n_heads}"
            )
        if self.batch_size < 1 or self.log_every_steps < 1:
            raise ConfigError("BATCH_SIZE and LOG_EVERY_STEPS must be >= 1")
        if self.stop_after_step < 0 or self.step_time_s < 0 or self.learning_rate <= 0:
            raise ConfigError("STOP_AFTER_STEP, STEP_TIME_S must be >= 0, LEARNING_RATE > 0")
        if self.peer_loss_wait_s < 0 or self.world_wait_s < 0:
            raise ConfigError("PEER_LOSS_WAIT_S and WORLD_WAIT_S must be >= 0")
        if self.parallelism not in PARALLELISMS:
            raise ConfigError(
                f"PARALLELISM={self.parallelism!r} must be one of {', '.join(PARALLELISMS)}"
            )
        if self.collective_timeout_s <= 0:
            raise ConfigError("COLLECTIVE_TIMEOUT_S must be > 0")
        if self.dp_replicate < 1:
            raise ConfigError(f"DP_REPLICATE={self.dp_replicate} must be >= 1")
        if self.local_rank < 0:
            raise ConfigError(f"LOCAL_RANK={self.local_rank} must be >= 0")
        if self.data_replicas < 0:
            raise ConfigError(f"DATA_REPLICAS={self.data_replicas} must be >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TorchWorkloadConfig:
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        attempt = (
            env.get(worker_env.WORKLOAD_ATTEMPT) or env.get("TORCHELASTIC_RESTART_COUNT") or "0"
        )
        values["attempt"] = attempt.strip()[:64]
        for field in fields(cls):
            if field.name == "attempt":
                continue
            raw = env.get(field.name.upper())
            if raw is None or raw == "":
                if field.name in ("rank", "world_size"):
                    raise ConfigError(f"{field.name.upper()} is required (run under torchrun)")
                continue
            try:
                if field.name == "output_dir":
                    values[field.name] = Path(raw)
                elif field.name == "parallelism":
                    values[field.name] = raw.strip().lower()
                elif field.type in ("float", float):
                    values[field.name] = float(raw)
                else:
                    values[field.name] = int(raw)
            except ValueError:
                raise ConfigError(f"{field.name.upper()}={raw!r} is not a number") from None
        return cls(**values)  # type: ignore[arg-type]
