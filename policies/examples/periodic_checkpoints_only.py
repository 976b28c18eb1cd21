"""The default policy without emergency checkpoints: restarts resume from the newest
periodic checkpoint. `make bench` runs it beside the default to measure what the
emergency checkpoint saves.

    SUPERVISOR_POLICY=policies.examples.periodic_checkpoints_only:PeriodicCheckpointsOnly
"""

from __future__ import annotations

from policies.default import DefaultPolicy


class PeriodicCheckpointsOnly(DefaultPolicy):
    name = "periodic-checkpoints-only"
    emergency_checkpoints = False
