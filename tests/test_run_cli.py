"""`supervisor run` as a torchrun user runs it: the real command as a subprocess, real host
monitors, real workers. Each worker gets torchrun's environment, its output comes back
behind its rank, the exit code is the job's, and what cannot work is refused in one line
before anything starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.local import bootstrap
from supervisor.local.demo import leftover_processes
from supervisor.local.run_folder import MARKER, RunFolderError, check, claim
from tests.test_run_user_job import user_env

ENV_SCRIPT = """\
import os, sys
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"]
print(" ".join(f"{n}={os.environ.get(n)}" for n in names), "args", *sys.argv[1:], flush=True)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def supervisor_run(
    tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "supervisor.cli", "run", "--run-dir", str(tmp / "run"), *args],
            env=user_env(tmp, **(env or {})),
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        # What it printed, and the end of its supervisor's log: why it did not end.
        printed = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        log = tmp / "run" / "logs" / "supervisor.log"
        tail = log.read_text().splitlines()[-40:] if log.exists() else []
        for pid in leftover_processes((tmp / "run").resolve()):  # its killed command's
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError("\n".join([printed, "supervisor.log:", *tail])) from exc
    assert not leftover_processes((tmp / "run").resolve()), "a process of the run is left"
    return done


def rank_lines(stdout: str) -> dict[int, list[dict[str, str]]]:
    """Each rank's environment lines, in the order printed."""
    found: dict[int, list[dict[str, str]]] = {}
    for line in stdout.splitlines():
        match = re.match(r"\[rank(\d+)\]: (RANK=.*)", line)
        if match:
            pairs = dict(p.split("=", 1) for p in match.group(2).split(" args")[0].split())
            found.setdefault(int(match.group(1)), []).append(pairs)
    return found


