"""The workers' output on the launcher's terminal, each line behind its rank, as
`torchrun --tee 3` shows it (`[rank1]: loss 0.25`).

The host monitors write each worker's output to a file of their run directory
(`<node>.<job>.rank<rank>.log`, appended across restarts, a header line per start); the
tee follows every such file of the job, whichever node a rank runs on now.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TextIO

#: The header line the host monitor writes before each start of a worker.
START_HEADER = b"=== host-monitor: start "


class RankTee:
    """Follows the job's worker logs under `nodes_dir` (one directory per node); `pump`
    copies what is new, whole lines only, to `out`."""

    def __init__(
        self,
        nodes_dir: Path,
        job: str,
        out: TextIO = sys.stdout,
        ranks: frozenset[int] | None = None,
    ) -> None:
        """`ranks`: the ranks whose lines are copied (None: every rank's)."""
        self.nodes_dir = nodes_dir
        self.out = out
        self._ranks = ranks
        self._name = re.compile(rf"\.{re.escape(job)}\.rank(\d+)\.log$")
        self._job = job
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def pump(self, *, final: bool = False) -> None:
        """Copy the new whole lines of every log (and, when `final`, what is left of an
        unfinished last line)."""
        for path in sorted(self.nodes_dir.glob(f"*/*.{self._job}.rank*.log")):
            match = self._name.search(path.name)
            if match is None:
                continue
            rank = int(match.group(1))
            if self._ranks is None or rank in self._ranks:
                self._copy(path, rank, final)
        self.out.flush()

    def _copy(self, path: Path, rank: int, final: bool) -> None:
        offset = self._offsets.get(path, 0)
        try:
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return
        self._offsets[path] = offset + len(data)
        data = self._partial.pop(path, b"") + data
        lines = data.split(b"\n")
        rest = lines.pop()
        if rest and final:
            lines.append(rest)
        elif rest:
            self._partial[path] = rest
        prefix = f"[rank{rank}]:"
        for line in lines:
            if line.startswith(START_HEADER):
                continue
            text = line.decode(errors="replace")
            # torch.distributed prefixes a rank's error output itself: one prefix, not two.
            self.out.write(f"{text}\n" if text.startswith(prefix) else f"{prefix} {text}\n")
