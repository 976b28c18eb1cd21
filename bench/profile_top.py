"""The top of a py-spy profile: `python -m bench.profile_top FILE [N]`.

Reads py-spy's collapsed stacks (`py-spy record --format raw`: one line per distinct
stack, `frame;frame;... count`) and prints the functions holding the most samples: self
(the innermost frame) and total (anywhere on the stack), as percentages of all samples.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path


def top(path: Path, n: int = 15) -> str:
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            anywhere[frame] += count
    if not total:
        return f"{path}: no samples"
    lines = [f"{path.name}: {total} samples", "  self%  total%  function"]
    for frame, count in own.most_common(n):
        lines.append(f"  {100 * count / total:5.1f}  {100 * anywhere[frame] / total:6.1f}  {frame}")
    lines.append("  by total (anywhere on the stack):")
    for frame, count in anywhere.most_common(n):
        lines.append(f"  {100 * own[frame] / total:5.1f}  {100 * count / total:6.1f}  {frame}")
    return "\n".join(lines)


def _short(frame: str) -> str:
    """`function (path/to/module.py:line)` as `function (module.py)`: lines split the
    same function into many rows."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0].rsplit("/", 2)
    return f"{name} ({'/'.join(file[-2:])})" if where else name


if __name__ == "__main__":
    print(top(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 15))
