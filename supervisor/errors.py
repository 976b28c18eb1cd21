"""The supervisor's own refusals, under one root, for the API to map to statuses.

SupervisorError
├── UnknownTarget      a fault or action names a node or job not known (404)
├── RequestRefused     well formed, but cannot be taken as it stands (409/422)
└── FaultNotSupported  the fault cannot be acted out with this backend (422)
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Root of the supervisor's own errors."""


class UnknownTarget(SupervisorError, LookupError):
    """A fault or action names a node or job the supervisor does not know."""


class FaultNotSupported(SupervisorError, ValueError):
    """The fault cannot be acted out with this backend."""


class RequestRefused(SupervisorError, ValueError):
    """An operator's request that is well formed but cannot be taken as it stands (its
    message starts with the field it is about)."""
