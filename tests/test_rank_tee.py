"""The workers' output behind its rank, once: a line torch.distributed already prefixed
with the rank (its error output) is not prefixed again."""

from __future__ import annotations

import io
from pathlib import Path

from supervisor.local.tee import START_HEADER, RankTee


def test_each_line_shows_its_rank_once(tmp_path: Path) -> None:
    node = tmp_path / "node-0"
    node.mkdir()
    log = node / "node-0.job.rank1.log"
    log.write_bytes(
        START_HEADER + b"1\n"
        b"loss 0.25\n"
        b"[rank1]: Traceback (most recent call last):\n"
        b"[rank10]: not this rank's prefix\n"
        b"unfinished"
    )
    out = io.StringIO()
    tee = RankTee(tmp_path, "job", out)
    tee.pump()
    assert out.getvalue().splitlines() == [
        "[rank1]: loss 0.25",
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: [rank10]: not this rank's prefix",
    ]
    tee.pump(final=True)
    assert out.getvalue().splitlines()[-1] == "[rank1]: unfinished"
