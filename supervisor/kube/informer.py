"""A list-then-watch cache of one kind of object (what client-go calls an informer).

The official client is synchronous, so each informer runs its loop in a thread and hands
every change to the asyncio event loop with `call_soon_threadsafe`; the cache itself is
only read and written on the event loop.

The loop, as the API server expects clients to behave:
- list (paginated), then watch from the list's resourceVersion with bookmarks, so a
  reconnect resumes where the last event or bookmark left off;
- a 410 Gone (the resourceVersion was compacted away) means re-list: the new list
  replaces the cache, and objects missing from it are reported as deleted;
- a stream that ends (server timeout) is reopened from the last resourceVersion; errors
  (connection refused, 5xx, 429) are retried with capped exponential backoff.

The stream is read line by line from the raw response: `kubernetes.watch.Watch` raises
on a 410 only after retrying it once, and cannot be interrupted from another thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from resiliency_protocol.backoff import Backoff
from supervisor.kube.errors import ApiError, Gone, api_error, status_error
from supervisor.kube.objects import Obj, key_of

log = logging.getLogger(__name__)

#: (event type "ADDED" | "MODIFIED" | "DELETED", the object, the object before or None)
Listener = Callable[[str, Obj, Obj | None], None]
ListCall = Callable[..., Any]


class Informer:
    def __init__(
        self,
        kind: str,
        list_call: ListCall,
        loop: asyncio.AbstractEventLoop,
        *,
        label_selector: str = "",
        field_selector: str = "",
        watch_timeout_s: int = 300,
        backoff_s: tuple[float, float] = (0.2, 10.0),
        request_timeout_s: float = 30.0,
        page_size: int = 500,
    ) -> None:
        self.kind = kind
        self._list = list_call
        self._loop = loop
        self._selectors = {
            k: v
            for k, v in (("label_selector", label_selector), ("field_selector", field_selector))
            if v
        }
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._request_timeout_s = request_timeout_s
        self._page_size = page_size
        self.items: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.listeners: list[Listener] = []
        #: Counts of what the loop did (lists, watches opened, 410s, errors, the server's
        #: bookmarks), for tests.
        self.stats = {"lists": 0, "watches": 0, "gone": 0, "errors": 0, "bookmarks": 0}
        #: Where the next watch resumes: the last list's, event's or bookmark's version.
        self.resource_version: str | None = None
        #: What the last list or watch failed with (the `ApiError`, or the exception),
        #: until a list succeeds: read on the event loop to say why it has not synced.
        self.last_error: Exception | None = None
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"informer-{kind}", daemon=True)

    # --- lifecycle (event loop side) ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Unblocks a read in progress (urllib3 >= 2.3); the thread then sees _stop.
            shutdown = getattr(response, "shutdown", None)
            try:
                if shutdown is not None:
                    shutdown()
                else:
                    response.close()
            except Exception:  # already closed: nothing to interrupt
                log.debug("closing the %s watch", self.kind, exc_info=True)
        await asyncio.to_thread(self._thread.join, self._request_timeout_s + 5)

    # --- the loop (thread side) -------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff(*self._backoff_s)
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._relist()
                    self.last_error = None
                version = self._watch(version)
                backoff.reset()
            except Gone:  # an ERROR event in the stream
                self.stats["gone"] += 1
                log.info("%s watch expired (410): listing again", self.kind)
                version = None
            except Exception as exc:
                if self._stop.is_set():
                    break
                error = (
                    api_error(exc, f"list/watch {self.kind}")
                    if isinstance(exc, ApiException)
                    else exc
                )
                if isinstance(error, Gone):
                    # The answer to the watch request itself: the same expiry as the
                    # stream's ERROR event, not a failure to back off from.
                    self.stats["gone"] += 1
                    log.info("%s watch refused as expired (410): listing again", self.kind)
                    version = None
                    continue
                self.stats["errors"] += 1
                self.last_error = error
                brief = (
                    str(error) if isinstance(error, ApiError) else f"{type(exc).__name__}: {exc}"
                )
                delay = backoff.next()
                log.warning("%s watch failed (%s); retrying in %.1fs", self.kind, brief, delay)
                self._stop.wait(delay)

    def _relist(self) -> str:
        items: list[Obj] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": self._page_size, **self._selectors}
            if token:
                kwargs["_continue"] = token
            response = self._list(
                _preload_content=False, _request_timeout=self._request_timeout_s, **kwargs
            )
            body = json.loads(response.data)
            items.extend(body.get("items") or [])
            token = body.get("metadata", {}).get("continue")
            if not token:
                break
        self.stats["lists"] += 1
        self._post(self._replace, items)
        self.resource_version = str(body.get("metadata", {}).get("resourceVersion", ""))
        return self.resource_version

    def _watch(self, version: str) -> str:
        response = self._list(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            _request_timeout=(self._request_timeout_s, self._watch_timeout_s + 30),
            **self._selectors,
        )
        self._response = response
        self.stats["watches"] += 1
        try:
            if self._stop.is_set():
                return version
            for line in iter_resp_lines(response):
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # obj is a Status
                    raise status_error(f"watch {self.kind}", int(obj.get("code") or 0), obj)
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                self.resource_version = version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._post(self._apply, kind, obj)
                elif kind == "BOOKMARK":
                    self.stats["bookmarks"] += 1
                if self._stop.is_set():
                    break
        finally:
            self._response = None
            response.close()
            response.release_conn()
        return version

    def _post(self, func: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(func, *args)
        except RuntimeError:  # the event loop is closed: we are shutting down
            self._stop.set()

    # --- the cache (event loop side) ------------------------------------------------------

    def _replace(self, items: list[Obj]) -> None:
        fresh = {key_of(o): o for o in items}
        for key, old in list(self.items.items()):
            if key not in fresh:
                del self.items[key]
                self._notify("DELETED", old, old)
        for key, obj in fresh.items():
            before = self.items.get(key)
            self.items[key] = obj
            if before is None:
                self._notify("ADDED", obj, None)
            elif before.get("metadata", {}).get("resourceVersion") != obj.get("metadata", {}).get(
                "resourceVersion"
            ):
                self._notify("MODIFIED", obj, before)
        self.synced.set()

    def _apply(self, kind: str, obj: Obj) -> None:
        key = key_of(obj)
        before = self.items.get(key)
        if kind == "DELETED":
            self.items.pop(key, None)
        else:
            self.items[key] = obj
        self._notify(kind, obj, before)

    def _notify(self, kind: str, obj: Obj, before: Obj | None) -> None:
        for listener in self.listeners:
            try:
                listener(kind, obj, before)
            except Exception:
                log.exception("%s listener failed", self.kind)
