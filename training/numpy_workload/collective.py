"""Collectives over a shared directory: an all-reduce per step and an all-gather.

Layout: `<root>/step-<s:08d>/rank-<r>.bin` (one gradient per rank and step, raw float64)
and `<root>/<name>/rank-<r>.json` for all-gathers; `<root>` is
`RUN_DIR/collective/<WORKLOAD_ATTEMPT>`, so a restarted job never reads a previous
attempt's files. Every file is written under a hidden temporary name and renamed, so a
file that exists is complete.

Each collective is also a barrier across all ranks: a rank waits until every rank wrote
its file. If a peer died, the others wait - like a real NCCL collective hangs - calling
`poll` on every iteration (the training loop serves emergency checkpoints and SIGTERM
there), until `timeout_s` passes and `CollectiveTimeout` is raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from training.errors import TrainingError
from training.numpy_workload.model import Vector, mean_in_order

POLL_FIRST_S = 0.002
POLL_MAX_S = 0.010
POLL_BACKOFF = 1.5
KEEP_STEP_DIRS = 2


class CollectiveTimeout(TrainingError):
    """A collective waited longer than its timeout (a peer is gone or stuck)."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class FileCollective:
    def __init__(
        self,
        root: Path,
        rank: int,
        world_size: int,
        *,
        timeout_s: float,
        poll: Callable[[], None] = lambda: None,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.poll = poll

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    # --- collectives -----------------------------------------------------------------

    def all_gather(self, name: str, value: Any) -> list[Any]:
        """Every rank's JSON-serialisable `value`, in rank order."""
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(directory / f"rank-{self.rank}.json", json.dumps(value).encode())
        names = [f"rank-{r}.json" for r in range(self.world_size)]
        self._wait(directory, names)
        return [json.loads((directory / n).read_bytes()) for n in names]

    def all_reduce_mean(self, step: int, grad: Vector, group: Sequence[int]) -> Vector:
        """Mean of the gradients of the ranks in `group`, summed in `group` order.

        Waits for the files of ALL ranks (the step's barrier), not only the group's.
        """
        directory = self.step_dir(step)
        directory.mkdir(parents=True, exist_ok=True)
        data = np.ascontiguousarray(grad, dtype=np.float64)
        _write_atomic(directory / f"rank-{self.rank}.bin", data.tobytes())
        self._wait(directory, [f"rank-{r}.bin" for r in range(self.world_size)])
        grads: list[Vector] = []
        for r in group:
            raw = (directory / f"rank-{r}.bin").read_bytes()
            if len(raw) != data.nbytes:
                raise RuntimeError(
                    f"rank {r} sent {len(raw)} bytes at step {step}, not {data.nbytes}"
                )
            grads.append(np.frombuffer(raw, dtype=np.float64).copy())
        self._forget(step - KEEP_STEP_DIRS)
        return mean_in_order(grads)

    # --- internals -------------------------------------------------------------------

    def _wait(self, directory: Path, names: Sequence[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = POLL_FIRST_S
        wanted = set(names)
        while True:
            try:
                present = set(os.listdir(directory))
            except FileNotFoundError:
                present = set()
            if wanted <= present:
                return
            self.poll()
            if time.monotonic() > deadline:
                missing = sorted(wanted - present)
                raise CollectiveTimeout(
                    f"waited {self.timeout_s:g}s in {directory.name} for {', '.join(missing)}"
                )
            time.sleep(delay)
            delay = min(delay * POLL_BACKOFF, POLL_MAX_S)

    def _forget(self, step: int) -> None:
        """Delete this rank's file of an old step; the last rank out removes the dir.

        Safe once this rank passed a later step's barrier: every rank then finished
        reading the older step.
        """
        if step < 0:
            return
        directory = self.step_dir(step)
        with contextlib.suppress(OSError):
            (directory / f"rank-{self.rank}.bin").unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()  # fails while other ranks' files are still there

    def remove_older_attempts(self) -> None:
        """Best effort: delete the collective directories of earlier (numeric) attempts."""
        try:
            current = int(self.root.name)
        except ValueError:
            return
        with contextlib.suppress(OSError):
            for entry in self.root.parent.iterdir():
                if entry.name.isdigit() and int(entry.name) < current:
                    shutil.rmtree(entry, ignore_errors=True)
