"""Settings: defaults, environment, YAML file, precedence, and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from supervisor.config import CONFIG_FILE_ENV, ConfigError, Settings, load_settings
from supervisor.config_parts import SensingSettings, ServiceSettings, TlsSettings, WorkloadSettings

SUPERVISOR_BIN = Path(sys.executable).parent / "supervisor"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SUPERVISOR_* variable leaks in from the outside or out of a test.

    load_settings() writes SUPERVISOR_CONFIG_FILE into os.environ itself; setting it
    through monkeypatch first makes monkeypatch restore the original state afterwards.
    """
    monkeypatch.setenv(CONFIG_FILE_ENV, "placeholder")
    for name in list(os.environ):
        if name.upper().startswith("SUPERVISOR_"):
            monkeypatch.delenv(name)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def config_error(**kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**kw)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


# --- sources ------------------------------------------------------------------------------


def test_defaults() -> None:
    s = load_settings()
    assert s.heartbeat_polling_period_s == 5.0
    assert s.heartbeat_timeout_s == 15.0
    assert s.hang_timeout_s is None
    assert s.hang_min_timeout_s == 60.0
    assert s.hang_safety_factor == 5.0
    assert s.hang_warmup_intervals == 5
    assert (s.flap_window_s, s.flap_max_losses) == (300.0, 3)
    assert s.gpu_report_cooldown_s == 60.0
    assert (s.num_dp_replicas, s.min_num_dp_replicas, s.max_num_dp_replicas) == (4, 2, 4)
    assert s.num_nodes_per_dp == 4
    assert (s.max_in_job_restarts, s.max_workload_restarts) == (3, 0)
    assert s.enable_workload_scaling is False
    assert (s.restart_window_s, s.max_restarts_in_window) == (3600.0, 30)
    assert s.max_no_progress_restarts == 3
    assert s.action_max_attempts == 3
    assert s.backend == "dry_run" and s.dry_run is False
    assert s.policy == "policies.default:DefaultPolicy"
    assert s.enable_fault_injection is False
    assert s.database_url == "sqlite:///./var/supervisor.db"
    assert s.agent_token is None and s.operator_token is None
    assert s.read_requires_token is True
    assert (s.host, s.port, s.log_level) == ("127.0.0.1", 8080, "info")
    assert s.model_fields_set == set()


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERVISOR_HEARTBEAT_TIMEOUT_S", "30")
    monkeypatch.setenv("SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S", "2.5")
    monkeypatch.setenv("SUPERVISOR_HANG_TIMEOUT_S", "120")
    monkeypatch.setenv("SUPERVISOR_ENABLE_WORKLOAD_SCALING", "true")
    monkeypatch.setenv("SUPERVISOR_NUM_DP_REPLICAS", "3")
    monkeypatch.setenv("SUPERVISOR_AGENT_TOKEN", "agent-secret")
    monkeypatch.setenv("SUPERVISOR_POLICY", "policies.examples.hot_swap_on_xid:HotSwapOnXid")
    monkeypatch.setenv("SUPERVISOR_LOG_LEVEL", "debug")

    s = load_settings()

    assert s.heartbeat_timeout_s == 30.0
    assert s.heartbeat_polling_period_s == 2.5
    assert s.hang_timeout_s == 120.0
    assert s.enable_workload_scaling is True
    assert s.num_dp_replicas == 3
    assert s.agent_token is not None and s.agent_token.get_secret_value() == "agent-secret"
    assert "agent-secret" not in repr(s)
    assert s.policy == "policies.examples.hot_swap_on_xid:HotSwapOnXid"
    assert s.log_level == "debug"


def test_yaml_file_and_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write(
        tmp_path / "supervisor.yaml",
        "heartbeat_timeout_s: 20\n"
        "heartbeat_polling_period_s: 2\n"
        "flap_max_losses: 5\n"
        "database_url: postgresql://db/supervisor\n"
        "enable_fault_injection: true\n",
    )
    s = load_settings(config_file=path)
    assert s.heartbeat_timeout_s == 20.0
    assert s.heartbeat_polling_period_s == 2.0
    assert s.flap_max_losses == 5
    assert s.database_url == "postgresql://db/supervisor"
    assert s.enable_fault_injection is True
    assert s.port == 8080  # not in the file: default

    # Environment beats the file; explicit overrides beat both.
    monkeypatch.setenv("SUPERVISOR_HEARTBEAT_TIMEOUT_S", "40")
    monkeypatch.setenv("SUPERVISOR_FLAP_MAX_LOSSES", "7")
    s = load_settings(config_file=path, flap_max_losses=9)
    assert s.heartbeat_timeout_s == 40.0
    assert s.flap_max_losses == 9
    assert s.heartbeat_polling_period_s == 2.0  # still from the file


