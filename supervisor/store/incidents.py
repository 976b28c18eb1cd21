"""Attaching an event to the incident of a remedy already decided: the event is marked
handled, with no action of its own, naming the remedy; the remedy lists it. One
transaction, idempotent (an event already handled is left as it is)."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from supervisor.domain import utcnow
from supervisor.store.models import ActionRow, EventRow


def attach_event(sessions: sessionmaker[Session], event_id: int, action_id: int) -> bool:
    """Attach event `event_id` to the incident of action `action_id`; False when the event
    was handled already (then nothing changes). KeyError for an unknown event or action."""
    with sessions.begin() as session:
        event = session.get(EventRow, event_id, with_for_update=True)
        action = session.get(ActionRow, action_id, with_for_update=True)
        if event is None or action is None:
            raise KeyError(event_id if event is None else action_id)
        if event.handled_at is not None:
            return False
        event.handled_at = utcnow()
        event.incident_action_id = action_id
        action.attached_events = [*(action.attached_events or ()), event_id]
        return True
