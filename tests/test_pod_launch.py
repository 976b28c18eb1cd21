"""`python -m training.pod_launch`: the ranks of one pod, run as real processes. Each rank
gets torchrun's environment for its place in the job; a failed rank ends the pod's other
ranks and the pod with its exit code; SIGTERM reaches every rank; bad flags are refused
before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRINT_ENV = (
    'echo "$RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $WORLD_SIZE'
    ' $TORCHELASTIC_RESTART_COUNT $MASTER_PORT"'
)


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "training.pod_launch", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_each_rank_gets_torchruns_environment_for_its_place_in_the_job() -> None:
    # Node 1 of 3 (from the environment, as the example JobSet sets them), 2 ranks a pod.
    proc = launch(
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        PRINT_ENV,
        env={"GROUP_RANK": "1", "NNODES": "3", "MASTER_PORT": "29511"},
    )
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert sorted(out.splitlines()) == ["2 0 2 1 6 0 29511", "3 1 2 1 6 0 29511"]
    # Flags win over the environment.
    flags = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0"]
    env = {"GROUP_RANK": "1", "NNODES": "3", "MASTER_PORT": "1"}
    proc = launch(*flags, "--", "sh", "-c", PRINT_ENV, env=env)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out.strip()) == (0, "0 0 1 0 2 0 1"), err


def test_a_failed_rank_ends_the_pods_other_ranks_and_the_pod_with_its_exit_code(
    tmp_path: Path,
) -> None:
    pids = tmp_path / "pids"
    script = (
        f'echo $$ >> {pids}; if [ "$LOCAL_RANK" = 1 ]; then sleep 0.5; exit 7; fi; exec sleep 60'
    )
    started = time.monotonic()
    proc = launch("--nproc-per-node", "3", "--", "sh", "-c", script)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 7, err
    assert time.monotonic() - started < 20  # the sleepers were stopped, not waited for
    assert "rank 1 (pid " in err and "exited 7; stopping the pod's other ranks" in err
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # A usage error (exit code 2, which the example's podFailurePolicy fails the Job on)
    # comes through as it is.
    proc = launch("--nproc-per-node", "2", "--", "sh", "-c", 'exit "$((LOCAL_RANK * 2))"')
    proc.communicate(timeout=30)
    assert proc.returncode == 2


def test_sigterm_reaches_every_rank_and_the_pod_ends_when_they_do(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    script = (
        f"trap 'touch {marks}/$RANK; exit 0' TERM; touch {marks}/up-$RANK;"
        " while true; do sleep 0.1; done"
    )
    proc = launch("--nproc-per-node", "2", "--", "sh", "-c", script)
    deadline = time.monotonic() + 20
    while len(list(marks.glob("up-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in marks.iterdir()) == ["0", "1", "up-0", "up-1"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nproc-per-node", "0", "--", "true"], "--nproc-per-node must be at least 1"),
        (["--nnodes", "2", "--node-rank", "2", "--", "true"], "--node-rank 2 is not a node"),
        (["--", "no-such-command-here"], "command not found: no-such-command-here"),
        (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    ],
)
def test_bad_flags_are_refused_in_one_line_before_anything_starts(
    args: list[str], says: str
) -> None:
    proc = launch(*args)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert says in err


def test_a_launcher_killed_outright_takes_its_ranks_with_it(tmp_path: Path) -> None:
    """Outside a container nothing else would end them: a rank of a SIGKILLed launcher
    must not train on unsupervised."""
    pids = tmp_path / "pids"
    proc = launch("--nproc-per-node", "2", "--", "sh", "-c", f"echo $$ >> {pids}; exec sleep 60")
    deadline = time.monotonic() + 20
    while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [int(pid) for pid in pids.read_text().split()]
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = []
        for pid in ranks:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            break
        time.sleep(0.05)
    assert not alive, f"ranks {alive} outlived their launcher"
