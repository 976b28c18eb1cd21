"""The training side: what runs inside the user's training processes.

- `worker_client`: the link to the node's host monitor (register, progress, checkpoint
  reports, emergency checkpoints on SIGUSR1); standard library and httpx only. Its
  parts, one job each, are in `monitor_link`.
- `checkpoint`: checkpoint tiers (RAM, peer, durable) for a PyTorch training state, with
  `torch.distributed.checkpoint` (extra `torch`).
- `numpy_workload`: the demo workload of local mode (extra `demo`: NumPy).
- `auto_progress`: a PyTorch script's optimizer steps reported as its progress when it
  reports none itself (started by `supervisor run` and `pod_launch`; stdlib at start).

Nothing here imports the supervisor or the host monitor: they are other processes, and
talk to this package only over HTTP.

What a training script uses is exported here: `from training import Checkpointer,
CheckpointSettings, WorkerClient`. Each name is imported on first use, so `import training`
costs nothing and a script that never touches the Checkpointer never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.checkpoint import (
        Checkpointer,
        CheckpointerOptions,
        CheckpointSettings,
        Restored,
        Tiers,
    )
    from training.checkpoint.lightning import TieredCheckpointing
    from training.errors import TrainingError
    from training.healing import InProcessHealing
    from training.worker_client import WorkerClient

#: Each exported name and the module it lives in.
_HOMES = {
    "Checkpointer": "training.checkpoint",
    "CheckpointSettings": "training.checkpoint",
    "CheckpointerOptions": "training.checkpoint",
    "Tiers": "training.checkpoint",
    "Restored": "training.checkpoint",
    "WorkerClient": "training.worker_client",
    "InProcessHealing": "training.healing",
    "TieredCheckpointing": "training.checkpoint.lightning",
    "TrainingError": "training.errors",
}

__all__ = [
    "CheckpointSettings",
    "Checkpointer",
    "CheckpointerOptions",
    "InProcessHealing",
    "Restored",
    "TieredCheckpointing",
    "Tiers",
    "TrainingError",
    "WorkerClient",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value
