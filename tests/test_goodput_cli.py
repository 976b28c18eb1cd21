"""`supervisor goodput` and `supervisor advise` run as a user would, as processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LOG = """\
{"event_type": "user_scheduled", "timestamp": 0}
{"event_type": "job_started", "timestamp": 10}
{"event_type": "checkpoint_loaded", "timestamp": 20, "step": 0}
{"event_type": "checkpoint_saved", "timestamp": 120, "step": 100}
{"event_type": "job_terminated", "timestamp": 150}
{"event_type": "job_started", "timestamp": 200}
{"event_type": "checkpoint_loaded", "timestamp": 210, "step": 100}
{"event_type": "checkpoint_saved", "timestamp": 310, "step": 200}
{"event_type": "user_terminated", "timestamp": 320}
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_goodput_of_an_calculator_log(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text(LOG)
    table = cli("goodput", str(log), "--reference-step-time-s", "1")
    assert table.returncode == 0, table.stderr
    # The calculator's formula: (max saved 200 - min loaded 0) x 1 s / (320 s - 0 s) = 62.5 %
    assert "The calculator's goodput: 62.50%" in table.stdout
    data = json.loads(cli("goodput", str(log), "--reference-step-time-s", "1", "--json").stdout)
    assert data["calculator"]["goodput_percent"] == 62.5
    # Our breakdown covers the whole wall time: 320 s.
    assert data["wall_s"] == 320


def test_goodput_errors_are_one_line(tmp_path: Path) -> None:
    log = tmp_path / "bad.jsonl"
    log.write_text('{"event_type": "job_started", "timestamp": "noon"}\n')
    result = cli("goodput", str(log))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 1" in lines[0] and "timestamp" in lines[0]


def test_advise(tmp_path: Path) -> None:
    result = cli(
        "advise",
        "--step-time-s",
        "2",
        "--mtbf-s",
        "86400",
        "--local-save-s",
        "5",
        "--local-every",
        "10",
        "--durable-save-s",
        "60",
        "--durable-every",
        "25",
        "--durable-mtbf-s",
        "259200",
        "--parameters",
        "70e9",
        "--hosts",
        "16",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    # 70e9 params x 12 B / 16 hosts x 2 x 1.15 = 120,750,000,000 B (GKE's rule)
    assert data["ramdisk"]["size_bytes"] == 120_750_000_000
    assert any("multiple" in w for w in data["advice"]["warnings"])
    bad = cli(
        "advise",
        "--step-time-s",
        "2",
        "--mtbf-s",
        "86400",
        "--local-save-s",
        "5",
        "--parameters",
        "1e9",
    )
    assert bad.returncode == 1 and "--hosts" in bad.stderr
