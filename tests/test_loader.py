"""Loading the user's policy by `module:Class` or by file path, and dispatch by `@handles`."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest

from policies.default import DefaultPolicy
from policies.examples.hot_swap_on_xid import HotSwapOnXid
from supervisor.controller.loader import PolicyLoadError, load_policy
from supervisor.domain import ActionType, Event, EventType
from supervisor.policy import Policy, PolicyContext, PolicyLimits

NOW = datetime(2025, 1, 1, tzinfo=UTC)
CTX = PolicyContext(
    now=NOW,
    limits=PolicyLimits(
        max_in_job_restarts=3,
        max_workload_restarts=0,
        enable_workload_scaling=False,
        restart_window_s=3600.0,
        max_restarts_in_window=10,
    ),
)

POLICY_FILE = """
from supervisor.domain import EventType
from supervisor.policy import Policy, actions, handles


class CordonOnXid(Policy):
    name = "cordon_on_xid"

    @handles(EventType.GPU_XID, EventType.GPU_ECC)
    def on_gpu(self, event, ctx):
        return [actions.cordon(event.node, reason=f"{event.type.value} on {event.node}")]

    @handles(EventType.HANG)
    def on_hang(self, event, ctx):
        return [actions.restart_workload(event.job, reason="hang")]

    def helper(self, event, ctx):  # not a handler
        raise AssertionError("not to be called")


class Stricter(CordonOnXid):
    @handles(EventType.HANG)
    def on_hang_differently(self, event, ctx):
        return []

    def on_gpu(self, event, ctx):  # overrides the inherited handler
        return super().on_gpu(event, ctx) * 2


class NotAPolicy:
    pass


def not_a_class():
    return None


class NeedsArguments(Policy):
    def __init__(self, threshold):
        self.threshold = threshold
"""


def event(type_: EventType, node: str | None = "n1", job: str | None = "j1") -> Event:
    return Event(type=type_, time=NOW, node=node, job=job)


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    return write(tmp_path / "my_policy.py", POLICY_FILE)


def load_error(spec: str) -> str:
    with pytest.raises(PolicyLoadError) as info:
        load_policy(spec)
    message = str(info.value)
    assert "\n" not in message and message
    assert spec in message
    return message


# --- loading ------------------------------------------------------------------------------


def test_load_by_module_and_class() -> None:
    policy = load_policy("policies.default:DefaultPolicy")
    assert type(policy) is DefaultPolicy
    assert type(load_policy("policies.examples.hot_swap_on_xid:HotSwapOnXid")) is HotSwapOnXid


def test_each_load_gives_a_fresh_instance() -> None:
    spec = "policies.default:DefaultPolicy"
    assert load_policy(spec) is not load_policy(spec)


def test_load_by_file_path(policy_file: Path) -> None:
    policy = load_policy(f"{policy_file}:CordonOnXid")
    assert isinstance(policy, Policy)
    assert type(policy).__name__ == "CordonOnXid"
    assert policy.name == "cordon_on_xid"


def test_load_by_relative_file_path(policy_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(policy_file.parent)
    policy = load_policy("my_policy.py:CordonOnXid")
    assert type(policy).__name__ == "CordonOnXid"


def test_policy_file_may_build_on_the_default(tmp_path: Path) -> None:
    path = write(
        tmp_path / "custom.py",
        """
        from policies.default import DefaultPolicy

        class Custom(DefaultPolicy):
            name = "custom"
        """,
    )
    policy = load_policy(f"{path}:Custom")
    assert isinstance(policy, DefaultPolicy) and policy.name == "custom"


# --- errors -------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    message = load_error(f"{tmp_path}/absent.py:Policy")
    assert "file not found" in message


def test_syntax_error_in_file(tmp_path: Path) -> None:
    path = write(tmp_path / "broken.py", "class Broken(:\n    pass\n")
    message = load_error(f"{path}:Broken")
    assert "SyntaxError" in message


def test_error_raised_while_importing_file(tmp_path: Path) -> None:
    path = write(tmp_path / "raising.py", "raise RuntimeError('no GPU driver')\n")
    message = load_error(f"{path}:X")
    assert "RuntimeError" in message and "no GPU driver" in message


@pytest.mark.parametrize(
    ("class_name", "fragment"),
    [
        ("NotAPolicy", "not a subclass of supervisor.policy.Policy"),
        ("not_a_class", "not a subclass of supervisor.policy.Policy"),
        # Named for what it is, with the policies the file does define.
        ("Missing", "has no Missing (its policies: CordonOnXid, NeedsArguments, Stricter)"),
        ("NeedsArguments", "NeedsArguments() failed"),
    ],
)
def test_not_a_usable_policy_class(policy_file: Path, class_name: str, fragment: str) -> None:
    assert fragment in load_error(f"{policy_file}:{class_name}")


def test_not_a_policy_in_a_module() -> None:
    assert "not a subclass" in load_error("supervisor.domain:Event")


@pytest.mark.parametrize(
    "spec",
    ["policies.default", "policies.default:", ":DefaultPolicy", "", "/tmp/some_file.py"],
)
def test_bad_spec(spec: str) -> None:
    assert "expected 'module:Class'" in load_error(spec)


def test_module_that_cannot_be_imported() -> None:
    message = load_error("no_such_package_xyz.policy:Policy")
    assert "cannot import" in message and "no_such_package_xyz" in message


@pytest.mark.parametrize(
    "source",
    ["class Broken(:\n    pass\n", "raise RuntimeError('no GPU driver')\n"],
    ids=["syntax-error", "raises"],
)
def test_module_that_fails_to_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    module = f"broken_policy_{abs(hash(source))}"
    write(tmp_path / f"{module}.py", source)
    monkeypatch.syspath_prepend(str(tmp_path))
    load_error(f"{module}:Broken")


# --- dispatch -----------------------------------------------------------------------------


def test_handles_dispatches_by_event_type(policy_file: Path) -> None:
    policy = load_policy(f"{policy_file}:CordonOnXid")

    [xid] = policy.event_policy(event(EventType.GPU_XID), CTX)
    assert (xid.type, xid.node, xid.reason) == (ActionType.CORDON, "n1", "gpu_xid on n1")
    [ecc] = policy.event_policy(event(EventType.GPU_ECC, node="n2"), CTX)
    assert (ecc.type, ecc.node) == (ActionType.CORDON, "n2")
    [hang] = policy.event_policy(event(EventType.HANG, node=None), CTX)
    assert (hang.type, hang.job) == (ActionType.RESTART_WORKLOAD, "j1")


def test_unhandled_event_types_give_no_actions(policy_file: Path) -> None:
    policy = load_policy(f"{policy_file}:CordonOnXid")
    handled = {EventType.GPU_XID, EventType.GPU_ECC, EventType.HANG}
    for type_ in EventType:
        if type_ not in handled:
            assert policy.event_policy(event(type_), CTX) == []


def test_handlers_are_inherited_and_overridable(policy_file: Path) -> None:
    policy = load_policy(f"{policy_file}:Stricter")
    # A handler re-registered in the subclass wins for its event type ...
    assert policy.event_policy(event(EventType.HANG), CTX) == []
    # ... and overriding the method of an inherited handler keeps it registered.
    actions = policy.event_policy(event(EventType.GPU_XID), CTX)
    assert [a.type for a in actions] == [ActionType.CORDON, ActionType.CORDON]


def test_base_policy_handles_nothing() -> None:
    class Empty(Policy):
        pass

    for type_ in EventType:
        assert Empty().event_policy(event(type_), CTX) == []
        assert Policy().event_policy(event(type_), CTX) == []
