"""The fake's etcd: objects, one global resourceVersion counter and the change history.

As in etcd, every write takes the next revision of a single global counter, and
``metadata.resourceVersion`` is that revision as a decimal string. The history of
changes is what watches replay; :meth:`Store.compact` moves the compaction point, after
which a watch or a paginated list from an older resourceVersion is answered with 410
(etcd "required revision has been compacted", surfaced by the API server as
``too old resource version``).
"""

from __future__ import annotations

import bisect
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .resources import RESOURCES, Obj, meta

Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped


@dataclass(frozen=True)
class Change:
    rv: int
    resource: str  # plural
    type: str  # ADDED | MODIFIED | DELETED
    obj: Obj  # the new state (for DELETED: the last state, carrying the deletion rv)
    old: Obj | None


Listener = Callable[[Change], None]
ObjList = list[Obj]
ChangeList = list[Change]


class Store:
    def __init__(self, history_limit: int = 100_000) -> None:
        self.lock = threading.RLock()
        self._rv = 1
        self._objects: dict[str, dict[Key, Obj]] = {r.plural: {} for r in RESOURCES}
        self._history: list[Change] = []
        self._history_rvs: list[int] = []
        self._compacted = 1  # new watches/lists from an older rv get 410
        self._trimmed = 1  # history physically kept only for revisions > this
        self._limit = history_limit
        self._listeners: list[Listener] = []

    # --- reads --------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self.lock:
            return self._rv

    @property
    def compacted(self) -> int:
        with self.lock:
            return self._compacted

    def raw(self, plural: str, ns: str, name: str) -> Obj | None:
        """The stored object itself (no copy): callers must hold ``lock`` and not mutate it."""
        return self._objects[plural].get((ns, name))

    def get(self, plural: str, ns: str, name: str) -> Obj | None:
        with self.lock:
            obj = self._objects[plural].get((ns, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, ns: str | None = None) -> ObjList:
        """Objects sorted by (namespace, name), like an etcd range read over the prefix."""
        with self.lock:
            items = self._objects[plural]
            keys = sorted(k for k in items if ns is None or k[0] == ns)
            return [copy.deepcopy(items[k]) for k in keys]

    def find_uid(self, plural: str, uid: str) -> Obj | None:
        with self.lock:
            for obj in self._objects[plural].values():
                if obj["metadata"].get("uid") == uid:
                    return copy.deepcopy(obj)
            return None

    def changes_since(
        self, rv: int, plural: str | None = None, *, open_watch: bool = False
    ) -> ChangeList | None:
        """Changes with revision > rv, or None when they are no longer available.

        A new request is refused below the compaction point. An open watch keeps
        streaming across a compaction (the API server feeds it from its watch cache)
        unless it falls behind the history actually kept.
        """
        with self.lock:
            if rv < (self._trimmed if open_watch else max(self._compacted, self._trimmed)):
                return None
            i = bisect.bisect_right(self._history_rvs, rv)
            return [c for c in self._history[i:] if plural is None or c.resource == plural]

    # --- writes -------------------------------------------------------------

    def _commit(self, change_type: str, plural: str, obj: Obj, old: Obj | None) -> Obj:
        self._rv += 1
        meta(obj)["resourceVersion"] = str(self._rv)
        change = Change(self._rv, plural, change_type, copy.deepcopy(obj), old)
        self._history.append(change)
        self._history_rvs.append(self._rv)
        if len(self._history) > self._limit:
            drop = len(self._history) - self._limit
            self._trimmed = max(self._trimmed, self._history_rvs[drop - 1])
            del self._history[:drop]
            del self._history_rvs[:drop]
        for listener in list(self._listeners):
            listener(change)
        return copy.deepcopy(obj)

    def put(self, plural: str, obj: Obj) -> Obj:
        """Create or replace; assigns the next resourceVersion. Returns a copy."""
        with self.lock:
            m = obj["metadata"]
            key = (m.get("namespace", ""), m["name"])
            old = self._objects[plural].get(key)
            stored = copy.deepcopy(obj)
            self._objects[plural][key] = stored
            return self._commit("ADDED" if old is None else "MODIFIED", plural, stored, old)

    def remove(self, plural: str, ns: str, name: str) -> Obj | None:
        with self.lock:
            old = self._objects[plural].pop((ns, name), None)
            if old is None:
                return None
            gone = copy.deepcopy(old)
            return self._commit("DELETED", plural, gone, old)

    def compact(self) -> int:
        """Compact up to the current revision (like etcd compaction); returns it."""
        with self.lock:
            self._compacted = self._rv
            return self._rv

    # --- notifications ------------------------------------------------------

    def add_listener(self, fn: Listener) -> None:
        with self.lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        with self.lock:
            if fn in self._listeners:
                self._listeners.remove(fn)
