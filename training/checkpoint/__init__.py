"""Checkpoint tiers (RAM, peer, durable) for a PyTorch training state (extra `torch`).

`Checkpointer` is the API; `CheckpointSettings` its settings; `format` the on-disk layout.
`format` and `settings` need only the standard library, so they are importable without
torch: the names below that need torch are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from training.checkpoint.settings import CheckpointSettings

if TYPE_CHECKING:
    from training.checkpoint.checkpointer import Checkpointer, Restored

__all__ = ["CheckpointSettings", "Checkpointer", "Restored"]


def __getattr__(name: str) -> Any:
    if name in ("Checkpointer", "Restored"):
        from training.checkpoint import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
