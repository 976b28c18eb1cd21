"""The fake Kubernetes API server over HTTP, and :class:`FakeKube`, the test fixture.

An ASGI app (Starlette) served by uvicorn on ``127.0.0.1:<free port>`` in a background
thread. It answers the REST paths the official ``kubernetes`` Python client uses::

    /api/v1/namespaces/{ns}/{pods|events}[/{name}[/status|/eviction]]
    /api/v1/{nodes|pods|events}[/{name}[/status]]          (cluster-scoped / all namespaces)
    /apis/{group}/{version}/namespaces/{ns}/{plural}[/{name}[/status]]

with GET (get, list, ``?watch=true``), POST (create, eviction), PUT (replace), PATCH
(merge, strategic merge, JSON patch) and DELETE. Errors are ``meta/v1 Status`` bodies.

Watches (``?watch=true``) stream one JSON event per line, ``{"type", "object"}``, as the
real server does: ADDED/MODIFIED/DELETED after ``resourceVersion`` (synthetic ADDED
events for the current state when it is unset or "0"), BOOKMARK events every
``bookmark_interval`` seconds when ``allowWatchBookmarks=true`` (the real server sends
them about once a minute), an ERROR event with a 410 ``Expired`` Status ("too old
resource version") when the resourceVersion is older than the compaction point, and
the end of the stream after ``timeoutSeconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import kubernetes.client
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .apiserver import ApiServer, with_type
from .controllers import Cluster
from .resources import (
    BY_PATH,
    NODES,
    PODS,
    ApiError,
    Obj,
    Resource,
    bad_request,
    now_rfc3339,
    resolve,
    too_many_requests,
)
from .selectors import matcher, parse_field_selector, parse_label_selector
from .store import Store

T = TypeVar("T")

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@dataclass
class RequestRecord:
    method: str
    path: str
    query: str
    verb: str
    content_type: str
    status: int = 0


@dataclass
class Fault:
    """An injected failure: the next ``times`` requests matching verb and path fail."""

    verb: str
    path: re.Pattern[str]
    status: int | None
    times: int
    delay: float = 0.0
    apply: bool = False
    hits: int = 0

    def matches(self, verb: str, method: str, path: str) -> bool:
        v = self.verb.lower()
        return (
            self.hits < self.times
            and v in ("*", verb, method.lower())
            and self.path.search(path) is not None
        )


def injected_error(status: int) -> ApiError:
    """The Status a real server (or API Priority and Fairness) answers with for ``status``."""
    if status == 429:
        return too_many_requests("Too many requests, please try again later.", 1)
    if status == 500:
        return ApiError(500, "InternalError", "Internal error occurred: injected fault")
    if status == 503:
        return ApiError(
            503, "ServiceUnavailable", "The server is currently unable to handle the request"
        )
    if status == 504:
        return ApiError(
            504,
            "Timeout",
            "Timeout: request did not complete within requested timeout - "
            "context deadline exceeded",
        )
    if status == 409:
        return ApiError(409, "Conflict", "Operation cannot be fulfilled: injected conflict")
    return ApiError(status, "", f"injected fault {status}")


@dataclass
class _Target:
    res: Resource
    ns: str | None
    name: str | None
    sub: str | None


def _parse_path(path: str) -> _Target | None:
    segs = [s for s in path.split("/") if s]
    if len(segs) >= 2 and segs[0] == "api":
        group, version, rest = "", segs[1], segs[2:]
    elif len(segs) >= 3 and segs[0] == "apis":
        group, version, rest = segs[1], segs[2], segs[3:]
    else:
        return None
    ns: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    res = BY_PATH.get((group, version, rest[0]))
    if res is None:
        return None
    if ns is not None and not res.namespaced:
        return None
    name = rest[1] if len(rest) > 1 else None
    if res.namespaced and ns is None and name is not None:
        return None
    sub = rest[2] if len(rest) > 2 else None
    if (
        sub is not None
        and not (sub == "status" and res.status_subresource)
        and not (sub == "eviction" and res is PODS)
    ):
        return None
    return _Target(res, ns, name, sub)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.status(), status_code=e.code, headers=e.headers)


def _not_found_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def _verb(method: str, t: _Target, query: dict[str, str]) -> str:
    if method == "GET":
        if t.name:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    return {
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if t.name else "deletecollection",
    }[method]


def _int(query: dict[str, str], key: str) -> int | None:
    v = query.get(key)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError as e:
        raise bad_request(f"invalid {key}: {v!r}") from e


class FakeKube:
    """A fake Kubernetes API server with a tiny cluster behind it.

    ``with FakeKube() as kube:`` starts it; ``kube.client()`` is a configured
    ``kubernetes.client.ApiClient``. ``time_scale`` multiplies the wall-clock waits of
    the cluster (pod grace periods, tolerationSeconds) without changing what the API
    reports (``deletionGracePeriodSeconds`` stays what was asked); use e.g. 0.01 in
    tests. ``token``, when set, is the only bearer token accepted (401 otherwise).
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        time_scale: float = 1.0,
        bookmark_interval: float = 0.2,
        tick: float = 0.05,
        run_controllers: bool = True,
    ) -> None:
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.store = Store()
        self.api = ApiServer(self.store, time_scale=time_scale)
        self.cluster = Cluster(self.api, tick=tick)
        self.requests: list[RequestRecord] = []
        self._run_controllers = run_controllers
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._closing = False
        self._watch_wakers: set[Callable[[], None]] = set()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # --- lifecycle -----------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeKube:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name="fake-kube-apiserver",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake kube API server did not start")
            time.sleep(0.01)
        if self._run_controllers:
            self.cluster.start()
        return self

    def stop(self, wait: bool = False) -> None:
        """Stop the controllers and the server. Uvicorn's own shutdown takes ~0.2 s (fixed
        sleeps); unless ``wait``, it finishes in its daemon thread while the caller goes on."""
        self._closing = True
        for wake in list(self._watch_wakers):
            wake()  # open watches end now rather than being cancelled by uvicorn
        self.cluster.stop()
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True  # do not wait for keep-alive connections
        if wait and self._thread is not None:
            self._thread.join(timeout=10)
        if self.cluster.errors:
            raise RuntimeError("fake kube controllers failed") from self.cluster.errors[0]

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self, token: str | None = None) -> Any:
        """A ``kubernetes.client.ApiClient`` for this server (bearer token if one is set)."""
        cfg = kubernetes.client.Configuration(host=self.url)
        tok = token if token is not None else self.token
        if tok:
            cfg.api_key = {"BearerToken": tok}
            cfg.api_key_prefix = {"BearerToken": "Bearer"}
        return kubernetes.client.ApiClient(cfg)

    # --- direct state access (as a controller would write it, no HTTP) -------------------

    def create(self, obj: Obj, *, namespace: str = "default", keep_status: bool = True) -> Obj:
        """Create ``obj`` (resource from its ``kind``); keeps a given ``status``."""
        res = resolve(obj["kind"])
        ns = (obj.get("metadata") or {}).get("namespace", namespace) if res.namespaced else ""
        return self.api.create(res, ns, obj, keep_status=keep_status)

    def get(self, kind: str, name: str, namespace: str = "default") -> Obj | None:
        res = resolve(kind)
        obj = self.store.get(res.plural, namespace if res.namespaced else "", name)
        return with_type(res, obj) if obj is not None else None

    def objects(
        self,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[Obj]:
        res = resolve(kind)
        m = matcher(parse_label_selector(label_selector), parse_field_selector(field_selector, res))
        return [with_type(res, o) for o in self.store.list(res.plural, namespace) if m(o)]

    def patch(
        self,
        kind: str,
        name: str,
        patch: Obj,
        namespace: str = "default",
    ) -> Obj:
        """JSON merge patch, unconditional (no resourceVersion check unless the patch has one)."""
        res = resolve(kind)
        return self.api.patch(
            res, namespace, name, "application/merge-patch+json", patch, trusted=True
        )

    def delete(self, kind: str, name: str, namespace: str = "default", **options: Any) -> Obj:
        return self.api.delete(resolve(kind), namespace, name, options)[1]

    def compact(self) -> int:
        """Compact history at the current resourceVersion: older watches/continues get 410."""
        return self.store.compact()

    @property
    def resource_version(self) -> int:
        return self.store.resource_version

    def fail_next(
        self,
        verb: str,
        path_regex: str,
        status: int | None = 500,
        times: int = 1,
        *,
        delay: float = 0.0,
        apply: bool = False,
    ) -> Fault:
        """Make the next ``times`` requests matching ``verb`` and ``path_regex`` fail.

        ``verb`` is a Kubernetes verb (get, list, watch, create, update, patch, delete),
        an HTTP method or "*"; ``path_regex`` is searched in the URL path. ``status``
        429/500/503/504/409 answers with the Status the real server sends for it (429
        with ``Retry-After: 1``); ``delay`` waits that long first (with ``status=None``
        the request then proceeds normally: a slow server, for client timeouts);
        ``apply=True`` carries the request out before failing (a lost response).
        """
        fault = Fault(verb, re.compile(path_regex), status, times, delay, apply)
        with self._lock:
            self._faults.append(fault)
        return fault

    # --- cluster controls -----------------------------------------------------------------

    def add_node(
        self,
        name: str,
        *,
        gpus: int = 0,
        pods: int = 110,
        labels: dict[str, str] | None = None,
        taints: list[Obj] | None = None,
        unschedulable: bool = False,
        ready: bool = True,
    ) -> Obj:
        allocatable: Obj = {"pods": str(pods)}
        if gpus:
            allocatable["nvidia.com/gpu"] = str(gpus)
        spec: Obj = {}
        if taints:
            spec["taints"] = taints
        if unschedulable:
            spec["unschedulable"] = True
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, **(labels or {})},
            },
            "spec": spec,
            "status": {
                "capacity": dict(allocatable),
                "allocatable": allocatable,
                "addresses": [
                    {"type": "InternalIP", "address": f"10.0.{len(self.store.list('nodes'))}.1"}
                ],
                "conditions": [_ready_condition(ready)],
            },
        }
        return self.create(node)

    def set_node_ready(self, name: str, ready: bool) -> None:
        """The node's kubelet (stops / resumes) posting Ready."""
        node = self.get("Node", name)
        if node is None:
            raise KeyError(name)
        conds = [c for c in node["status"].get("conditions") or [] if c.get("type") != "Ready"]
        conds.append(_ready_condition(ready))
        self.api.patch(
            NODES,
            "",
            name,
            "application/merge-patch+json",
            {"status": {"conditions": conds}},
            subresource="status",
            trusted=True,
        )

    def fail_pod(
        self, name: str, namespace: str = "default", exit_code: int = 1, reason: str = "Error"
    ) -> None:
        """The pod's containers exit with ``exit_code`` (restartPolicy decides what follows)."""
        self.cluster.container_exit(namespace, name, exit_code, reason)

    def succeed_pod(self, name: str, namespace: str = "default") -> None:
        self.cluster.container_exit(namespace, name, 0, "Completed")

    def stick_pod(self, name: str, namespace: str = "default") -> None:
        """The pod's kubelet never completes its graceful termination (force delete still works)."""
        pod = self.get("Pod", name, namespace)
        if pod is None:
            raise KeyError(name)
        self.cluster.stuck_pods.add(pod["metadata"]["uid"])

    def wait_for(
        self, predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.02
    ) -> T:
        """Poll ``predicate`` until it returns something truthy; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.cluster.errors:
                raise RuntimeError("fake kube controllers failed") from self.cluster.errors[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout}s")
            time.sleep(interval)

    # --- HTTP -------------------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=ALL_METHODS)])

    def _take_fault(self, verb: str, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.matches(verb, method, path):
                    f.hits += 1
                    return f
        return None

    async def _handle(self, request: Request) -> Response:
        method = request.method
        path = request.url.path
        query = dict(request.query_params)
        record = RequestRecord(
            method, path, request.url.query, "", request.headers.get("content-type", "")
        )
        self.requests.append(record)
        try:
            await request.body()  # read now: starlette caches it; a delayed fault may follow
        except ClientDisconnect:
            return Response(status_code=499)
        response = await self._respond(request, method, path, query, record)
        record.status = response.status_code
        return response

    async def _respond(
        self, request: Request, method: str, path: str, query: dict[str, str], record: RequestRecord
    ) -> Response:
        if (
            self.token is not None
            and request.headers.get("authorization") != f"Bearer {self.token}"
        ):
            return _error(ApiError(401, "Unauthorized", "Unauthorized"))
        if path in ("/version", "/version/"):
            return JSONResponse(
                {
                    "major": "1",
                    "minor": "32",
                    "gitVersion": "v1.32.0-fake",
                    "platform": "linux/amd64",
                }
            )
        if path in ("/healthz", "/livez", "/readyz"):
            return Response("ok", media_type="text/plain")
        target = _parse_path(path)
        if target is None:
            return _error(_not_found_path())
        verb = _verb(method, target, query)
        record.verb = verb
        if (target.sub == "eviction" and method != "POST") or (
            target.name is None and method in ("PUT", "PATCH")
        ):
            return _error(
                ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            )
        if target.name is not None and method == "POST" and target.sub != "eviction":
            return _error(
                ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            )
        if query.get("dryRun"):
            return _error(bad_request("dryRun is not implemented by the fake API server"))
        fault = self._take_fault(verb, method, path)
        if fault is not None:
            await self._slow(fault)
            if fault.status is not None:
                if fault.apply and verb != "watch":
                    await self._dispatch(request, target, verb, query)
                return _error(injected_error(fault.status))
        try:
            return await self._dispatch(request, target, verb, query)
        except ApiError as e:
            return _error(e)

    async def _slow(self, fault: Fault) -> None:
        """Wait the fault's delay (cut short by stop())."""
        end = time.monotonic() + fault.delay
        while not self._closing and time.monotonic() < end:  # noqa: ASYNC110 (ends on stop())
            await asyncio.sleep(min(0.02, end - time.monotonic()))

    async def _body(self, request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from e

    async def _dispatch(
        self, request: Request, t: _Target, verb: str, query: dict[str, str]
    ) -> Response:
        res, ns = t.res, t.ns or ""
        api = self.api
        if verb == "get":
            assert t.name is not None
            return JSONResponse(api.get(res, ns, t.name))
        if verb == "list":
            return JSONResponse(
                api.list(
                    res,
                    t.ns if res.namespaced else None,
                    query.get("labelSelector"),
                    query.get("fieldSelector"),
                    _int(query, "limit"),
                    query.get("continue"),
                )
            )
        if verb == "watch":
            return self._watch(res, t.ns if res.namespaced else None, query)
        if verb == "create":
            body = await self._body(request)
            if t.sub == "eviction":
                assert t.name is not None
                code, obj = api.evict(ns, t.name, body)
                return JSONResponse(obj, status_code=code)
            return JSONResponse(api.create(res, ns, body, keep_status=False), status_code=201)
        if verb == "update":
            assert t.name is not None
            return JSONResponse(
                api.update(res, ns, t.name, await self._body(request), subresource=t.sub)
            )
        if verb == "patch":
            assert t.name is not None
            ctype = request.headers.get("content-type", "")
            return JSONResponse(
                api.patch(res, ns, t.name, ctype, await self._body(request), subresource=t.sub)
            )
        if verb == "delete":
            assert t.name is not None
            body = await self._body(request)
            if isinstance(body, dict):
                options = (
                    body  # the real server reads DeleteOptions from the body when there is one
                )
            else:
                options = {}
                if "gracePeriodSeconds" in query:
                    options["gracePeriodSeconds"] = _int(query, "gracePeriodSeconds")
                if "propagationPolicy" in query:
                    options["propagationPolicy"] = query["propagationPolicy"]
                if "orphanDependents" in query:
                    options["orphanDependents"] = query["orphanDependents"] == "true"
            code, obj = api.delete(res, ns, t.name, options)
            return JSONResponse(obj, status_code=code)
        raise ApiError(405, "MethodNotAllowed", f"{verb} is not implemented by the fake API server")

    # --- watch --------------------------------------------------------------------------------

    def _watch(self, res: Resource, ns: str | None, query: dict[str, str]) -> Response:
        m = self.api.watch_matcher(res, query.get("labelSelector"), query.get("fieldSelector"))
        timeout = _int(query, "timeoutSeconds")
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        send_initial = query.get("sendInitialEvents") == "true"
        if send_initial and not bookmarks:
            raise ApiError(
                422,
                "Invalid",
                "sendInitialEvents is forbidden for watch unless allowWatchBookmarks=true",
            )
        rv_param = query.get("resourceVersion")
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def listener(_change: object) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(wake.set)

        def waker() -> None:
            listener(None)

        initial: list[Obj] = []
        too_old: int | None = None
        with self.store.lock:
            if rv_param in (None, "", "0") or send_initial:
                pos = self.store.resource_version
                initial = [
                    {"type": "ADDED", "object": with_type(res, o)}
                    for o in self.store.list(res.plural, ns)
                    if m(o)
                ]
            else:
                pos = _int(query, "resourceVersion") or 0
                if pos < self.store.compacted:
                    too_old = pos
            self.store.add_listener(listener)
            current = self.store.resource_version

        def line(event: Obj) -> bytes:
            return (json.dumps(event, separators=(",", ":")) + "\n").encode()

        def bookmark(rv: int, initial_end: bool = False) -> Obj:
            md: Obj = {"resourceVersion": str(rv)}
            if initial_end:
                md["annotations"] = {"k8s.io/initial-events-end": "true"}
            return {
                "type": "BOOKMARK",
                "object": {"kind": res.kind, "apiVersion": res.api_version, "metadata": md},
            }

        def gone(rv: int) -> Obj:
            status = ApiError(
                410, "Expired", f"too old resource version: {rv} ({current})"
            ).status()
            return {"type": "ERROR", "object": status}

        async def events() -> AsyncIterator[bytes]:
            nonlocal pos
            self._watch_wakers.add(waker)
            try:
                if too_old is not None:
                    yield line(gone(too_old))
                    return
                for e in initial:
                    yield line(e)
                if send_initial:
                    yield line(bookmark(pos, initial_end=True))
                start = loop.time()
                deadline = start + timeout if timeout else None
                next_bookmark = start + self.bookmark_interval
                while not self._closing:
                    wake.clear()
                    with self.store.lock:
                        changes = self.store.changes_since(pos, res.plural, open_watch=True)
                        latest = self.store.resource_version
                    if changes is None:
                        yield line(gone(pos))
                        return
                    for c in changes:
                        ev = self.api.watch_event(c, res, ns, m)
                        if ev is not None:
                            yield line(ev)
                    pos = max(pos, latest)
                    now = loop.time()
                    if deadline is not None and now >= deadline:
                        return
                    if bookmarks and now >= next_bookmark:
                        yield line(bookmark(pos))
                        next_bookmark = now + self.bookmark_interval
                    wait = 0.25
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    if bookmarks:
                        wait = min(wait, max(0.0, next_bookmark - now))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), timeout=max(wait, 0.001))
            finally:
                self.store.remove_listener(listener)
                self._watch_wakers.discard(waker)

        return StreamingResponse(events(), media_type="application/json")


def _ready_condition(ready: bool) -> Obj:
    now = now_rfc3339()
    return {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletNotReady",
        "message": "kubelet is posting ready status" if ready else "container runtime is down",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


__all__ = ["FakeKube", "Fault", "RequestRecord"]
