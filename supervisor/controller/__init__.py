"""Runs the user's policy on each event and hands the decided actions to the actuator."""

from supervisor.controller.controller import Controller
from supervisor.controller.loader import PolicyLoadError, load_policy

__all__ = ["Controller", "PolicyLoadError", "load_policy"]
