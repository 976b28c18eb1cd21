"""The FastAPI application: routes, error format, OpenAPI, and the supervisor's lifespan."""

from __future__ import annotations

import gc
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from resiliency_protocol.heartbeat_batch import BATCH_PATH as HEARTBEAT_BATCHES
from supervisor import dashboard
from supervisor.api import openapi
from supervisor.api.errors import database_unavailable, http_error, validation_error
from supervisor.api.job_metrics import JobMetrics, Sources
from supervisor.api.parts import HeartbeatParts
from supervisor.api.routes import (
    actions,
    budget,
    checkpoints,
    cluster,
    events,
    faults,
    goodput,
    health,
    info,
    local_hosts,
    maintenance,
    notifications,
    peer_probes,
    stream,
)
from supervisor.api.routes.heartbeat_batch import HeartbeatBatchEndpoint
from supervisor.api.routes.heartbeats import PATH as HEARTBEATS
from supervisor.api.routes.heartbeats import HeartbeatEndpoint
from supervisor.config import Settings
from supervisor.config_parts import AccessSettings
from supervisor.identity.authenticator import AgentAuthenticator, TokenReviewer
from supervisor.runtime import Supervisor
from supervisor.store import UNAVAILABLE

log = logging.getLogger(__name__)

#: The access settings, alone or within the whole `Settings` (given back as they came).
Access = TypeVar("Access", bound=AccessSettings)


def with_tokens(settings: Access) -> Access:
    """Never serve without tokens: generate the missing ones and say so once (the agent
    token only where `agent_auth` takes it)."""
    update: dict[str, Any] = {}
    names = ["operator_token"]
    if "shared" in settings.agent_auth:
        names.insert(0, "agent_token")
    for name in names:
        if getattr(settings, name) is None:
            token = secrets.token_urlsafe(32)
            update[name] = SecretStr(token)
            log.warning("%s not set; generated one for this run: %s", name, token)
    return settings.model_copy(update=update) if update else settings


class SupervisorApp(FastAPI):
    """FastAPI, except that heartbeats skip its routing, middleware and telemetry: at
    thousands of requests per second those cost more than the heartbeat itself."""

    heartbeats: HeartbeatEndpoint
    heartbeat_batches: HeartbeatBatchEndpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["path"] == HEARTBEATS:
                await self.heartbeats(scope, receive, send)
                return
            if scope["path"] == HEARTBEAT_BATCHES:  # a relay's: many nodes' at once
                await self.heartbeat_batches(scope, receive, send)
                return
            supervisor = self.heartbeats.supervisor
            if not supervisor.ready and scope["path"].startswith("/api/"):
                # A standby (or a replica starting or stopping) takes no requests: say so
                # rather than answer from a runtime that is not running.
                refusal = JSONResponse(supervisor.readiness, 503, headers={"Retry-After": "1"})
                await refusal(scope, receive, send)
                return
            if _declared_length(scope) > openapi.MAX_BODY_BYTES:
                # FastAPI's own limit answers this one in plain text; a body sent without
                # a length is cut off by it, as an HTTPException, in our error format.
                message = f"body larger than {openapi.MAX_BODY_BYTES} bytes"
                too_large = JSONResponse({"message": message, "detail": message}, 413)
                await too_large(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _declared_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # the server refuses a malformed length itself
    return 0


#: CPython's gc thresholds, raised from (700, 10, 10): see tune_garbage_collector.
GC_THRESHOLDS = (50_000, 50, 1000)


def tune_garbage_collector() -> None:
    """Collect less often.

    Each heartbeat allocates a few short-lived objects; at CPython's default thresholds
    that triggers collections every few dozen heartbeats, and the frequent older-
    generation passes walk every node's long-lived records (raising only the first
    threshold measured no gain; `gc.freeze()` made it worse). Measured with `make
    bench`: heartbeat ingest went from about 15k to 23k req/s, 40% to 56-60% of the
    bare-ASGI ceiling. Memory held by garbage cycles
    grows by at most a few MB between collections.
    """
    gc.set_threshold(*GC_THRESHOLDS)


def job_metric_sources(runtime: Supervisor) -> Sources:
    """The parts the per-job series read, handed over here where the runtime is wired
    (the store and the controller exist once it has started)."""
    return Sources(
        ready=lambda: runtime.ready,
        sensor=runtime.sensor,
        settings=runtime.settings,
        metrics=runtime.metrics,
        backend=runtime.backend,
        store=lambda: runtime.store,
        budgets=lambda: runtime.controller.budgets,
    )


def create_app(
    settings: Settings,
    supervisor: Supervisor | None = None,
    *,
    token_reviewer: TokenReviewer | None = None,
) -> SupervisorApp:
    """`token_reviewer`: how service account tokens are reviewed (agent_auth kubernetes);
    None: a TokenReview through the Kubernetes API (supervisor/kube/token_review.py)."""
    settings = with_tokens(settings)
    runtime = supervisor or Supervisor(settings)
    if "kubernetes" in settings.agent_auth and token_reviewer is None:
        from supervisor.kube.token_review import KubeTokenReviewer  # the client, only if used

        token_reviewer = KubeTokenReviewer.from_settings(settings)
    agents = AgentAuthenticator(settings.access, token_reviewer)
    leadership = None
    if settings.leader_election:
        from supervisor.kube.leader import Leadership  # the kubernetes client, only if used

        leadership = Leadership(settings, runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if leadership is None:
            await runtime.start()
        else:
            await leadership.start()  # serve as a standby until the Lease is won
        tune_garbage_collector()
        try:
            yield
        finally:
            await (runtime.stop() if leadership is None else leadership.stop())
            await agents.close()

    app = SupervisorApp(
        title="Resiliency supervisor",
        version="0.1.0",
        summary="Detects failures of ML training jobs and heals them by policy.",
        lifespan=lifespan,
        max_body_size=openapi.MAX_BODY_BYTES,
    )
    app.state.supervisor = runtime
    # Per-job series beside the supervisor's own; /metrics brings them up to date.
    app.state.job_metrics = JobMetrics(job_metric_sources(runtime))
    runtime.metrics.registry.register(app.state.job_metrics)
    app.state.settings = settings
    app.state.agents = agents
    modules = (events, actions, cluster, budget, faults, health, info, stream, checkpoints, goodput)
    for module in modules:
        app.include_router(module.router)
    app.include_router(notifications.router)
    app.include_router(maintenance.router)
    app.include_router(local_hosts.router)
    app.include_router(peer_probes.router)
    dashboard.mount(app)
    app.heartbeats = HeartbeatEndpoint(runtime, HeartbeatParts.of(runtime), agents)
    app.heartbeat_batches = HeartbeatBatchEndpoint(app.heartbeats)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for unavailable in UNAVAILABLE:
        app.add_exception_handler(unavailable, database_unavailable)
    app.openapi = lambda: openapi.build(app)  # type: ignore[method-assign]
    return app