def test_each_worker_gets_torchruns_environment_and_its_output_its_rank(tmp_path: Path) -> None:
    (tmp_path / "show_env.py").write_text(ENV_SCRIPT)
    done = supervisor_run(
        tmp_path, "--nnodes", "2", "--nproc-per-node", "2", "show_env.py", "--lr", "0.1"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = rank_lines(done.stdout)
    assert sorted(ranks) == [0, 1, 2, 3]
    ports = set()
    for rank, [env] in ranks.items():
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_RANK"] == str(rank // 2)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert (env["MASTER_ADDR"], env["TORCHELASTIC_RESTART_COUNT"]) == ("127.0.0.1", "0")
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1
    assert done.stdout.count("args --lr 0.1") == 4  # the script's own arguments
    assert "exit code 0" in done.stdout.splitlines()[-1]


def test_a_torchrun_command_line_runs_with_torchrun_replaced(tmp_path: Path) -> None:
    """PyTorch's own examples, `torchrun` replaced by `supervisor run`: the rendezvous
    flags accepted (a line says they are not used), the job named by --rdzv-id, MIN:MAX
    nodes, the underscore spellings, only the filtered ranks on the terminal."""
    (tmp_path / "show_env.py").write_text(ENV_SCRIPT)
    done = supervisor_run(
        tmp_path,
        "--nnodes=1:2",
        "--nproc_per_node=2",
        "--max_restarts=3",
        "--rdzv-id=llama",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:29400",
        "--local-ranks-filter=0,3",
        "show_env.py",
        "--lr",
        "0.1",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = rank_lines(done.stdout)
    assert sorted(ranks) == [0, 3]  # ranks 1 and 2 ran too, their output in their logs
    assert {env["WORLD_SIZE"] for [env] in ranks.values()} == {"4"}  # MAX nodes x 2
    logs = sorted(p.name for p in (tmp_path / "run" / "nodes").glob("*/*.rank*.log"))
    assert [name.split(".", 1)[1] for name in logs] == [f"llama.rank{r}.log" for r in range(4)]
    said = "supervisor run: --rdzv-backend c10d: not used, the supervisor forms each world"
    assert said in done.stdout.splitlines()
    # --standalone, as PyTorch's single-node example gives it.
    done = supervisor_run(tmp_path, "--standalone", "--nproc-per-node=2", "show_env.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(rank_lines(done.stdout)) == [0, 1]


def test_a_job_whose_workers_say_they_finished_ends_with_exit_code_0(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "from training.worker_client import WorkerClient\n"
        "client = WorkerClient.from_env()\n"
        "assert client.register(), 'no host monitor'\n"
        "client.report_step(1)\n"
        "client.finished()  # its exit is a stop on purpose: `stopped`, exit code 0\n"
        "client.close()\n"
        "print('done', flush=True)\n"
    )
    done = supervisor_run(tmp_path, "--nnodes", "2", "train.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank0]: done" in done.stdout and "[rank1]: done" in done.stdout
    assert done.stdout.splitlines()[-1] == (
        "supervisor run: every rank of the job (2) ended with exit code 0; exit code 0"
    )


def test_a_failing_job_is_restarted_on_a_fresh_port_then_exits_with_its_code(
    tmp_path: Path,
) -> None:
    (tmp_path / "show_env.py").write_text(ENV_SCRIPT)
    done = supervisor_run(
        tmp_path,
        "--nnodes",
        "2",
        "--max-restarts",
        "2",
        "--",
        sys.executable,
        "show_env.py",
        env={"EXIT_CODE": "3"},
    )
    assert done.returncode == 3, done.stdout + done.stderr
    for lines in rank_lines(done.stdout).values():
        # Started, restarted twice (the budget), each attempt in a world of its own.
        assert [env["TORCHELASTIC_RESTART_COUNT"] for env in lines] == ["0", "1", "2"]
        assert len({env["MASTER_PORT"] for env in lines}) == 3
    assert "[supervisor]: restart_in_place" in done.stdout
    # The script does not register (no worker client): nothing to save, said at once,
    # naming the nodes and the ranks looked at.
    assert re.search(
        r"\[supervisor\]: emergency_checkpoint failed: no worker of job \S+ on node-\d \(.+\) "
        r"is registered with its host monitor: nothing to save",
        done.stdout,
    ), done.stdout
    assert "gave up on the job" in done.stdout


def test_a_usage_error_is_not_restarted(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse\n"
        "print('started', flush=True)\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--lr', type=float, required=True)\n"
        "parser.parse_args()\n"
    )
    done = supervisor_run(tmp_path, "--nnodes", "2", str(script), "--lr")
    assert done.returncode == 2, done.stdout + done.stderr
    started = [line for line in done.stdout.splitlines() if line.endswith("]: started")]
    assert sorted(started) == ["[rank0]: started", "[rank1]: started"]  # never again
    assert "[rank0]: usage: train.py [-h] --lr LR" in done.stdout
    reason = "exited with code 2 (a usage error: bad arguments or settings) before the job's"
    assert reason in done.stdout


def test_what_cannot_run_is_refused_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    refusals = {
        ("--", "no-such-command-here"): "supervisor run: command not found: no-such-command-here",
        ("missing.py",): "supervisor run: no such script: missing.py",
        ("-m", "no_such_module_here"): "supervisor run: no module named 'no_such_module_here'",
        ("-m", "no_such_package.train"): "supervisor run: no module named 'no_such_package.train'",
        ("--nproc-per-node", "0", "--", "true"): "supervisor run: --nproc-per-node must be at "
        "least 1, got 0",
        (): "supervisor run: no command: supervisor run [OPTIONS] -- COMMAND...",
    }
    for args, message in refusals.items():
        done = supervisor_run(tmp_path, *args, timeout=30)
        assert done.returncode == 1
        assert done.stderr.strip() == message
        assert not (tmp_path / "run").exists(), "nothing started"


def test_a_command_given_by_its_path_runs_as_given_not_through_symlinks(tmp_path: Path) -> None:
    """A virtual environment's `python` is a symlink to the base interpreter: followed, the
    workers would run outside the environment (without its packages)."""
    if not Path(sys.executable).is_symlink():
        pytest.skip("needs a virtual environment's python (a symlink), as make test makes")
    script = tmp_path / "prefix.py"
    script.write_text("import sys\nprint('prefix', sys.prefix, flush=True)\n")
    done = supervisor_run(tmp_path, "--", sys.executable, str(script), timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"prefix {sys.prefix}" in done.stdout, done.stdout


# --- the run folder: never a file of the user's ---------------------------------------------

QUICK = ("--", sys.executable, "-c", "print('quick', flush=True)")


def test_a_folder_with_a_file_of_the_users_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    notes = tmp_path / "run" / "notes.txt"
    notes.write_text("mine")
    done = supervisor_run(tmp_path, *QUICK, timeout=30)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"supervisor run: --run-dir {(tmp_path / 'run').resolve()} is not empty and not a "
        f"previous run's folder (no {MARKER} in it); a run empties its folder, so give a new "
        "or empty one"
    )
    assert done.stdout == "", "refused before anything starts"
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]
    assert notes.read_text() == "mine"


def test_a_run_empties_and_reuses_the_folder_of_a_previous_run(tmp_path: Path) -> None:
    """The folder as a first run left it (its marker, its logs; made here, as that run
    makes it: a second real run would double the test's time)."""
    folder = tmp_path / "run"
    claim(folder).close()
    (folder / "logs").mkdir()
    (folder / "logs" / "supervisor.log").write_text("the first run's\n")
    done = supervisor_run(tmp_path, *QUICK, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank0]: quick" in done.stdout
    assert f"supervisor run: run folder {folder.resolve()}\n" in done.stdout
    assert (folder / MARKER).is_file()
    assert "the first run's" not in (folder / "logs" / "supervisor.log").read_text()


def test_the_default_folder_is_in_the_users_state_folder_and_printed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "run", *QUICK],
        env=user_env(tmp_path, XDG_STATE_HOME=str(state)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    folder = (state / "resiliency-supervisor" / "run").resolve()
    assert not leftover_processes(folder), "a process of the run is left"
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"supervisor run: run folder {folder}\n" in done.stdout
    assert (folder / MARKER).is_file() and (folder / "logs").is_dir()
    assert not (tmp_path / "var").exists(), "nothing in the current folder"


def test_a_folder_in_use_by_a_run_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    held = claim(folder)
    try:
        with pytest.raises(RunFolderError, match="is in use by another run"):
            check(folder)
        with pytest.raises(RunFolderError, match="is in use by another run"):
            claim(folder)
    finally:
        held.close()
    claim(folder).close()  # once that run ended


def test_bootstrap_refuses_a_folder_whose_output_is_not_a_previous_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = tmp_path / "output" / "weights.bin"
    kept.parent.mkdir()
    kept.write_bytes(b"mine")
    monkeypatch.setenv(bootstrap.TOKEN_ENV, "token")
    with pytest.raises(SystemExit, match=r"--run-dir .* holds output that no bootstrap wrote"):
        bootstrap.main(
            [
                *("--run-dir", str(tmp_path), "--node", "a=http://127.0.0.1:1"),
                *("--wait-s", "1", "--replicas", "1", "--nodes-per-dp", "1"),
            ]
        )
    assert kept.read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["output"]
