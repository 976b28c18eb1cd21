"""The host monitor's local HTTP API (bodies: resiliency_protocol.worker_wire,
node_commands, checkpoint_reports and emergency).

Two bearer tokens, two audiences: workers on this node (`worker_token`) call
`/v1/workers/...`; the supervisor's actuator (`actuator_token`) calls everything else.
Errors: 401 for a missing or wrong token, 422 naming each bad field (the supervisor's
format: `{"message": "field: problem", "detail": [...]}`), 404 for an unknown rank or
emergency round, 409 when the request does not fit the workers' current state.
"""

from __future__ import annotations

import os
import secrets
from typing import Annotated, Any

from fastapi import (
    APIRouter,
    BackgroundTasks,
    Depends,
    FastAPI,
    Header,
    HTTPException,
    Request,
    status,
)
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from host_monitor.emergency import UnknownRound
from host_monitor.error_handlers import http_error, validation_error
from host_monitor.fault_actor import NODE_DOWN_EXIT_CODE, FaultActor
from host_monitor.leader_fence import LeaderFence, StaleLeaderRefused, stale_leader_error
from host_monitor.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from host_monitor.metrics import HostMonitorMetrics
from host_monitor.node import Node
from host_monitor.peer.routes import peer_router
from host_monitor.peer.tier import PeerTier
from host_monitor.peer.worker_routes import peer_actuator_router, peer_worker_router
from host_monitor.request_checks import InvalidRequest
from host_monitor.workers import WorkerConflict, WorkerNotFound
from resiliency_protocol.checkpoint_reports import (
    REPORT_KEY_HEADER,
    REPORT_KEY_PATTERN,
    CheckpointRecordOut,
    CheckpointReport,
)
from resiliency_protocol.emergency import (
    AckReply,
    EmergencyAck,
    EmergencyCheckpointRequest,
    EmergencyCheckpointResult,
    EmergencyPending,
)
from resiliency_protocol.node_commands import (
    AssignWorldRequest,
    AssignWorldResult,
    FaultOutcome,
    NodeStatus,
    ProcessFault,
    RejoinRequest,
    RejoinResult,
    StandbyRequest,
    StandbyResult,
    StartWorkersRequest,
    StopWorkersRequest,
    StopWorkersResult,
    WorkerStatus,
)
from resiliency_protocol.worker_wire import (
    ProgressReply,
    WorkerEmergencyCheckpoints,
    WorkerFinishing,
    WorkerProgress,
    WorkerRegistration,
    WorkerStopping,
    WorldAssignment,
)

Rank = Annotated[int, PathParam(ge=0, description="Global rank of the worker.")]
ReportKey = Annotated[
    str | None,
    Header(
        alias=REPORT_KEY_HEADER,
        pattern=REPORT_KEY_PATTERN,
        description="The worker's name for the report: sent again, it is kept once.",
    ),
]

_bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _require(expected: str, *others: str) -> Any:
    def check(credentials: Credentials) -> None:
        if credentials is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        given = credentials.credentials.encode()
        if not any(secrets.compare_digest(given, t.encode()) for t in (expected, *others)):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "invalid bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return Depends(check)


