"""Every backend's action table names every action type: a handler, or a refusal by
name. A new ActionType member that some backend forgets fails here, not in production."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import supervisor
from supervisor.action_effects import EFFECTS
from supervisor.actuator.backend import ActionError, Backend, Refused, dispatch
from supervisor.actuator.dry_run import DryRunBackend
from supervisor.domain import ActionType
from supervisor.kube.backend import KubeBackend
from supervisor.local.backend import LocalBackend
from supervisor.simulate.backend import SimulatedBackend
from tests.conftest import SettingsFactory
from tests.kube.harness import action


def _subclasses(cls: type[Backend]) -> Iterator[type[Backend]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def supervisor_backends() -> list[type[Backend]]:
    """Every Backend the supervisor package defines (every module imported first, so a
    new backend is found without being listed here)."""
    for module in pkgutil.walk_packages(supervisor.__path__, "supervisor."):
        importlib.import_module(module.name)
    return sorted(
        (b for b in _subclasses(Backend) if b.__module__.startswith("supervisor.")),
        key=lambda b: b.name,
    )


def test_every_backend_is_found() -> None:
    found = set(supervisor_backends())
    assert {DryRunBackend, LocalBackend, KubeBackend, SimulatedBackend} <= found


@pytest.mark.parametrize("backend", supervisor_backends(), ids=lambda b: b.name)
def test_every_action_type_is_handled_or_refused(backend: type[Backend]) -> None:
    assert "actions" in vars(backend), f"the {backend.name} backend declares no action table"
    missing = [t.value for t in ActionType if t not in backend.actions]
    assert not missing, f"the {backend.name} backend's table lacks {missing}"
    for type_, entry in backend.actions.items():
        assert isinstance(entry, Refused) or callable(entry), (backend.name, type_)


def _refusals() -> list[tuple[type[Backend], ActionType]]:
    return [
        (backend, type_)
        for backend in supervisor_backends()
        for type_, entry in backend.actions.items()
        if isinstance(entry, Refused)
    ]


def test_the_local_backend_refuses_force_delete() -> None:
    assert (LocalBackend, ActionType.FORCE_DELETE_POD) in _refusals()


@pytest.mark.parametrize(
    ("backend", "type_"), _refusals(), ids=lambda x: getattr(x, "name", str(x))
)
async def test_a_refused_type_is_refused_by_name(backend: type[Backend], type_: ActionType) -> None:
    entry = backend.actions[type_]
    assert isinstance(entry, Refused) and entry.why
    # The handler is never reached: no backend instance is needed to refuse.
    target: Any = None
    with pytest.raises(ActionError) as refused:
        await dispatch(backend.name, backend.actions, target, action(type_))
    message = str(refused.value)
    assert backend.name in message and type_.value in message and entry.why in message
    assert not refused.value.retryable


async def test_a_type_missing_from_a_table_is_refused_by_name() -> None:
    with pytest.raises(ActionError, match="the kubernetes backend cannot scale_up"):
        await dispatch("kubernetes", {}, None, action(ActionType.SCALE_UP))


async def test_the_local_backend_refuses_through_execute(
    tmp_path: Path, make_settings: SettingsFactory
) -> None:
    backend = LocalBackend(tmp_path / "run", make_settings(host_monitor_actuator_token="t"))
    try:
        with pytest.raises(ActionError, match="the local backend cannot force_delete_pod"):
            await backend.execute(action(ActionType.FORCE_DELETE_POD, pod="p"))
        assert not backend.cluster.state.done_keys
    finally:
        await backend.close()


def test_every_action_type_has_its_effect_on_the_sensor() -> None:
    """What a finished action changes in the sensor's picture is listed for every type,
    a type that changes nothing too."""
    missing = [t.value for t in ActionType if t not in EFFECTS]
    assert not missing, f"supervisor/action_effects.py lacks {missing}"
