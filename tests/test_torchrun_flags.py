"""torchrun's flags as `supervisor run` parses them (supervisor/torchrun_flags.py): each
accepted, mapped onto the local cluster, or refused in one line naming the flag and what
to use instead. The commands themselves run in tests/test_run_cli.py."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import pytest

from supervisor.run_cli import add_commands
from supervisor.torchrun_flags import FlagRefused, TorchrunFlags, flags_of


def parsed(*argv: str, gpus: int | None = None) -> TorchrunFlags:
    parser = argparse.ArgumentParser(prog="supervisor")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", *argv, "train.py"])
    found: Callable[[], int | None] = lambda: gpus  # noqa: E731
    return flags_of(args, gpus=found)


def test_the_defaults_are_torchruns() -> None:
    flags = parsed()
    assert (flags.nnodes, flags.min_nnodes, flags.nproc_per_node) == (1, 1, 1)
    assert flags.shown_ranks is None and flags.notes == [] and not flags.no_python


def test_both_spellings_of_each_flag() -> None:
    dashes = parsed("--nproc-per-node", "2", "--rdzv-id", "a", "--local-ranks-filter", "0")
    underscores = parsed("--nproc_per_node=2", "--rdzv_id=a", "--local_ranks_filter=0")
    assert dashes == underscores
    assert (dashes.nproc_per_node, dashes.rdzv_id, dashes.shown_ranks) == (2, "a", {0})


@pytest.mark.parametrize(
    ("value", "gpus", "workers"),
    [
        ("4", None, 4),  # no NVML: a CPU job, any number
        ("4", 8, 4),
        ("gpu", 8, 8),
        ("auto", 8, 8),
        ("auto", None, os.cpu_count() or 1),
        ("cpu", 8, os.cpu_count() or 1),
    ],
)
def test_workers_per_node(value: str, gpus: int | None, workers: int) -> None:
    assert parsed("--nproc-per-node", value, gpus=gpus).nproc_per_node == workers


def test_min_max_nodes_start_max_and_may_shrink_to_min() -> None:
    flags = parsed("--nnodes", "2:4")
    assert (flags.nnodes, flags.min_nnodes) == (4, 2)


def test_the_rendezvous_flags_are_accepted_and_said_unused() -> None:
    flags = parsed(
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400", "--rdzv-id", "llama"
    )
    assert flags.rdzv_id == "llama"
    assert [n.split(":")[0] for n in flags.notes] == [
        "--rdzv-backend c10d",
        "--rdzv-endpoint localhost",
    ]
    # --standalone: as torchrun, the rendezvous flags given beside it are ignored.
    alone = parsed("--standalone", "--rdzv-backend", "c10d", "--rdzv-id", "llama")
    assert alone.notes == [] and alone.rdzv_id is None


def test_the_terminal_shows_the_ranks_asked_for() -> None:
    assert parsed("--local-ranks-filter", "0,2").shown_ranks == {0, 2}
    assert parsed("--redirects", "3").shown_ranks == frozenset()  # files only
    assert parsed("--redirects", "3", "--tee", "3").shown_ranks is None
    assert parsed("--monitor-interval", "0.5").monitor_interval_s == 0.5
    assert parsed("--no-python").no_python


@pytest.mark.parametrize(
    ("argv", "gpus", "says"),
    [
        (["--nproc-per-node", "9"], 8, "--nproc-per-node 9: this machine has 8 GPU(s) (NVML)"),
        (["--nproc-per-node", "gpu"], None, "--nproc-per-node gpu: no GPU found (NVML)"),
        (["--nproc-per-node", "0"], None, "--nproc-per-node must be at least 1"),
        (["--nproc-per-node", "xpu"], None, "--nproc-per-node xpu: XPUs are not supported"),
        (["--nnodes", "3:2"], None, "--nnodes '3:2': expected 1 <= MIN <= MAX"),
        (["--nnodes", "two"], None, "--nnodes 'two': expected N or MIN:MAX"),
        (["--node-rank", "1"], None, "--node-rank 1: every node of the job runs on this"),
        (["--master-addr", "10.1.2.3"], None, "--master-addr 10.1.2.3: every rank runs on"),
        (["--rdzv-endpoint", "head:29400"], None, "--rdzv-endpoint head:29400: every rank"),
        (["--rdzv-id", "a b"], None, "--rdzv-id 'a b': the job's name"),
        (["--log-dir", "logs"], None, "--log-dir logs: each rank's output is in the run folder"),
        (["--redirects", "0:3,1:0"], None, "--redirects '0:3,1:0': per-rank settings"),
        (["--tee", "4"], None, "--tee '4': expected 0 (none)"),
        (["--local-ranks-filter", "x"], None, "--local-ranks-filter 'x': expected ranks"),
        (["--monitor-interval", "2"], None, "--monitor-interval 2: must be more than 0 and less"),
    ],
)
def test_what_cannot_work_here_is_refused_naming_the_flag(
    argv: list[str], gpus: int | None, says: str
) -> None:
    with pytest.raises(FlagRefused) as refused:
        parsed(*argv, gpus=gpus)
    assert str(refused.value).startswith(says), str(refused.value)
