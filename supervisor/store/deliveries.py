"""Notification deliveries: recorded with the notices they carry, attempted, listed."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sqlalchemy import select, update

from supervisor.domain import (
    utcnow,
)
from supervisor.notices import Delivery, DeliveryStatus, NewDelivery
from supervisor.store.base import RepositoryBase
from supervisor.store.mappers import (
    delivery_of,
)
from supervisor.store.models import (
    NotificationDeliveryRow,
)
from supervisor.store.queries import DeliveryFilter, Page, decode_cursor


class DeliveryRecords(RepositoryBase):
    # --- notification deliveries --------------------------------------------------------

    def create_deliveries(self, new: Sequence[NewDelivery]) -> list[Delivery]:
        """Record deliveries pending; one already recorded (same route and item) is not
        recorded again and not returned."""
        if not new:
            return []
        now = utcnow()
        d = NotificationDeliveryRow
        with self._sessions.begin() as session:
            known = {
                (route, kind, item_id)
                for route, kind, item_id in session.execute(
                    select(d.route, d.item_kind, d.item_id).where(
                        d.item_id.in_({n.notice.id for n in new})
                    )
                )
            }
            rows = []
            for item in new:
                key = (item.route, item.notice.kind, item.notice.id)
                if key in known:
                    continue
                known.add(key)
                rows.append(
                    NotificationDeliveryRow(
                        route=item.route,
                        sink=item.sink,
                        item_kind=item.notice.kind,
                        item_id=item.notice.id,
                        item_type=item.notice.type,
                        job=item.notice.job,
                        node=item.notice.node,
                        notice=item.notice.to_json(),
                        status=DeliveryStatus.PENDING.value,
                        attempts=0,
                        created_at=now,
                        updated_at=now,
                    )
                )
            session.add_all(rows)
            session.flush()
            return [delivery_of(r) for r in rows]

    def pending_deliveries(self, route: str, limit: int = 100) -> list[Delivery]:
        """The route's pending deliveries, oldest first."""
        d = NotificationDeliveryRow
        query = (
            select(d)
            .where(d.status == DeliveryStatus.PENDING.value, d.route == route)
            .order_by(d.id)
            .limit(limit)
        )
        with self._sessions() as session:
            return [delivery_of(r) for r in session.scalars(query)]

    def record_delivery_attempt(
        self, delivery_id: int, status: DeliveryStatus, error: str | None = None
    ) -> Delivery:
        """Count an attempt and its result: still pending (to be tried again), delivered
        or failed."""
        now = utcnow()
        with self._sessions.begin() as session:
            row = session.get(NotificationDeliveryRow, delivery_id, with_for_update=True)
            if row is None:
                raise KeyError(delivery_id)
            row.attempts += 1
            row.status = status.value
            row.last_error = error
            row.updated_at = now
            if status is not DeliveryStatus.PENDING:
                row.finished_at = now
            return delivery_of(row)

    def fail_pending_deliveries(self, *, except_routes: Collection[str], error: str) -> int:
        """Give up the pending deliveries of routes no longer configured."""
        d = NotificationDeliveryRow
        now = utcnow()
        with self._sessions.begin() as session:
            result = session.execute(
                update(d)
                .where(d.status == DeliveryStatus.PENDING.value, d.route.not_in(except_routes))
                .values(
                    status=DeliveryStatus.FAILED.value,
                    last_error=error,
                    updated_at=now,
                    finished_at=now,
                )
            )
            return int(getattr(result, "rowcount", 0) or 0)

    def get_delivery(self, delivery_id: int) -> Delivery | None:
        with self._sessions() as session:
            row = session.get(NotificationDeliveryRow, delivery_id)
            return delivery_of(row) if row else None

    def list_deliveries(
        self, filters: DeliveryFilter, cursor: str | None = None, limit: int = 100
    ) -> Page[Delivery]:
        after = decode_cursor(cursor)
        d = NotificationDeliveryRow
        query = select(d).order_by(d.id.desc()).limit(limit + 1)
        if filters.status:
            query = query.where(d.status == filters.status.value)
        if filters.route:
            query = query.where(d.route == filters.route)
        if filters.kind:
            query = query.where(d.item_kind == filters.kind)
        if filters.item_id is not None:
            query = query.where(d.item_id == filters.item_id)
        if filters.job:
            query = query.where(d.job == filters.job)
        if after is not None:
            query = query.where(d.id < after)
        with self._sessions() as session:
            rows = list(session.scalars(query))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page([delivery_of(r) for r in rows], str(rows[-1].id) if more and rows else None)
