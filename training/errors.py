"""The training side's exceptions, under one root. Each is defined beside the code that
raises it.

TrainingError
├── CheckpointCorrupt         a checkpoint directory failed verification (checkpoint/format.py)
├── EmergencyCheckpointError  an emergency save could not be made (checkpoint/checkpointer.py)
├── CheckpointSavesFailing    max_consecutive_save_failures saves in a row failed
│                             (checkpoint/checkpointer.py)
├── StaleWorldCommit          a commit refused: a newer world than the writer's has started
│                             (checkpoint/fencing.py)
├── Conflict                  a conditional write refused: another writer's landed first
│                             (checkpoint/buckets.py; also an OSError)
├── CheckpointSavesRefused    max_consecutive_save_failures NumPy saves in a row refused
│                             (numpy_workload/train.py)
├── ConfigError               a workload setting is missing or invalid
│                             (torch_workload/config.py, numpy_workload/config.py)
├── CollectiveTimeout         a NumPy collective waited past its timeout
│                             (numpy_workload/collective.py)
├── Terminated                the NumPy workload was signalled to stop (numpy_workload/train.py)
├── NoNewWorld                a collective failed and no new world came in time (healing.py)
└── HostLeaseExpired          a durable write refused: the rank's lease ran out
                              (monitor_link/lease.py)

Imports nothing: the on-disk format module stays standard library only.
"""

from __future__ import annotations


class TrainingError(Exception):
    """Root of the training side's errors."""
