"""Settings of the checkpoint tiers, with the names users of the managed systems know.

- `in_memory_checkpointing_freq` / `s3_checkpointing_freq` (HyperPod's managed tiered
  checkpointing): steps between RAM saves and between durable saves; the durable one must
  be a multiple of the RAM one (a durable save is a copy of a RAM save of the same step).
  `multi_tier_checkpointing_backup_interval_minutes` (MaxText's) adds durable saves by
  the wall clock, at RAM steps (schedule.py).
- `enable_async_ckpt`, `ckpt_threads_per_rank`, `topk_ckpt` (the NeMo recipe's flags).
- The durable tier is a directory (`durable_dir`) or a bucket: `durable_url` takes
  `s3://bucket/prefix` (AWS or any S3-compatible store), `gs://bucket/prefix`, or a path;
  `CHECKPOINT_DURABLE_URL`, or HyperPod's `S3_TIER_BASE_PATH`, in the environment.
  Endpoint, region, addressing and credentials of a bucket come from the standard
  variables and provider chains (durable.py), never from these settings.

Read from the environment by `from_env` (upper-case names, e.g.
`IN_MEMORY_CHECKPOINTING_FREQ`), or passed directly. Every refusal is a `ValueError`
whose message names the setting(s).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

from resiliency_protocol import worker_env
from resiliency_protocol.shared_settings import DEFAULT_CHECKPOINT_ROOT

#: The host monitor's `checkpoint_root` by default: it replicates only from under it.
DEFAULT_RAM_ROOT = Path(DEFAULT_CHECKPOINT_ROOT)


@dataclass(frozen=True)
class CheckpointSettings:
    #: Steps between saves to the RAM tier (tmpfs); 0 turns the RAM tier (and the peer
    #: copy, which is made from it) off.
    in_memory_checkpointing_freq: int = 10
    #: Steps between saves to the durable tier; 0 turns it off. A multiple of the RAM one.
    s3_checkpointing_freq: int = 100
    #: Minutes between durable saves, beside the step interval (MaxText's name): a RAM
    #: save also goes to the durable tier when it is the first past a boundary of this
    #: interval on the wall clock (schedule.py); 0: by steps only. Needs the RAM tier.
    multi_tier_checkpointing_backup_interval_minutes: float = 0.0
    #: The RAM tier's directory (a tmpfs). Default: /dev/shm/resiliency-checkpoints/<job>.
    ram_dir: Path | str | None = None
    #: The durable tier's directory; None: no durable tier (unless `durable_url`).
    durable_dir: Path | str | None = None
    #: The durable tier as a URL: `s3://bucket/prefix`, `gs://bucket/prefix`, or a path
    #: (the same as `durable_dir`). HyperPod's name for it: `s3_tier_base_path`.
    durable_url: str | None = None
    #: The most one request to a bucket may take, its retries with backoff included (503
    #: SlowDown, a store restarting): past it the save fails and is reported, so that a
    #: durable tier that is down never holds the next save (and the loop) for long.
    durable_timeout_s: float = 120.0
    #: Saves run in the background: the loop blocks only while the state is copied.
    enable_async_ckpt: bool = True
    #: The copy of the parameters and optimizer state to host memory runs while the next
    #: step computes its forward and backward passes; that step's `optimizer.step()`
    #: waits for it. Needs parameters and optimizer state that change only in
    #: `optimizer.step()` (true of standard loops); off: the copy blocks `step_done`.
    stage_during_next_step: bool = True
    #: Writer threads per rank for one save (torch.distributed.checkpoint's thread_count).
    ckpt_threads_per_rank: int = 2
    #: Committed checkpoints kept per tier (the newest ones), durable tier.
    topk_ckpt: int = 2
    #: Committed checkpoints kept in the RAM tier (at least 3 in a job of several ranks:
    #: a rank killed mid-save, or a node lost before its newest step reached the partner,
    #: shares an older step with the others, up to two saves back with saves written in
    #: the background).
    #: With the partner's copy the ramdisk holds (the steps kept + 1 while a save is
    #: written + 1 partner) x shard size.
    ram_topk_ckpt: int = 1
    #: Copy each RAM save to the partner node's host monitor (needs a host monitor).
    enable_peer_ckpt: bool = True
    #: Restore may take a step from the partner's copy (NeMo: --enable-ckpt-load-replication).
    enable_ckpt_load_replication: bool = True
    #: fsync files and directories on commit (off only for throw-away runs).
    sync_files: bool = True
    #: The most an emergency save may take, waiting for the step in flight to finish its
    #: `optimizer.step()` and for a periodic save being written included (the
    #: supervisor's setting of the same name bounds the whole round).
    emergency_checkpoint_timeout_s: float = 60.0
    #: Saves that may fail in a row before `step_done` raises with the cause (each failure
    #: is reported as it happens); 0: never raise.
    max_consecutive_save_failures: int = 3

    def __post_init__(self) -> None:
        url = self.durable_url
        if url is not None:
            if not isinstance(url, str) or not url.strip():
                raise ValueError(f"durable_url must be a URL or a path, got {url!r}")
            if self.durable_dir is not None:
                raise ValueError("durable_dir and durable_url both set: give one")
            scheme = url.split("://", 1)[0].lower() if "://" in url else ""
            if scheme in ("", "file"):
                object.__setattr__(self, "durable_dir", Path(url.removeprefix("file://")))
                object.__setattr__(self, "durable_url", None)
            elif scheme not in ("s3", "gs"):
                raise ValueError(
                    f"durable_url must be s3://bucket/prefix, gs://bucket/prefix or a path, "
                    f"not a {scheme}:// URL"
                )
            elif not url.split("://", 1)[1].split("/", 1)[0]:
                raise ValueError(f"durable_url {url!r} names no bucket")
        for name in ("ram_dir", "durable_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))  # a str is fine too
        for name in (
            "in_memory_checkpointing_freq",
            "s3_checkpointing_freq",
            "max_consecutive_save_failures",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("ckpt_threads_per_rank", "topk_ckpt", "ram_topk_ckpt"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        timeout = self.emergency_checkpoint_timeout_s
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not 0 < timeout < math.inf
        ):
            raise ValueError(f"emergency_checkpoint_timeout_s must be > 0, got {timeout!r}")
        durable_timeout = self.durable_timeout_s
        if (
            not isinstance(durable_timeout, int | float)
            or isinstance(durable_timeout, bool)
            or not 0 < durable_timeout < math.inf
        ):
            raise ValueError(f"durable_timeout_s must be > 0, got {durable_timeout!r}")
        minutes = self.multi_tier_checkpointing_backup_interval_minutes
        if (
            not isinstance(minutes, int | float)
            or isinstance(minutes, bool)
            or not 0 <= minutes < math.inf
        ):
            raise ValueError(
                f"multi_tier_checkpointing_backup_interval_minutes must be >= 0, got {minutes!r}"
            )
        ram, durable = self.in_memory_checkpointing_freq, self.s3_checkpointing_freq
        if minutes and not ram:
            raise ValueError(
                f"multi_tier_checkpointing_backup_interval_minutes={minutes} needs the RAM "
                "tier (in_memory_checkpointing_freq > 0): a durable save is a copy of a RAM "
                "save of the same step"
            )
        if minutes and self.durable_dir is None and self.durable_url is None:
            raise ValueError(
                f"multi_tier_checkpointing_backup_interval_minutes={minutes} needs "
                "durable_dir or durable_url"
            )
        if ram and durable and durable % ram:
            raise ValueError(
                f"s3_checkpointing_freq={durable} must be a multiple of "
                f"in_memory_checkpointing_freq={ram}: a durable save is a copy of the RAM "
                "save of the same step"
            )
        if durable and self.durable_dir is None and self.durable_url is None:
            raise ValueError(
                f"s3_checkpointing_freq={durable} needs durable_dir or durable_url (or set "
                "s3_checkpointing_freq=0 to run without a durable tier)"
            )
        if self.ram_dir is not None and self.durable_dir is not None:
            a, b = Path(self.ram_dir).resolve(), Path(self.durable_dir).resolve()
            if a == b or a in b.parents or b in a.parents:
                raise ValueError(
                    f"ram_dir={self.ram_dir} and durable_dir={self.durable_dir} overlap"
                )

    def ram_root(self, job: str | None) -> Path:
        if self.ram_dir is not None:
            return Path(self.ram_dir)
        return DEFAULT_RAM_ROOT / (job or "default")

    def durable_root(self) -> Path | None:
        return Path(self.durable_dir) if self.durable_dir is not None else None

    def with_changes(self, **changes: object) -> CheckpointSettings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, **overrides: object
    ) -> CheckpointSettings:
        """Each field from the upper-case variable of its name (`CHECKPOINT_RAM_DIR`,
        `CHECKPOINT_DURABLE_DIR` and `CHECKPOINT_DURABLE_URL`, or `S3_TIER_BASE_PATH`, for
        the tiers' places); `overrides` win over both."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for field in fields(cls):
            key = {
                "ram_dir": worker_env.CHECKPOINT_RAM_DIR,
                "durable_dir": worker_env.CHECKPOINT_DURABLE_DIR,
                "durable_url": worker_env.CHECKPOINT_DURABLE_URL,
            }.get(field.name, field.name.upper())
            raw = env.get(key)
            if field.name == "durable_url" and not raw:
                key, raw = "S3_TIER_BASE_PATH", env.get("S3_TIER_BASE_PATH")
            if raw is None or raw == "":
                continue
            if field.name in ("ram_dir", "durable_dir"):
                values[field.name] = Path(raw)
            elif field.name == "durable_url":
                values[field.name] = raw
            elif field.type in ("bool", bool):
                if raw.lower() not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                    raise ValueError(f"{key} must be a boolean (true/false), got {raw!r}")
                values[field.name] = raw.lower() in {"1", "true", "yes", "on"}
            elif field.type in ("float", float):
                try:
                    values[field.name] = float(raw)
                except ValueError:
                    raise ValueError(f"{key} must be a number, got {raw!r}") from None
            else:
                try:
                    values[field.name] = int(raw)
                except ValueError:
                    raise ValueError(f"{key} must be an integer, got {raw!r}") from None
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
