"""Shared request dependencies: the running supervisor and bearer-token checks."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from supervisor.runtime import Supervisor

# Dependencies are `async def`: FastAPI runs plain `def` ones in a thread pool, which
# costs more than the checks themselves.
bearer = HTTPBearer(
    auto_error=False,
    description="Agent token for heartbeats; operator token for everything else.",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


async def get_supervisor(request: Request) -> Supervisor:
    supervisor: Supervisor = request.app.state.supervisor
    return supervisor


SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]


def _check(credentials: HTTPAuthorizationCredentials | None, expected: SecretStr | None) -> None:
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if expected is None or not secrets.compare_digest(
        credentials.credentials.encode(), expected.get_secret_value().encode()
    ):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_agent(supervisor: SupervisorDep, credentials: Credentials) -> None:
    _check(credentials, supervisor.settings.agent_token)


async def require_operator(supervisor: SupervisorDep, credentials: Credentials) -> None:
    _check(credentials, supervisor.settings.operator_token)


async def require_reader(supervisor: SupervisorDep, credentials: Credentials) -> None:
    if supervisor.settings.read_requires_token:
        _check(credentials, supervisor.settings.operator_token)


async def require_fault_injection(supervisor: SupervisorDep) -> None:
    if not supervisor.settings.enable_fault_injection:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "fault injection is disabled (set enable_fault_injection to turn it on)",
        )


Agent = Depends(require_agent)
Operator = Depends(require_operator)
Reader = Depends(require_reader)
FaultInjection = Depends(require_fault_injection)
