"""The remedies each job has in flight: the actions a policy (or an operator) took to heal
it, from the moment they are recorded until they finish. A job with one is `recovering`
(supervisor/job_state.py). Kept in memory from the actuator's changes (`note`); unfinished
actions resumed after a restart are noted again as they run."""

from __future__ import annotations

from supervisor.domain import DISRUPTIVE_ACTIONS, ActionRecord, ActionType

#: What heals a job: what stops and starts its workers, and the save before it.
REMEDIES = DISRUPTIVE_ACTIONS | {ActionType.EMERGENCY_CHECKPOINT}


class RemediesInFlight:
    """Per job, the ids of its remedies not finished yet."""

    def __init__(self) -> None:
        self._open: dict[str, set[int]] = {}

    def note(self, action: ActionRecord) -> None:
        """How `action` stands now (every change the actuator records)."""
        if action.job is None or action.type not in REMEDIES:
            return
        ids = self._open.setdefault(action.job, set())
        if action.status.finished:
            ids.discard(action.id)
            if not ids:
                del self._open[action.job]
        else:
            ids.add(action.id)

    def recovering(self, job: str) -> bool:
        return bool(self._open.get(job))
