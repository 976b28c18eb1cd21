"""Every body that crosses between our own processes is declared in resiliency_protocol.

The routes of the host monitor (all of them: workers, the supervisor's actuator and the
partner host monitors call them) and the supervisor's routes for host monitors (those
that take the agent credential) must take and answer models of resiliency_protocol, so
that the two ends of a wire import one declaration. The operators' API (the other
supervisor routes) keeps its schemas in supervisor/api/. The heartbeat is served outside
FastAPI's routing (supervisor/api/app.py); its body is resiliency_protocol.heartbeat's.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import BaseModel

from host_monitor.config import load_settings
from host_monitor.fault_actor import FaultActor
from host_monitor.node import Node
from host_monitor.peer.tier import PeerTier
from host_monitor.server import create_app as host_monitor_app
from supervisor.api.app import create_app as supervisor_app
from supervisor.api.deps import require_agent
from supervisor.config import Settings

PROTOCOL = "resiliency_protocol"


def models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models an annotation names (in X | None, list[X], dict[int, X], ...)."""
    origin = typing.get_origin(annotation)
    if origin is None and isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from models_in(arg)


#: A route as served: its path and methods (with its routers' prefixes) and the route.
Served = tuple[str, frozenset[str], APIRoute]


def route_models(route: APIRoute) -> Iterator[tuple[str, type[BaseModel]]]:
    """(role, model) of what the route takes and answers, error answers included."""
    for param in route.dependant.body_params:
        for model in models_in(param.field_info.annotation):
            yield "body", model
    for model in models_in(route.response_model):
        yield "response", model
    for status, response in route.responses.items():
        for model in models_in(response.get("model") if isinstance(response, dict) else None):
            yield f"response {status}", model


def depends_on(dependant: Dependant, call: Any) -> bool:
    return dependant.call is call or any(depends_on(d, call) for d in dependant.dependencies)


def undeclared(routes: list[Served]) -> list[str]:
    return sorted(
        f"{sorted(methods)} {path} {role}: {model.__module__}.{model.__qualname__}"
        for path, methods, route in routes
        for role, model in route_models(route)
        if not model.__module__.startswith(PROTOCOL)
    )


def api_routes(app: FastAPI) -> list[Served]:
    """Every FastAPI route of `app`, through the routers it includes."""
    return [
        (str(context.path), frozenset(context.methods or ()), context.original_route)
        for context in iter_route_contexts(app.routes)
        if isinstance(context.original_route, APIRoute)
    ]


def test_models_in_finds_models_inside_annotations() -> None:
    class Inner(BaseModel):
        x: int

    found = list(models_in(dict[int, list[Inner]] | None))
    assert found == [Inner]
    assert list(models_in(int | None)) == []


def test_the_supervisors_routes_for_host_monitors_take_protocol_bodies() -> None:
    app = supervisor_app(Settings(database_url="sqlite://"))
    agents = [r for r in api_routes(app) if depends_on(r[2].dependant, require_agent)]
    # The test must see them: a route that stopped requiring the agent credential, or a
    # dependency renamed, would leave nothing to check.
    assert {(path, m) for path, methods, _ in agents for m in methods} >= {
        ("/api/v1/checkpoints", "POST"),
        ("/api/v1/local/hosts", "POST"),
    }
    assert undeclared(agents) == []


def test_every_host_monitor_route_takes_protocol_bodies(tmp_path: Path) -> None:
    settings = load_settings(
        node="n1",
        run_dir=tmp_path / "run",
        peer_token="peer-token",
        checkpoint_root=tmp_path / "ram",
        peer_store_dir=tmp_path / "peer",
    )
    node = Node(settings, "worker-token", "http://n1")
    # The routes' bodies do not depend on the fault actor: none is called here.
    app = host_monitor_app(
        node,
        cast(FaultActor, None),
        worker_token="worker-token",
        actuator_token="actuator-token",
        peer=PeerTier(settings, node),
    )
    routes = api_routes(app)
    paths = {path for path, _, _ in routes}
    assert {"/v1/workers/register", "/v1/workers/start", "/v1/checkpoint-peer"} <= paths
    assert sum(1 for _, _, r in routes for _ in route_models(r)) > 20
    assert undeclared(routes) == []


class Undeclared(BaseModel):
    x: int


def test_a_body_of_another_package_is_found() -> None:
    """The check itself: a route whose body is declared outside resiliency_protocol."""
    app = FastAPI()

    @app.post("/local", response_model=Undeclared)
    async def local(body: Undeclared) -> Undeclared:
        return body

    assert undeclared(api_routes(app)) == [
        f"['POST'] /local body: {__name__}.Undeclared",
        f"['POST'] /local response: {__name__}.Undeclared",
    ]


def test_the_operators_fault_kinds_are_the_protocols() -> None:
    """The operator API spells the fault kinds as plain strings (its 422 lists them so):
    the same values as the protocol's FaultKind, none missing, none added."""
    from resiliency_protocol.faults import FaultKind
    from supervisor.api.schemas.faults import FaultKind as OperatorKind

    assert set(typing.get_args(OperatorKind)) == {kind.value for kind in FaultKind}
