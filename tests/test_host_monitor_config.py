"""Host monitor settings: flags over environment over defaults, one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from host_monitor.cli import _parser
from host_monitor.config import (
    ConfigError,
    HostMonitorSettings,
    env_without_secrets,
    load_settings,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("HOST_MONITOR_"):
            monkeypatch.delenv(key)


def test_defaults_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(node="n1")
    assert settings.host_daemon_port == 9400 and settings.host == "127.0.0.1"
    assert settings.heartbeat_polling_period_s == 5.0
    assert settings.worker_heartbeat_timeout_s == 10.0
    assert settings.initial_state == "spare" and settings.job is None
    assert settings.kernel_log is None and settings.nvidia_smi == "nvidia-smi"
    assert settings.watchdog_period_s == 10.0 and settings.gpu_report_cooldown_s == 60.0

    monkeypatch.setenv("HOST_MONITOR_NODE", "from-env")
    monkeypatch.setenv("HOST_MONITOR_HOST_DAEMON_PORT", "0")
    monkeypatch.setenv("HOST_MONITOR_URL", "http://127.0.0.1:1")  # a worker's env, ignored
    args = vars(_parser().parse_args(["--port", "9500", "--run-dir", "/tmp/x"]))
    settings = load_settings(**args)
    assert settings.node == "from-env"  # no flag: the environment
    assert settings.host_daemon_port == 9500  # the flag wins
    assert settings.run_dir == Path("/tmp/x")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "missing setting 'node' (flag --node or env HOST_MONITOR_NODE)"),
        ({"node": "a b"}, "invalid setting 'node': String should match pattern"),
        ({"node": "n", "host_daemon_port": "70000"}, "invalid setting 'host_daemon_port'"),
        ({"node": "n", "initial_state": "running"}, "job is required when initial_state"),
        ({"node": "n", "job": "j"}, "a spare node has no job"),
        (
            {"node": "n", "supervisor_url": "http://s:1"},
            "one of agent_token, node_credential, node_credential_file, "
            "service_account_token_file is required with supervisor_url",
        ),
        (
            {"node": "n", "agent_token": "t", "service_account_token_file": "/t"},
            "give one credential for the supervisor, not ['agent_token', "
            "'service_account_token_file']",
        ),
        (
            {"node": "n1", "node_credential": "node.n2.abc"},
            "node_credential is not the credential of node n1",
        ),
        ({"node": "n", "supervisor_url": "ftp://s"}, "invalid setting 'supervisor_url'"),
        (
            {"node": "n", "agent_token": "same", "worker_token": "same"},
            "agent_token (or node_credential), actuator_token and worker_token must differ",
        ),
    ],
)
def test_invalid_settings_are_one_line(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(**overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_workers_do_not_inherit_our_tokens() -> None:
    env = {"PATH": "/bin", "HOST_MONITOR_AGENT_TOKEN": "secret", "HOST_MONITOR_NODE": "n"}
    assert env_without_secrets(env) == {"PATH": "/bin"}


def test_every_setting_is_in_the_readme_table() -> None:
    readme = (Path(__file__).parent.parent / "host_monitor" / "README.md").read_text()
    for name, field in HostMonitorSettings.model_fields.items():
        default = field.default
        shown = "required" if field.is_required() else "unset" if default is None else default
        row = f"| `{name}` | `HOST_MONITOR_{name.upper()}` | `{shown}` |"
        assert row in readme, f"host_monitor/README.md lacks or misstates setting {name}"
        assert field.description, f"setting {name} has no description"
