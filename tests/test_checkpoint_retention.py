"""Checkpoint retention: an emergency save never pushes out a periodic step.

With a sharded state, the rank that failed could not save the survivors' emergency step:
the step every rank can restore is the last periodic one, which each survivor must still
hold when the replacement asks for it, in RAM and in durable storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from training.checkpoint import format as fmt
from training.checkpoint.format import beyond_retention

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("steps", "keep", "aside", "removed"),
    [
        ([5, 10, 15], 2, [], [5]),
        ([10, 15, 19, 20], 2, [19], [10]),  # 19 is an emergency save: 15 stays
        ([10, 12, 20], 2, [12], []),  # newer than the oldest kept (10)
        ([10, 12, 20, 30], 2, [12], [10, 12]),  # older than it now
        ([19], 1, [19], []),  # an emergency step alone is all there is
        ([5, 19, 20], 1, [19], [5, 19]),
        ([5, 10], 1, [99], [5]),  # an aside step already gone changes nothing
    ],
)
def test_emergency_steps_do_not_count_against_keep(
    steps: list[int], keep: int, aside: list[int], removed: list[int]
) -> None:
    assert beyond_retention(steps, keep, aside) == removed


def test_a_periodic_save_after_an_emergency_save_keeps_the_periodic_steps_before_it(
    tmp_path: Path,
) -> None:
    """A Checkpointer keeping 2 durable steps: periodic steps 10 and 20, an emergency save
    of step 12 between them. Before, step 20's retention removed step 10."""
    from training.checkpoint import Checkpointer, CheckpointSettings
    from training.checkpoint.peer import PeerTier

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    settings = CheckpointSettings(
        in_memory_checkpointing_freq=5,
        s3_checkpointing_freq=10,
        topk_ckpt=2,
        ram_topk_ckpt=1,
        ram_dir=tmp_path / "ram",
        durable_dir=tmp_path / "durable",
        sync_files=False,
        enable_async_ckpt=False,
    )
    ckpt = Checkpointer(
        model,
        optimizer,
        settings=settings,
        peer=PeerTier(None, None, 0, fetch_timeout_s=1),
        emergency=True,
    )
    assert ckpt.restore() == 0

    def train_to(last: int, first: int) -> None:
        for step in range(first, last + 1):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step_done(step)
        ckpt.wait()

    def steps(tier: str) -> list[int]:
        return fmt.committed_steps(tmp_path / tier, 0)

    train_to(12, 1)
    assert ckpt.emergency_save() == 12
    assert (steps("ram"), steps("durable")) == ([10, 12], [10, 12])
    train_to(20, 13)
    # RAM keeps one periodic step (20); 12 is older than it. Durable keeps two (10, 20)
    # and the emergency step between them.
    assert (steps("ram"), steps("durable")) == ([20], [10, 12, 20])
    train_to(30, 21)
    assert (steps("ram"), steps("durable")) == ([30], [20, 30])
    ckpt.close()


def test_a_rank_of_several_keeps_three_ram_steps_whatever_it_is_told(tmp_path: Path) -> None:
    """With saves written in the background a rank can end two saves behind the others
    (its save of s+1 still being written while they committed s+1 and s+2): each keeps
    s, which every rank then shares. One process alone keeps what it is told."""
    from training.checkpoint.tiers import RamTier

    for told, alone, several in ((1, 1, 3), (2, 2, 3), (5, 5, 5)):
        ram = RamTier(tmp_path / "ram", keep=told, sync=False, threads=1)
        assert (ram.keep(1), ram.keep(4)) == (alone, several), told
