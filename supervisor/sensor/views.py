"""The nodes' views a snapshot hands out, kept from one snapshot to the next.

The controller takes a snapshot (`SensorReads.snapshot`) before each decision: every
node's view. Checking every record's cached view cost ~12 ms a snapshot at 25,000 nodes
even when none had changed. So the views are kept here, and whoever writes a field a
node's view shows (`nodes._view_inputs`: its workers, state, job, liveness, last
heartbeat, cordon, flapping) names the node in `changed`: a snapshot visits only those,
and copies the others' views as they were.
"""

from __future__ import annotations

from supervisor.domain import NodeView
from supervisor.sensor.nodes import NodeRecord, node_views


class NodeViews:
    __slots__ = ("_offset", "_views", "changed")

    def __init__(self) -> None:
        #: Nodes whose view may differ from the one kept (a name that has none yet: a new node).
        self.changed: set[str] = set()
        self._views: dict[str, NodeView] = {}
        self._offset: float | None = None

    def current(self, records: dict[str, NodeRecord], wall_offset: float) -> dict[str, NodeView]:
        """Every record's view, in a dict of the caller's own (it may change it)."""
        views = self._views
        if wall_offset != self._offset:
            # Every view's last heartbeat is read through the offset: each one is checked.
            views = self._views = node_views(records, wall_offset)
            self._offset = wall_offset
        else:
            for name in self.changed:
                views[name] = records[name].view(wall_offset)
        self.changed.clear()
        return dict(views)
