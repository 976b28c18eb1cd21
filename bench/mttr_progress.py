"""The job's progress and its workers' resume and stop lines, as `bench.mttr` reads them
(its module docstring says from where and why)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from resiliency_protocol.checkpoint_reports import Tier

START = re.compile(r"start attempt=(\d+) world_size=(\d+)")
STEP_LINE = re.compile(r" step=(\d+)/\d+ ")
RESUMED = re.compile(r"resumed step=(\d+) tier=(\w+)")
FROM_ZERO = re.compile(r"starting from step=0")
TERMINATED = re.compile(r"terminated by \w+ at step=(\d+)")
STEP_DIR = re.compile(r"step-(\d+)$")
TIER_ORDER = (Tier.EMERGENCY, Tier.LOCAL, Tier.DURABLE, "none")


def _tier_rank(tier: str) -> int:
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


class Stuck(Exception):
    """The cluster did not get back to a healthy, training state in time."""


# --- the job's own progress ----------------------------------------------------------------


def _attempts(run_dir: Path) -> list[int]:
    try:
        names = [p.name for p in (run_dir / "job" / "collective").iterdir()]
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def _step_dirs(run_dir: Path, attempt: int) -> dict[int, Path]:
    root = run_dir / "job" / "collective" / str(attempt)
    out = {}
    try:
        for entry in root.iterdir():
            m = STEP_DIR.match(entry.name)
            if m:
                out[int(m[1])] = entry
    except OSError:
        pass
    return out


def _ranks_in(directory: Path) -> int:
    try:
        return sum(1 for n in directory.iterdir() if n.name.endswith(".bin") and n.name[0] != ".")
    except OSError:
        return 0


def current_step(run_dir: Path) -> tuple[int, int]:
    """(newest attempt, highest step a rank of it finished); step -1 before any."""
    attempts = _attempts(run_dir)
    if not attempts:
        return -1, -1
    steps = _step_dirs(run_dir, attempts[-1])
    return attempts[-1], max(steps, default=-1)


def progressed_past(run_dir: Path, attempt: int, step: int, world: int) -> bool:
    """Whether `attempt` finished step `step` + 1."""
    dirs = _step_dirs(run_dir, attempt)
    if any(s > step for s in dirs):
        return True
    return step in dirs and _ranks_in(dirs[step]) >= world


def read_lines(path: Path, offset: int) -> tuple[int, list[str]] | None:
    """The complete lines of `path` from `offset` on, and the offset after them; None
    when it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return None
    complete = data.rfind(b"\n") + 1
    return offset + complete, data[:complete].decode(errors="replace").splitlines()


class CollectiveProgress:
    """The NumPy job's progress, from its all-reduce barrier files."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def current(self) -> tuple[int, int]:
        return current_step(self.run_dir)

    def progressed_past(self, attempt: int, step: int, world: int) -> bool:
        return progressed_past(self.run_dir, attempt, step, world)

    def newest_step(self, attempt: int) -> int | None:
        return None  # read from the survivors' `terminated by` lines instead

    def attempts(self) -> list[int]:
        return _attempts(self.run_dir)


class LogProgress:
    """The torch job's progress, from its workers' log lines (one per step), tailed."""

    def __init__(self, run_dir: Path, job: str) -> None:
        self.run_dir = run_dir
        self.pattern = f"*.{job}.rank*.log"
        self.offsets: dict[Path, int] = {}
        self.attempt_of: dict[Path, int] = {}
        self.steps: dict[int, int] = {}  # attempt -> newest step any rank logged

    def _read(self) -> None:
        for path in sorted((self.run_dir / "nodes").glob(f"*/{self.pattern}")):
            lines = read_lines(path, self.offsets.get(path, 0))
            if lines is None:
                continue
            self.offsets[path], text = lines
            for line in text:
                if m := START.search(line):
                    self.attempt_of[path] = int(m[1])
                    self.steps.setdefault(int(m[1]), -1)
                elif (m := STEP_LINE.search(line)) and path in self.attempt_of:
                    attempt = self.attempt_of[path]
                    self.steps[attempt] = max(self.steps[attempt], int(m[1]))

    def current(self) -> tuple[int, int]:
        self._read()
        if not self.steps:
            return -1, -1
        attempt = max(self.steps)
        return attempt, self.steps[attempt]

    def progressed_past(self, attempt: int, step: int, world: int) -> bool:
        self._read()
        return self.steps.get(attempt, -1) > step

    def newest_step(self, attempt: int) -> int | None:
        self._read()
        step = self.steps.get(attempt)
        return None if step is None or step < 0 else step

    def attempts(self) -> list[int]:
        self._read()
        return sorted(self.steps)


# --- worker logs -----------------------------------------------------------------------------


class WorkerLogs:
    """What the workers wrote since `mark()`: one file per node, job and rank."""

    def __init__(self, run_dir: Path, job: str) -> None:
        self.run_dir = run_dir
        self.pattern = f"*.{job}.rank*.log"
        self.offsets: dict[Path, int] = {}

    def _files(self) -> list[Path]:
        return sorted((self.run_dir / "nodes").glob(f"*/{self.pattern}"))

    def mark(self) -> None:
        self.offsets = {}
        for path in self._files():
            with contextlib.suppress(OSError):
                self.offsets[path] = path.stat().st_size

    def since_mark(self) -> Iterator[list[str]]:
        for path in self._files():
            lines = read_lines(path, self.offsets.get(path, 0))
            if lines is not None:
                yield lines[1]

    def parse(self) -> tuple[dict[int, tuple[int, str, int]], list[int]]:
        """({attempt: (resume step, tier, world size)}, steps the old attempt's workers
        were stopped at)."""
        resumed: dict[int, tuple[int, str, int]] = {}
        terminated: list[int] = []
        for lines in self.since_mark():
            attempt: int | None = None
            world = 0
            for line in lines:
                if m := START.search(line):
                    attempt, world = int(m[1]), int(m[2])
                if (m := RESUMED.search(line)) and attempt is not None:
                    step, tier = int(m[1]), m[2]
                    # Ranks load the agreed step from whichever tier they hold it in
                    # (a fresh spare has no local tier): name every tier used.
                    if attempt in resumed:
                        if resumed[attempt][0] != step:
                            raise Stuck(f"ranks of attempt {attempt} resumed from different steps")
                        used = {tier, *resumed[attempt][1].split("+")}
                        tier = "+".join(sorted(used, key=_tier_rank))
                    resumed[attempt] = (step, tier, world)
                elif FROM_ZERO.search(line) and attempt is not None:
                    resumed[attempt] = (0, "none", world)
                elif (m := TERMINATED.search(line)) and attempt is None:
                    terminated.append(int(m[1]))
        return resumed, terminated
