"""docker-compose.yml, checked as far as a machine without a Docker engine allows: it
parses; every command exists in the package and parses with that command's own argument
parser; every environment variable is a setting of the service it configures, and the
settings load with the service's own loader; tokens, URLs, ports, volumes and the start
order agree across services. `bootstrap` (the one-shot that starts the job) is run for
real against host monitor processes.

Not run here: `docker compose up` itself (no engine), so image builds, container DNS,
health checks and the named-volume permissions are checked as configuration only.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from host_monitor import cli as host_monitor_cli
from host_monitor.config import HostMonitorSettings
from host_monitor.config import load_settings as load_host_monitor_settings
from supervisor import cli as supervisor_cli
from supervisor.config import CONFIG_FILE_ENV, Settings
from supervisor.local import bootstrap
from supervisor.local.cluster_state import ClusterState
from supervisor.local.demo import RUN_MARKER, leftover_processes
from tests.test_host_monitor import ACTUATOR_TOKEN, Cluster, wait_for

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
OUR_IMAGE = "resiliency-supervisor:0.1.0"
NODES = [f"node-{i}" for i in range(6)]
RUN_DIR = "/var/lib/resiliency-supervisor"


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's `${VAR}` / `${VAR:-default}` substitution, with `env` as the shell."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3)
        if env.get(name):
            return env[name]
        assert default is not None, f"${{{name}}} has no default"
        return default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", sub, value)


def environment(service: str) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in SERVICES[service].get("environment", {}).items()}


def ours() -> list[str]:
    return [name for name, s in SERVICES.items() if s.get("image") == OUR_IMAGE]


def parse_command(service: str) -> tuple[str, argparse.Namespace]:
    """The service's command, parsed by the argument parser of the program it runs."""
    command = [str(c) for c in SERVICES[service]["command"]]
    if command[:2] == ["python", "-m"]:
        module = command[2]
        assert importlib.util.find_spec(module) is not None, module
        parser = {"supervisor.local.bootstrap": bootstrap._parser()}[module]
        return module, parser.parse_args(command[3:])
    program = command[0]
    assert program in SCRIPTS, f"{service}: {program} is not a console script of the package"
    parser = {"supervisor": supervisor_cli._parser(), "host-monitor": host_monitor_cli._parser()}[
        program
    ]
    return program, parser.parse_args(command[1:])


