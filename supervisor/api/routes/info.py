"""What a client needs to know about this supervisor before it draws anything: which
features are on and whether the caller holds the operator token."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from resiliency_protocol.fault_params import params_model
from resiliency_protocol.faults import SENSOR_FAULT_KINDS, FaultKind
from supervisor.api.deps import Credentials, Reader
from supervisor.api.parts import BackendDep, SettingsDep, SupervisorDep

router = APIRouter(prefix="/api/v1", tags=["info"], dependencies=[Reader])


class InfoOut(BaseModel):
    version: str
    backend: str
    dry_run: bool
    read_requires_token: bool
    enable_fault_injection: bool
    fault_kinds: list[str] = Field(description="Fault kinds this backend can inject.")
    fault_params: dict[str, list[str]] = Field(
        description="The parameters each of those kinds takes (the protocol's table)."
    )
    operator: bool = Field(description="The request carries the operator token.")
    heartbeat_timeout_s: float


@router.get("/info", response_model=InfoOut, summary="Features and the caller's rights")
async def info(
    supervisor: SupervisorDep,
    settings: SettingsDep,
    backend: BackendDep,
    credentials: Credentials,
    request: Request,
) -> InfoOut:
    expected = settings.operator_token
    operator = (
        credentials is not None
        and expected is not None
        and secrets.compare_digest(
            credentials.credentials.encode(), expected.get_secret_value().encode()
        )
    )
    kinds = sorted(SENSOR_FAULT_KINDS | backend.process_faults)
    return InfoOut(
        version=request.app.version,
        backend=backend.name,
        dry_run=supervisor.dry_run,
        read_requires_token=settings.read_requires_token,
        enable_fault_injection=settings.enable_fault_injection,
        fault_kinds=kinds,
        fault_params={kind: _params(kind) for kind in kinds},
        operator=operator,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
    )


def _params(kind: FaultKind) -> list[str]:
    model = params_model(kind)
    return [] if model is None else list(model.model_fields)
