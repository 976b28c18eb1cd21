"""Carries out the actions a policy chose, through a backend."""

from supervisor.actuator.actuator import Actuator
from supervisor.actuator.backend import (
    ActionError,
    Backend,
    BackendHooks,
    Fence,
    Fenced,
    no_fence,
)
from supervisor.actuator.dry_run import DryRunBackend

__all__ = [
    "ActionError",
    "Actuator",
    "Backend",
    "BackendHooks",
    "DryRunBackend",
    "Fence",
    "Fenced",
    "no_fence",
]