def test_config_file_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "port: 9090\n")
    monkeypatch.setenv(CONFIG_FILE_ENV, str(path))
    assert load_settings().port == 9090


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    path = write(tmp_path / "empty.yaml", "")
    assert load_settings(config_file=path) == load_settings()


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        pytest.param({"heartbeat_timeout_s": -1}, ["heartbeat_timeout_s"], id="negative"),
        pytest.param({"heartbeat_timeout_s": "abc"}, ["heartbeat_timeout_s"], id="not-a-number"),
        pytest.param({"heartbeat_timeout_s": 0}, ["heartbeat_timeout_s"], id="zero"),
        pytest.param({"flap_max_losses": 1}, ["flap_max_losses"], id="flap-max-losses"),
        pytest.param({"hang_safety_factor": 0.5}, ["hang_safety_factor"], id="safety-factor"),
        pytest.param({"port": 70000}, ["port"], id="port"),
        pytest.param({"log_level": "loud"}, ["log_level"], id="log-level"),
        pytest.param({"backend": "slurm"}, ["backend"], id="backend"),
        pytest.param({"policy": ""}, ["policy"], id="empty-policy"),
        pytest.param({"no_such_setting": 1}, ["unknown setting", "no_such_setting"], id="unknown"),
        pytest.param(
            {"min_num_dp_replicas": 5},
            ["min_num_dp_replicas", "num_dp_replicas"],
            id="min-above-num",
        ),
        pytest.param(
            {"num_dp_replicas": 6},
            ["max_num_dp_replicas"],
            id="num-above-max",
        ),
        pytest.param(
            {"heartbeat_timeout_s": 5, "heartbeat_polling_period_s": 5},
            ["heartbeat_timeout_s", "heartbeat_polling_period_s"],
            id="timeout-equals-period",
        ),
        pytest.param(
            {"heartbeat_timeout_s": 3},
            ["heartbeat_timeout_s", "heartbeat_polling_period_s"],
            id="timeout-below-period",
        ),
        pytest.param(
            {"heartbeat_timeout_s": -1, "port": -2},
            ["heartbeat_timeout_s", "port"],
            id="two-errors-one-line",
        ),
    ],
)
def test_invalid_values(overrides: dict[str, Any], names: list[str]) -> None:
    message = config_error(**overrides)
    for name in names:
        assert name in message


def test_equal_tokens_are_refused_without_echoing_them() -> None:
    message = config_error(agent_token="same-secret-123", operator_token="same-secret-123")
    assert "agent_token" in message and "operator_token" in message
    assert "same-secret-123" not in message
    # Different tokens are fine.
    s = load_settings(agent_token="a-secret", operator_token="o-secret")
    assert s.agent_token is not None and s.operator_token is not None


def test_invalid_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERVISOR_HEARTBEAT_TIMEOUT_S", "abc")
    message = config_error()
    assert "heartbeat_timeout_s" in message and "abc" in message


def test_relation_across_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "heartbeat_timeout_s: 20\n")
    monkeypatch.setenv("SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S", "25")
    message = config_error(config_file=path)
    assert "heartbeat_timeout_s" in message


def test_unknown_key_in_yaml(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "heartbeat_timeout_s: 20\nheartbeat_timout_s: 30\n")
    message = config_error(config_file=path)
    assert message == "unknown setting 'heartbeat_timout_s'"


def test_invalid_value_in_yaml(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "num_nodes_per_dp: lots\n")
    assert "num_nodes_per_dp" in config_error(config_file=path)


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "- heartbeat_timeout_s\n- 20\n")
    config_error(config_file=path)


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    message = config_error(config_file=missing)
    assert "config file not found" in message and str(missing) in message
    # A directory is not a config file either.
    assert "config file not found" in config_error(config_file=tmp_path)


def test_malformed_yaml(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "heartbeat_timeout_s: [20,\n")
    config_error(config_file=path)


def test_missing_config_file_from_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV, str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in config_error()


def test_settings_direct_construction_validates() -> None:
    # Settings itself (used by tests and the runtime) applies the same rules.
    with pytest.raises(ValueError):
        Settings(heartbeat_timeout_s=1, heartbeat_polling_period_s=2)


def test_a_group_alone_checks_its_own_settings() -> None:
    # A part built from a few values gets the same field rules and relations as Settings.
    with pytest.raises(ValidationError, match="heartbeat_timeout_s must be greater"):
        SensingSettings(heartbeat_timeout_s=1, heartbeat_polling_period_s=2)
    with pytest.raises(ValidationError, match="HTTPS needs both"):
        TlsSettings(tls_cert_file="cert.pem")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        WorkloadSettings(num_nodes_per_dp=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        WorkloadSettings(port=8080)
    assert Settings(port=9000).service == ServiceSettings(port=9000)


# --- the command line -----------------------------------------------------------------------


def run_cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    if not SUPERVISOR_BIN.exists():
        pytest.skip(f"{SUPERVISOR_BIN} is not installed")
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("SUPERVISOR_")}
    clean.update(env)
    return subprocess.run(
        [str(SUPERVISOR_BIN), *args],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_reports_a_bad_setting_in_one_line(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "serve", SUPERVISOR_HEARTBEAT_TIMEOUT_S="abc")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("supervisor:")
    assert "heartbeat_timeout_s" in lines[0]
    assert not (tmp_path / "var").exists()  # it stopped before touching the database


def test_cli_reports_a_missing_config_file_in_one_line(tmp_path: Path) -> None:
    done = run_cli(tmp_path, "serve", "--config", str(tmp_path / "nope.yaml"))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("supervisor:") and "nope.yaml" in lines[0]