def create_app(
    node: Node,
    faults: FaultActor,
    *,
    worker_token: str,
    actuator_token: str,
    peer: PeerTier | None = None,
    metrics: HostMonitorMetrics | None = None,
    metrics_token: str | None = None,
) -> FastAPI:
    app = FastAPI(
        title="Host monitor",
        version="0.1.0",
        summary=f"Local API of the host monitor of node {node.name}.",
    )
    workers = APIRouter(
        prefix="/v1/workers", tags=["workers"], dependencies=[_require(worker_token)]
    )
    # Judged after the token: only the supervisor may raise the newest epoch.
    fence = LeaderFence()
    app.state.leader_fence = fence
    obeyed = [_require(actuator_token), Depends(fence.check)]
    actuator = APIRouter(prefix="/v1", tags=["actuator"], dependencies=obeyed)

    # --- worker-facing ----------------------------------------------------------------

    @workers.post("/register", response_model=WorkerStatus, summary="A worker announces itself")
    async def register(body: WorkerRegistration) -> WorkerStatus:
        return node.register(body)

    @workers.post(
        "/{rank}/stopping",
        response_model=WorkerStatus,
        summary="The worker was told to stop (SIGTERM): its exit is `stopped`, not a failure",
    )
    async def stopping(rank: Rank, body: WorkerStopping) -> WorkerStatus:
        return node.stopping(rank, body)

    @workers.post(
        "/{rank}/finishing",
        response_model=WorkerStatus,
        summary="The worker left its training loop and is finishing: not watched for hangs",
    )
    async def finishing(rank: Rank, body: WorkerFinishing) -> WorkerStatus:
        return node.finishing(rank, body)

    @workers.post("/{rank}/progress", response_model=ProgressReply, summary="Step done")
    async def progress(rank: Rank, body: WorkerProgress) -> ProgressReply:
        return node.progress(rank, body)

    @workers.get(
        "/{rank}/world",
        response_model=WorldAssignment,
        summary="The world to join without restarting (in-process restart), if any",
    )
    async def world(rank: Rank) -> WorldAssignment:
        return node.world(rank)

    @workers.post(
        "/{rank}/checkpoints",
        status_code=status.HTTP_202_ACCEPTED,
        summary="A checkpoint was saved or loaded",
    )
    async def checkpoint(
        rank: Rank, body: CheckpointReport, key: ReportKey = None
    ) -> dict[str, bool]:
        node.checkpoint(rank, body, key)
        return {"accepted": True}

    @workers.get(
        "/{rank}/emergency",
        response_model=EmergencyPending,
        summary="Which emergency checkpoint round waits for this worker",
    )
    async def emergency_pending(rank: Rank) -> EmergencyPending:
        node.registry.get(rank)
        pending = node.rounds.pending(rank)
        if pending is None:
            return EmergencyPending(request_id=None, remaining_s=None)
        return EmergencyPending(request_id=pending[0], remaining_s=round(pending[1], 3))

    @workers.post(
        "/{rank}/emergency-checkpoints",
        response_model=WorkerStatus,
        summary="The worker takes emergency checkpoints from now on, or no longer does",
    )
    async def emergency_checkpoints(rank: Rank, body: WorkerEmergencyCheckpoints) -> WorkerStatus:
        return node.rounds.set_taking(rank, body).status()

    @workers.post("/{rank}/emergency-ack", response_model=AckReply, summary="Emergency save done")
    async def emergency_ack(rank: Rank, body: EmergencyAck) -> AckReply:
        node.registry.get(rank)
        request_id, accepted = node.rounds.ack(rank, body)
        return AckReply(request_id=request_id, accepted=accepted)

    # --- actuator-facing --------------------------------------------------------------

    @actuator.post(
        "/emergency-checkpoint",
        response_model=EmergencyCheckpointResult,
        summary="SIGUSR1 the workers and wait for their acks (idempotent by request_id)",
    )
    async def emergency_checkpoint(body: EmergencyCheckpointRequest) -> EmergencyCheckpointResult:
        return await node.rounds.run(body)

    @actuator.post(
        "/workers/start",
        response_model=NodeStatus,
        summary="Launch the job's workers on this node (idempotent by request_id)",
    )
    async def start_workers(body: StartWorkersRequest) -> NodeStatus:
        return await node.start_workers(body)

    @actuator.post(
        "/workers/rejoin",
        response_model=RejoinResult,
        summary="Give the live workers a new world to join in-process (idempotent by request_id)",
    )
    async def rejoin_workers(body: RejoinRequest) -> RejoinResult:
        return await node.rejoin(body)

    @actuator.post(
        "/workers/world",
        response_model=AssignWorldResult,
        summary="The world of one rank's instance, registered yet or not (idempotent by "
        "request_id)",
    )
    async def assign_world(body: AssignWorldRequest) -> AssignWorldResult:
        return node.assign_world(body)

    @actuator.post(
        "/standby",
        response_model=StandbyResult,
        summary="Have a warm standby of the job's command ready on this node (idempotent)",
    )
    async def prepare_standby(body: StandbyRequest) -> StandbyResult:
        return node.prepare_standby(body)

    @actuator.post(
        "/workers/stop",
        response_model=StopWorkersResult,
        summary="SIGTERM the workers, SIGKILL after grace_s; release makes the node a spare",
    )
    async def stop_workers(body: StopWorkersRequest) -> StopWorkersResult:
        return await node.stop_workers(body)

    @actuator.get("/status", response_model=NodeStatus, summary="The node and its workers")
    async def get_status() -> NodeStatus:
        return node.status()

    @actuator.get(
        "/checkpoints",
        response_model=list[CheckpointRecordOut],
        summary="The last checkpoints the workers reported, oldest first",
    )
    async def get_checkpoints() -> list[CheckpointRecordOut]:
        return [
            CheckpointRecordOut(rank=c.rank, time=c.time, report=c.report) for c in node.checkpoints
        ]

    @actuator.post(
        "/faults",
        response_model=FaultOutcome,
        status_code=status.HTTP_202_ACCEPTED,
        summary="Act out a fault on this node's processes",
    )
    async def inject_fault(body: ProcessFault, background: BackgroundTasks) -> FaultOutcome:
        outcome = faults.apply(body)
        if outcome.exiting:
            # After the answer is sent: the caller learns what happened, then the node is gone.
            background.add_task(os._exit, NODE_DOWN_EXIT_CODE)
        return outcome

    @app.get("/healthz", tags=["health"], summary="Liveness (no token)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "node": node.name}

    if metrics is not None:
        metrics.sources.stale_leader_commands = lambda: fence.refused
        scrapers = (metrics_token,) if metrics_token else ()

        @app.get(
            "/metrics",
            tags=["metrics"],
            summary="This agent's metrics, Prometheus' text format (metrics or actuator token)",
            dependencies=[_require(actuator_token, *scrapers)],
        )
        async def prometheus() -> Response:
            return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    app.include_router(workers)
    app.include_router(actuator)
    if peer is not None:  # the peer checkpoint tier (peer/tier.py); it checks the peer token
        app.include_router(peer_worker_router(peer), dependencies=[_require(worker_token)])
        app.include_router(peer_actuator_router(peer), dependencies=obeyed)
        app.include_router(peer_router(peer))
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(InvalidRequest, _invalid_request)
    app.add_exception_handler(WorkerNotFound, _not_found)
    app.add_exception_handler(UnknownRound, _unknown_round)
    app.add_exception_handler(WorkerConflict, _conflict)
    app.add_exception_handler(StaleLeaderRefused, stale_leader_error)
    return app


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequest)
    detail = [{"loc": ["body", exc.field], "msg": exc.message, "type": "value_error"}]
    return JSONResponse({"message": str(exc), "detail": detail}, status_code=422)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, WorkerNotFound)
    return JSONResponse({"detail": f"no worker with rank {exc.args[0]} on this node"}, 404)


async def _unknown_round(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, UnknownRound)
    return JSONResponse({"detail": f"no emergency checkpoint round {exc.args[0]!r}"}, 404)


async def _conflict(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, 409)
