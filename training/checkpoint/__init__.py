"""Checkpoint tiers (RAM, peer, durable) for a PyTorch training state (extra `torch`).

`Checkpointer` is the API; `CheckpointSettings` its settings; `Tiers` the tiers it saves to
and restores from (tiers.py: each a `CheckpointTier`); `CheckpointerOptions` the rest of
what it is told; `format` the on-disk layout. `format` and `settings` need only the
standard library, so they are importable without torch: the names below that need torch
are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from training.checkpoint.settings import CheckpointSettings

if TYPE_CHECKING:
    from training.checkpoint.checkpointer import Checkpointer, Restored
    from training.checkpoint.options import CheckpointerOptions
    from training.checkpoint.tiers import CheckpointTier, Tiers

__all__ = [
    "CheckpointSettings",
    "CheckpointTier",
    "Checkpointer",
    "CheckpointerOptions",
    "Restored",
    "Tiers",
]

#: Each name that needs torch and the module it lives in.
_HOMES = {
    "Checkpointer": "training.checkpoint.checkpointer",
    "Restored": "training.checkpoint.checkpointer",
    "CheckpointerOptions": "training.checkpoint.options",
    "CheckpointTier": "training.checkpoint.tiers",
    "Tiers": "training.checkpoint.tiers",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
