"""Carries out recorded actions through a backend: bounded in time, retried with backoff,
and recorded before and after every attempt."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from resiliency_protocol.backoff import attempt_delay
from supervisor.actuator.backend import ActionError, Backend, Fence, Fenced, no_fence
from supervisor.config_parts import ActuatorSettings
from supervisor.domain import ActionRecord, ActionStatus, ActionType
from supervisor.metrics import Metrics
from supervisor.store.roles import AttemptLog

log = logging.getLogger(__name__)

OnFinished = Callable[[ActionRecord], Awaitable[None]]
#: Told of each recorded change of an action (must not block: it runs on the loop).
OnChange = Callable[[ActionRecord], None]


class Actuator:
    def __init__(
        self,
        store: AttemptLog,
        backend: Backend,
        settings: ActuatorSettings,
        metrics: Metrics,
        on_succeeded: OnFinished | None = None,
        *,
        on_change: OnChange | None = None,
        fence: Fence = no_fence,
    ) -> None:
        self.store = store
        #: Raises Fenced once this replica may no longer act (leader election).
        self.fence = fence
        self.backend = backend
        self.settings = settings
        self.metrics = metrics
        self._on_succeeded = on_succeeded
        self._on_change = on_change

    def changed(self, action: ActionRecord) -> None:
        """Tell whoever listens that this is how the action now stands in the store."""
        if self._on_change is not None:
            self._on_change(action)

    def timeout_s(self, action_type: ActionType) -> float:
        if action_type is ActionType.EMERGENCY_CHECKPOINT:
            return self.settings.emergency_checkpoint_timeout_s
        return self.settings.action_timeout_s

    def max_attempts(self, action_type: ActionType) -> int:
        # A checkpoint that comes late is worth nothing: it gets one attempt.
        if action_type is ActionType.EMERGENCY_CHECKPOINT:
            return 1
        return self.settings.action_max_attempts

    async def run(self, action: ActionRecord) -> ActionRecord:
        """Run an action to its end. Finished actions are returned as they are.

        Raises Fenced, leaving the action as it stands in the store, when this replica
        may no longer act: before an attempt, or from inside the backend."""
        if action.status.finished:
            return action
        timeout = self.timeout_s(action.type)
        limit = self.max_attempts(action.type)
        if action.status is ActionStatus.RUNNING:
            # Resumed after a crash: the interrupted attempt did not fail, it was cut
            # short. One more call with the same key lets the (idempotent) backend
            # finish it or report what it did, e.g. the same checkpoint round's acks.
            limit = max(limit, action.attempts + 1)
        started = time.monotonic()
        error = "not attempted"
        while action.attempts < limit:
            self.fence()
            action = await asyncio.to_thread(self.store.start_attempt, action.id)
            self.changed(action)
            try:
                async with asyncio.timeout(timeout):
                    result = await self.backend.execute(action)
            except Fenced:
                log.warning("action %s (%s) left to the leader", action.id, action.type.value)
                raise
            except TimeoutError:
                error = f"timed out after {timeout:g}s"
                retryable = action.type is not ActionType.EMERGENCY_CHECKPOINT
            except ActionError as exc:
                error = str(exc) or type(exc).__name__
                retryable = exc.retryable
            except Exception as exc:  # a backend bug must not take the supervisor down
                log.exception("backend %s crashed on action %s", self.backend.name, action.id)
                error = f"{type(exc).__name__}: {exc}"
                retryable = False
            else:
                return await self._finish(action, ActionStatus.SUCCEEDED, started, result=result)
            log.warning(
                "action %s (%s) attempt %d/%d failed: %s",
                action.id,
                action.type.value,
                action.attempts,
                limit,
                error,
                extra=log_fields(action),
            )
            if not retryable or action.attempts >= limit:
                if action.attempts > 1:  # the whole action took that many bounded attempts
                    error = f"{error} (attempt {action.attempts} of {limit})"
                break
            await asyncio.to_thread(self.store.note_attempt_error, action.id, error)
            self.changed(replace(action, error=error))
            await asyncio.sleep(
                attempt_delay(self.settings.action_retry_backoff_s, action.attempts)
            )
        else:
            error = f"no attempts left ({action.attempts}/{limit} used before a restart)"
        return await self._finish(action, ActionStatus.FAILED, started, error=error)

    async def _finish(
        self,
        action: ActionRecord,
        status: ActionStatus,
        started: float,
        *,
        error: str | None = None,
        result: Mapping[str, Any] | None = None,
    ) -> ActionRecord:
        stored_result = dict(result) if result is not None else None
        finished = await asyncio.to_thread(
            partial(self.store.finish_action, action.id, status, error=error, result=stored_result)
        )
        self.changed(finished)
        if finished.dry_run:  # nothing was done: no action, duration or restart to count
            self.metrics.dry_run_actions.labels(action.type.value, status.value).inc()
        else:
            self.metrics.actions.labels(action.type.value, status.value).inc()
            elapsed = time.monotonic() - started
            self.metrics.action_seconds.labels(action.type.value).observe(elapsed)
            self.metrics.job_actions.count(finished)
        log.info(
            "action %s %s job=%s node=%s: %s%s%s",
            finished.id,
            finished.type.value,
            finished.job,
            finished.node,
            status.value,
            " (dry run: nothing done)" if finished.dry_run else "",
            f" ({error})" if error else "",
            extra=log_fields(finished),
        )
        if status is ActionStatus.SUCCEEDED and self._on_succeeded is not None:
            await self._on_succeeded(finished)
        return finished


def log_fields(action: ActionRecord) -> dict[str, object]:
    """An action's fields for a structured log line (resiliency_protocol.logs)."""
    return {
        "action": action.id,
        "action_type": action.type.value,
        "job": action.job,
        "node": action.node,
        "event": action.event_id,
        "fault_id": action.fault_id,
    }
