"""Checkpoint tiers (RAM, peer, durable) for a PyTorch training state (extra `torch`).

`Checkpointer` is the API; `CheckpointSettings` its settings; `format` the on-disk layout
(standard library only, also read by the host monitor's peer tier).
"""

from training.checkpoint.checkpointer import Checkpointer, Restored
from training.checkpoint.settings import CheckpointSettings

__all__ = ["CheckpointSettings", "Checkpointer", "Restored"]