def supervisor_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in [k for k in os.environ if k.startswith("SUPERVISOR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_FILE_ENV, "")
    for name, value in environment("supervisor").items():
        monkeypatch.setenv(name, value)
    _, args = parse_command("supervisor")
    assert args.command == "serve"
    return supervisor_cli._settings(args)


def host_monitor_settings(service: str, monkeypatch: pytest.MonkeyPatch) -> HostMonitorSettings:
    for name in [k for k in os.environ if k.startswith("HOST_MONITOR_")]:
        monkeypatch.delenv(name)
    for name, value in environment(service).items():
        monkeypatch.setenv(name, value)
    program, args = parse_command(service)
    assert program == "host-monitor"
    return load_host_monitor_settings(**vars(args))


# --- structure -------------------------------------------------------------------------------


def test_compose_file_has_the_stack() -> None:
    assert set(SERVICES) == {"postgres", "bootstrap", "supervisor", *NODES}
    assert set(ours()) == {"bootstrap", "supervisor", *NODES}
    for name in ours():
        # Built from this repository's Dockerfile.
        assert SERVICES[name]["build"] == {"context": "."}
        assert (ROOT / SERVICES[name]["build"]["context"] / "Dockerfile").is_file()
    # Third-party images pinned to an exact release.
    assert re.fullmatch(r"postgres:\d+\.\d+-\w+", SERVICES["postgres"]["image"])
    declared = set(COMPOSE["volumes"])
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in declared, f"{name}: undeclared volume {volume}"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"


def test_every_command_exists_in_the_package() -> None:
    for name in ours():
        program, args = parse_command(name)
        if program in SCRIPTS:
            module, _, func = SCRIPTS[program].partition(":")
            assert callable(getattr(importlib.import_module(module), func))
        assert args is not None


def test_environment_names_are_settings_of_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ours():
        program, _ = parse_command(name)
        for var in environment(name):
            if var.startswith("SUPERVISOR_"):
                assert program == "supervisor", f"{name}: {var} is not for {program}"
                field = var.removeprefix("SUPERVISOR_").lower()
                assert field in Settings.model_fields, f"{name}: unknown setting {var}"
            elif var.startswith("HOST_MONITOR_"):
                field = var.removeprefix("HOST_MONITOR_").lower()
                assert field in HostMonitorSettings.model_fields, f"{name}: unknown setting {var}"
                assert program in ("host-monitor", "supervisor.local.bootstrap"), var
            else:
                pytest.fail(f"{name}: {var} is read by nothing")


def test_supervisor_settings_load_and_match_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = supervisor_settings(monkeypatch)
    assert settings.backend == "local"
    assert settings.local_run_dir == RUN_DIR
    assert settings.enable_fault_injection is True
    assert (settings.host, settings.port) == ("0.0.0.0", 8080)
    assert SERVICES["supervisor"]["ports"] == [f"127.0.0.1:{settings.port}:{settings.port}"]
    # The database is the postgres service, with its user, password and database.
    pg = environment("postgres")
    url = httpx.URL(settings.database_url.replace("postgresql+psycopg", "http", 1))
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert (url.host, url.port) == ("postgres", 5432)
    assert url.username == pg["POSTGRES_USER"] and url.password == pg["POSTGRES_PASSWORD"]
    assert url.path == f"/{pg['POSTGRES_DB']}"
    # The job bootstrap starts is the one the supervisor expects.
    _, boot = parse_command("bootstrap")
    assert boot.run_dir == Path(settings.local_run_dir)
    assert (boot.replicas, boot.nodes_per_dp) == (
        settings.num_dp_replicas,
        settings.num_nodes_per_dp,
    )
    assert settings.min_num_dp_replicas <= boot.replicas <= settings.max_num_dp_replicas


def test_host_monitors_load_and_reach_the_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor = supervisor_settings(monkeypatch)
    _, boot = parse_command("bootstrap")
    nodes = bootstrap.parse_nodes(boot.node)
    assert list(nodes) == NODES
    boot_token = environment("bootstrap")["HOST_MONITOR_ACTUATOR_TOKEN"]
    for node in NODES:
        hm = host_monitor_settings(node, monkeypatch)
        assert hm.node == node == SERVICES[node]["hostname"]
        assert hm.supervisor_url == f"http://supervisor:{supervisor.port}"
        assert hm.agent_token is not None and supervisor.agent_token is not None
        assert hm.agent_token.get_secret_value() == supervisor.agent_token.get_secret_value()
        assert hm.actuator_token is not None and supervisor.host_monitor_actuator_token is not None
        actuator = hm.actuator_token.get_secret_value()
        assert actuator == supervisor.host_monitor_actuator_token.get_secret_value() == boot_token
        assert hm.host == "0.0.0.0"
        # bootstrap (and so the local backend) reaches it by its host name and port.
        assert nodes[node] == f"http://{node}:{hm.host_daemon_port}"
        assert hm.heartbeat_polling_period_s == supervisor.heartbeat_polling_period_s
        # The kernel log stand-in is private to the node's container.
        assert hm.kernel_log is not None and not hm.kernel_log.startswith(RUN_DIR)
        assert str(hm.run_dir).startswith(f"{RUN_DIR}/monitors/")


def test_start_order_and_health_checks() -> None:
    for name, service in SERVICES.items():
        for target, cond in service.get("depends_on", {}).items():
            assert target in SERVICES, f"{name} depends on unknown {target}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[target], f"{target} has no health check"
            elif cond["condition"] == "service_completed_successfully":
                assert SERVICES[target]["restart"] == "no", target
            else:
                pytest.fail(f"{name} -> {target}: {cond}")
    depends = {n: set(s.get("depends_on", {})) for n, s in SERVICES.items()}
    assert depends["bootstrap"] == set(NODES)
    assert depends["supervisor"] == {"postgres", "bootstrap"}

    def after(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        assert name not in seen, f"dependency cycle through {name}"
        out = set(depends[name])
        for d in depends[name]:
            out |= after(d, seen | {name})
        return out

    assert after("supervisor") == {"postgres", "bootstrap", *NODES}
    # Health checks: valid Python that asks the port the service serves.
    for name, port, path in [
        *[(n, 9400, "/healthz") for n in NODES],
        ("supervisor", 8080, "/readyz"),
    ]:
        test = SERVICES[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        compile(test[3], f"{name} healthcheck", "exec")
        assert f"http://127.0.0.1:{port}{path}" in test[3]
    assert SERVICES["postgres"]["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]


def test_every_cluster_container_mounts_the_run_dir_at_the_same_path() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    workdirs = re.findall(r"^WORKDIR (\S+)", dockerfile, re.M)
    # Mounted on the image's (non-root owned) work directory, a fresh named volume takes
    # that directory's owner: the non-root user can write it.
    assert workdirs[-1] == RUN_DIR
    for name in ours():
        assert f"run:{RUN_DIR}" in SERVICES[name]["volumes"], name


# --- bootstrap, for real --------------------------------------------------------------------


def test_bootstrap_starts_the_job_on_running_host_monitors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    cluster = Cluster(tmp_path)
    try:
        agents = [
            cluster.start_agent(None, node=f"n{i}", env={RUN_MARKER: str(run_dir)})
            for i in range(3)
        ]
        argv = ["--run-dir", str(run_dir), "--replicas", "1", "--nodes-per-dp", "2"]
        argv += ["--step-time-s", "0.02", "--wait-s", "30"]
        for agent in agents:
            argv += ["--node", f"{agent.node}={agent.url}"]
        monkeypatch.setenv(bootstrap.TOKEN_ENV, ACTUATOR_TOKEN)
        bootstrap.main(argv)
        state = ClusterState.load(run_dir)
        assert state.job is not None
        assert state.job.placement == ["n0", "n1"] and state.spares() == ["n2"]
        assert state.nodes["n2"].address == agents[2].url

        def training(agent_index: int, min_step: int) -> bool:
            workers = agents[agent_index].workers()
            return any(
                w["state"] == "running" and (w["step"] or 0) >= min_step for w in workers.values()
            )

        wait_for(lambda: training(0, 5) and training(1, 5), 30, "the job trains")
        assert agents[2].status()["state"] == "spare"
        first_pids = {a.node: a.status()["workers"][0]["pid"] for a in agents[:2]}

        # Again: the previous workers are stopped and a new job starts from step 0.
        bootstrap.main(argv)
        wait_for(
            lambda: all(
                a.status()["workers"]
                and a.status()["workers"][0]["pid"] != first_pids[a.node]
                and a.status()["workers"][0]["state"] == "running"
                for a in agents[:2]
            ),
            30,
            "a new job",
        )
        assert ClusterState.load(run_dir).job is not None
    finally:
        cluster.teardown()
    wait_for(lambda: not leftover_processes(run_dir), 15, "no process left")


def test_bootstrap_starts_your_own_command_with_torchruns_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command as `supervisor run` takes it: a script with this Python, on --nnodes
    nodes of --nproc-per-node workers, each with its rank's torchrun environment."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(
        "import json, os, sys\n"
        "names = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'GROUP_RANK', 'LOCAL_WORLD_SIZE')\n"
        "seen = {n: os.environ[n] for n in names} | {'args': sys.argv[1:]}\n"
        f"path = os.path.join({str(out)!r}, 'rank' + os.environ['RANK'])\n"
        # Whole or absent: the test reads a rank's file once it exists.
        "open(path + '.tmp', 'w').write(json.dumps(seen))\n"
        "os.replace(path + '.tmp', path)\n"
    )
    cluster = Cluster(tmp_path)
    try:
        agents = [
            cluster.start_agent(None, node=f"n{i}", env={RUN_MARKER: str(run_dir)})
            for i in range(3)
        ]
        argv = ["--run-dir", str(run_dir), "--wait-s", "30", "--job", "mine"]
        argv += ["--nnodes", "2", "--nproc-per-node", "2"]
        for agent in agents:
            argv += ["--node", f"{agent.node}={agent.url}"]
        monkeypatch.setenv(bootstrap.TOKEN_ENV, ACTUATOR_TOKEN)
        bootstrap.main([*argv, str(script), "--lr", "0.1"])
        state = ClusterState.load(run_dir)
        assert state.job is not None and state.job.placement == ["n0", "n1"]
        assert state.spares() == ["n2"]

        def ranks() -> list[Path]:
            return [p for p in out.iterdir() if p.suffix != ".tmp"]

        wait_for(lambda: len(ranks()) == 4, 60, "every rank to start")
        seen = {p.name: json.loads(p.read_text()) for p in ranks()}
        for rank in range(4):
            env = seen[f"rank{rank}"]
            assert (env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank % 2), str(rank // 2))
            assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
            assert env["args"] == ["--lr", "0.1"]
        with pytest.raises(SystemExit, match=r"bootstrap: no such script: missing\.py"):
            bootstrap.main([*argv, "missing.py"])
    finally:
        cluster.teardown()
    wait_for(lambda: not leftover_processes(run_dir), 15, "no process left")


def test_bootstrap_refuses_bad_input_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(bootstrap.TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match="HOST_MONITOR_ACTUATOR_TOKEN is not set"):
        bootstrap.main(["--run-dir", str(tmp_path), "--node", "a=http://x:1"])
    with pytest.raises(ValueError, match="expected NAME=http"):
        bootstrap.parse_nodes(["a:http://x:1"])
    args = bootstrap._parser().parse_args(
        ["--run-dir", str(tmp_path), "--node", "a=http://x:1", "--replicas", "2"]
    )
    with pytest.raises(ValueError, match="the job needs 4 nodes, 1 given"):
        bootstrap.build_state(args, {"a": "http://x:1"}, "t")
