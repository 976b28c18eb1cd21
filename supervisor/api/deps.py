"""Shared request dependencies: bearer-token checks (the parts they read come from
supervisor/api/parts.py)."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from supervisor.api.parts import Refusals, SettingsDep
from supervisor.identity.authenticator import AgentAuthenticator, Principal, ReviewUnavailable

# Dependencies are `async def`: FastAPI runs plain `def` ones in a thread pool, which
# costs more than the checks themselves.
bearer = HTTPBearer(
    auto_error=False,
    description="Agent credential (shared token, node credential or service account token) "
    "for heartbeats and checkpoint reports; operator token for everything else.",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


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


async def require_agent(
    request: Request, refusals: Refusals, credentials: Credentials
) -> Principal:
    """Who the host monitor is (supervisor/identity): the node it may speak for. A route
    that takes reports for a node checks it with `check_node`."""
    agents: AgentAuthenticator = request.app.state.agents
    token = credentials.credentials.encode() if credentials is not None else b""
    try:
        principal = await agents.authenticate(token) if token else None
    except ReviewUnavailable as exc:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"cannot check the token now: {exc}",
            headers={"Retry-After": "1"},
        ) from None
    if principal is None:
        refusals["invalid_credential"] += 1
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


def check_node(refusals: dict[str, int], principal: Principal, node: str, field: str) -> None:
    """403 (counted in `refusals`) unless `principal` may speak for `node`, which came in
    `field`."""
    if principal.node is not None and node != principal.node:
        refusals["other_node"] += 1
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"{field}: {node!r} is not the node of this credential ({principal.node!r})",
        )


async def require_operator(settings: SettingsDep, credentials: Credentials) -> None:
    _check(credentials, settings.operator_token)


async def require_reader(settings: SettingsDep, credentials: Credentials) -> None:
    if settings.read_requires_token:
        _check(credentials, settings.operator_token)


async def require_fault_injection(settings: SettingsDep) -> None:
    if not settings.enable_fault_injection:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "fault injection is disabled (set enable_fault_injection to turn it on)",
        )


AgentDep = Annotated[Principal, Depends(require_agent)]
Operator = Depends(require_operator)
Reader = Depends(require_reader)
FaultInjection = Depends(require_fault_injection)
