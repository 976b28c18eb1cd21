"""The one interface every backend implements (dry-run, local processes, Kubernetes)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from supervisor.domain import ActionRecord


class ActionError(Exception):
    """An action could not be carried out. `retryable` errors are tried again."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class Backend(ABC):
    """Carries out actions against the real world.

    `execute` must be idempotent per `action.idempotency_key`: the supervisor may call it
    again for the same action after a crash or a retry, and the effect must be that of
    one call. It returns a small JSON-able result that is stored with the action, and
    raises `ActionError` on failure. The actuator bounds each call with a timeout.
    """

    name: ClassVar[str]
    #: Fault kinds this backend can act out on real processes (see `inject_fault`).
    process_faults: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    async def execute(self, action: ActionRecord) -> Mapping[str, Any]: ...

    async def inject_fault(
        self, kind: str, node: str, params: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Act out a process-level fault on a node (kill, hang, slow a worker, ...).

        Backends that run no processes of their own cannot, and say so.
        """
        raise ActionError(f"the {self.name} backend cannot inject {kind} faults")

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release here
        """Release connections and child processes."""
