"""The operator commands (`supervisor get | describe | inject | end | cordon | uncordon |
watch | config | goodput`) run as a user runs them: processes against a real
`supervisor serve`, their output and exit codes read as a script would."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.local.ports import free_port
from supervisor.ops import output
from supervisor.ops.client import parse_event_stream
from supervisor.ops.config import resolve
from supervisor.ops.errors import CliError, ExitCode
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN
from tests.http import http
from tests.test_api import heartbeat
from tests.test_e2e import Server, serving
from tests.timing import scaled

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # No heartbeat deadline fires during the tests: only what they do happens.
    with serving(
        tmp_path_factory.mktemp("supervisor"),
        heartbeat_polling_period_s=5,
        heartbeat_timeout_s=600,
    ) as s:
        beat(s, heartbeat("n1"), heartbeat("n2"), heartbeat("s1", job=None))
        yield s


def beat(server: Server, *bodies: dict[str, Any]) -> None:
    for body in bodies:
        r = http.post(f"{server.url}/api/v1/heartbeats", json=body, headers=AGENT, timeout=10)
        assert r.status_code in (202, 204), r.text


def cli_env(home: Path, **env: str) -> dict[str, str]:
    """The environment of a user with no supervisor settings and no config file but
    what the test gives."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    return {**clean, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **env}


def cli(
    home: Path, *args: str, server: Server | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    if server is not None:
        env = {"SUPERVISOR_URL": server.url, "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN, **env}
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(home, **env),
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.args, result.stdout, result.stderr)
    return result.stdout


def failed(result: subprocess.CompletedProcess[str], code: ExitCode, says: str) -> None:
    """Exit code `code`, stdout empty, and one line on stderr saying `says`."""
    assert result.returncode == code, (result.args, result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], (result.args, result.stderr)


def rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.strip().splitlines()]


def test_get_prints_aligned_tables_json_and_yaml(server: Server, tmp_path: Path) -> None:
    table = ok(cli(tmp_path, "get", "nodes", server=server))
    lines = table.strip().splitlines()
    header = lines[0].split()
    assert header == ["NAME", "STATUS", "JOB", "MARKS", "WORKERS", "HEARTBEAT"]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert {"n1", "n2", "s1"} <= set(by_name)
    # Aligned: each value starts where its column's header does.
    state_at = lines[0].index("STATUS")
    assert by_name["n1"][state_at:].startswith("running")
    assert by_name["s1"][state_at:].startswith("spare")

    nodes = json.loads(ok(cli(tmp_path, "get", "nodes", "-o", "json", server=server)))
    assert {n["name"]: n["job"] for n in nodes if n["name"] in ("n1", "s1")} == {
        "n1": "j1",
        "s1": None,
    }
    of_job = yaml.safe_load(
        ok(cli(tmp_path, "get", "nodes", "--job", "j1", "-o", "yaml", server=server))
    )
    assert sorted(n["name"] for n in of_job) == ["n1", "n2"]

    jobs = rows(ok(cli(tmp_path, "get", "jobs", server=server)))
    assert jobs[0][:2] == ["NAME", "STATE"] and jobs[1][:4] == ["j1", "running", "4", "(2-4)"]


#: Run as `python -c PROBE ARGS...`: the `supervisor` command with ARGS, then one last line
#: of JSON with its exit code and every module it imported.
PROBE = """
import json, sys
from supervisor import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as end:
    code = end.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def test_an_operator_command_imports_nothing_of_the_service(server: Server, tmp_path: Path) -> None:
    """`get` and the other operator commands load the operator's modules alone: not the
    service's settings, server or store, nor the demo, the simulator or the goodput
    calculator (about 40 % of a call's CPU before)."""
    env = {"SUPERVISOR_URL": server.url, "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN}
    for args in (("get", "nodes"), ("describe", "node", "n1"), ("get", "nodes", "--bogus")):
        done = subprocess.run(
            [sys.executable, "-c", PROBE, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=cli_env(tmp_path, **env),
        )
        said = json.loads(done.stdout.strip().splitlines()[-1])
        ours = [m for m in said["modules"] if m.split(".")[0] == "supervisor"]
        if args[-1] == "--bogus":  # refused: the whole parser says why, with every command
            assert said["code"] == 2 and "serve,node-credential,demo" in done.stderr, done
            continue
        assert said["code"] == 0, done
        loaded = [m for m in ours if m not in ("supervisor", "supervisor.cli", "supervisor.errors")]
        assert all(m.startswith("supervisor.ops") for m in loaded), loaded
        assert not {"uvicorn", "fastapi", "sqlalchemy", "pydantic"} & set(said["modules"]), args


def test_exit_codes(server: Server, tmp_path: Path) -> None:
    failed(
        cli(tmp_path, "describe", "node", "nope", server=server),
        ExitCode.NOT_FOUND,
        "node 'nope' not found (HTTP 404)",
    )
    failed(
        cli(tmp_path, "get", "nodes", server=server, SUPERVISOR_OPERATOR_TOKEN="wrong"),
        ExitCode.UNAUTHORIZED,
        "invalid bearer token (HTTP 401)",
    )
    down = f"http://127.0.0.1:{free_port()}"
    failed(
        cli(tmp_path, "get", "jobs", "--server", down, "--token", "t"),
        ExitCode.UNAVAILABLE,
        f"cannot reach {down}",
    )
    # The API's own message for what it refuses.
    failed(
        cli(tmp_path, "get", "events", "--since", "yesterday", server=server),
        ExitCode.REFUSED,
        "query.since: expected a date and time",
    )
    failed(
        cli(tmp_path, "inject", "meteor", "--node", "n1", server=server),
        ExitCode.REFUSED,
        "kind: Input should be 'heartbeat_loss'",
    )
    failed(
        cli(tmp_path, "inject", "schedule", "--job", "j1", "--param", "schedule=random,120",
            server=server),
        ExitCode.REFUSED,
        "schedule: worker_crash faults need the local backend",
    )  # fmt: skip
    # Usage: argparse's own, and a CLI without a server to talk to.
    assert cli(tmp_path, "get", "pods", server=server).returncode == ExitCode.USAGE
    assert cli(tmp_path, "get", "events", "--limit", "0", server=server).returncode == 2
    failed(cli(tmp_path, "get", "nodes"), ExitCode.USAGE, "no server: give --server")


def test_inject_describe_and_end_a_fault(server: Server, tmp_path: Path) -> None:
    injected = cli(tmp_path, "inject", "xid", "--node", "n2", "--param", "code=79", server=server)
    line = ok(injected).strip()
    assert line.startswith("fault ") and "injected: xid node=n2 job=j1 (events: " in line
    fault_id = line.split()[1]

    fault = json.loads(
        ok(cli(tmp_path, "describe", "fault", fault_id, "-o", "json", server=server))
    )
    assert fault["params"] == {"code": 79} and len(fault["events"]) == 1
    assert not fault["active"] and fault["ended_at"] is not None  # an XID happens once
    event_id = str(fault["events"][0])

    events = json.loads(
        ok(cli(tmp_path, "get", "events", "--type", "gpu_xid", "--node", "n2", "--since", "1h",
               "-o", "json", server=server))
    )  # fmt: skip
    assert [e["id"] for e in events] == [int(event_id)]
    assert events[0]["details"]["code"] == 79 and events[0]["fault_id"] == int(fault_id)

    # The event with the actions the policy took for it.
    deadline = time.monotonic() + 20
    while True:
        described = ok(cli(tmp_path, "describe", "event", event_id, server=server))
        if "hot_swap" in described or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "type:" in described and "gpu_xid" in described and "code:" in described
    assert "Actions:" in described and "hot_swap" in described
    # Swapped out, n2 left the job.
    (node,) = json.loads(ok(cli(tmp_path, "get", "nodes", "n2", "-o", "json", server=server)))
    assert node["job"] is None and node["cordoned"], node
    (job,) = json.loads(ok(cli(tmp_path, "get", "jobs", "-o", "json", server=server)))
    assert "n2" not in job["nodes"], job

    # A fault that lasts until ended: listed as active, then ended.
    injected = cli(tmp_path, "inject", "heartbeat_loss", "--node", "n2", server=server)
    fault_id = ok(injected).strip().split()[1]
    active = json.loads(ok(cli(tmp_path, "get", "faults", "--active", "-o", "json", server=server)))
    assert int(fault_id) in [f["id"] for f in active]
    ended = ok(cli(tmp_path, "end", fault_id, server=server))
    assert ended.strip() == f"fault {fault_id} ended: heartbeat_loss node=n2"
    fault = json.loads(
        ok(cli(tmp_path, "describe", "fault", fault_id, "-o", "json", server=server))
    )
    assert not fault["active"] and fault["ended_at"] is not None
    failed(cli(tmp_path, "end", "999999", server=server), ExitCode.NOT_FOUND, "fault 999999")


def test_inject_answers_5_when_the_server_keeps_fault_injection_off(tmp_path: Path) -> None:
    with serving(tmp_path, enable_fault_injection="false") as closed:
        beat(closed, heartbeat("n1"))
        failed(
            cli(tmp_path, "inject", "xid", "--node", "n1", "--param", "code=79", server=closed),
            ExitCode.UNAUTHORIZED,
            "fault injection is disabled",
        )


def test_cordon_and_uncordon_are_recorded_actions(server: Server, tmp_path: Path) -> None:
    beat(server, heartbeat("s2", job=None))

    def cordoned() -> bool:
        node = json.loads(ok(cli(tmp_path, "describe", "node", "s2", "-o", "json", server=server)))
        flag: bool = node["cordoned"]
        return flag

    for command, expected in (("cordon", True), ("uncordon", False)):
        said = ok(cli(tmp_path, command, "s2", "--reason", "disk check", server=server))
        assert f": {command} node s2, pending" in said
        action_id = said.split()[1].rstrip(":")
        deadline = time.monotonic() + 20
        while cordoned() is not expected:
            assert time.monotonic() < deadline, f"{command} did not take"
            time.sleep(0.2)
        action = json.loads(
            ok(cli(tmp_path, "describe", "action", action_id, "-o", "json", server=server))
        )
        assert (action["type"], action["node"], action["source"]) == (command, "s2", "operator")
        assert action["reason"] == "disk check" and action["status"] == "succeeded"

    listed = rows(ok(cli(tmp_path, "get", "actions", "--node", "s2", server=server)))
    assert [r[2:5] for r in listed[1:]] == [
        ["uncordon", "succeeded", "s2"],
        ["cordon", "succeeded", "s2"],
    ]
    failed(cli(tmp_path, "cordon", "nope", server=server), ExitCode.NOT_FOUND, "'nope'")


def test_contexts_from_a_config_file(server: Server, tmp_path: Path) -> None:
    (tmp_path / "op-token").write_text(OPERATOR_TOKEN + "\n")
    down = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "ops.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "current-context": "down",
                "contexts": [
                    {"name": "lab", "server": server.url, "token-file": "op-token"},
                    {"name": "down", "server": down, "token": "t"},
                ],
            }
        )
    )
    listed = ok(cli(tmp_path, "config", "get-contexts", "--config", str(config)))
    assert rows(listed) == [
        ["CURRENT", "NAME", "SERVER", "AUTH"],
        ["lab", server.url, "token-file", "op-token"],
        ["*", "down", down, "token"],
    ]
    assert OPERATOR_TOKEN not in listed

    failed(cli(tmp_path, "get", "jobs", "--config", str(config)), ExitCode.UNAVAILABLE, down)
    assert "j1" in ok(cli(tmp_path, "get", "jobs", "--config", str(config), "--context", "lab"))
    assert ok(cli(tmp_path, "config", "use-context", "lab", "--config", str(config)))
    assert "j1" in ok(cli(tmp_path, "get", "jobs", SUPERVISOR_CONFIG=str(config)))
    # A context's token goes to its own server only.
    ok(cli(tmp_path, "config", "use-context", "down", "--config", str(config)))
    failed(
        cli(tmp_path, "get", "jobs", "--server", server.url, "--config", str(config)),
        ExitCode.UNAUTHORIZED,
        "missing bearer token",
    )
    failed(
        cli(tmp_path, "config", "use-context", "nope", "--config", str(config)),
        ExitCode.USAGE,
        "no context 'nope'",
    )
    failed(
        cli(tmp_path, "get", "jobs", "--context", "nope", "--config", str(config)),
        ExitCode.USAGE,
        "no context 'nope'",
    )

    # The default file, written by set-context: private, and the first context is current.
    said = ok(cli(tmp_path, "config", "set-context", "lab", "--server", server.url,
                  "--token", OPERATOR_TOKEN))  # fmt: skip
    default = tmp_path / ".config" / "resiliency-supervisor" / "config.yaml"
    assert str(default) in said and default.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(default.read_text())["current-context"] == "lab"
    assert "j1" in ok(cli(tmp_path, "get", "jobs"))


def test_watch_prints_what_happens_while_it_runs(server: Server, tmp_path: Path) -> None:
    beat(server, heartbeat("n3", job="j3"))
    watch = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(tmp_path, SUPERVISOR_URL=server.url, SUPERVISOR_OPERATOR_TOKEN=OPERATOR_TOKEN),
    )
    try:
        assert watch.stderr is not None and watch.stdout is not None
        assert "watching" in watch.stderr.readline()  # connected: what follows is live
        lines = _lines_of(watch.stdout)
        ok(cli(tmp_path, "inject", "ecc", "--node", "n3", "--param", "count=2", server=server))
        seen: list[str] = []
        deadline = time.monotonic() + scaled(20)
        while not any("gpu_ecc" in line and "node=n3 job=j3" in line for line in seen):
            assert time.monotonic() < deadline, seen
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        assert seen[-1].split()[1] == "event" and "count=2" in seen[-1]
        watch.send_signal(signal.SIGINT)
        assert watch.wait(scaled(15)) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def _lines_of(stream: Any) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_goodput_of_every_job_and_of_one(server: Server, tmp_path: Path) -> None:
    every = rows(ok(cli(tmp_path, "goodput", server=server)))
    assert every[0][:2] == ["JOB", "GOODPUT"] and "j1" in [r[0] for r in every[1:]]
    reports = json.loads(ok(cli(tmp_path, "goodput", "-o", "json", server=server)))
    assert {r["job"] for r in reports} >= {"j1"} and all(0 <= r["goodput"] <= 1 for r in reports)
    assert "Goodput of job j1:" in ok(cli(tmp_path, "goodput", "--job", "j1", server=server))
    failed(cli(tmp_path, "goodput", "--job", "nope", server=server), ExitCode.NOT_FOUND, "nope")


# --- the pieces, without a server ----------------------------------------------------


def test_event_stream_parsing() -> None:
    lines = ["retry: 1000", 'id: 1', "event: resync", 'data: {"id": "1"}', "", ": keepalive", "",
             "id: 2", "event: event", 'data: {"type":', 'data: "hang"}', ""]  # fmt: skip
    messages = list(parse_event_stream(lines))
    assert [(m.kind, m.id, m.data) for m in messages] == [
        ("resync", "1", {"id": "1"}),
        ("event", "2", {"type": "hang"}),
    ]


def test_table_and_values() -> None:
    table = output.table(
        [{"a": "x", "b": None}, {"a": "longer", "b": True}],
        [output.field("A", "a"), output.field("B", "b")],
    )
    assert table.splitlines() == ["A        B", "x        -", "longer   true"]
    assert [output.duration(s) for s in (4.25, 42, 192, 18120, 183600)] == [
        "4.2s", "42s", "3m12s", "5h2m", "2d3h",
    ]  # fmt: skip
    assert output.when("2024-05-01T12:00:03.5+02:00") == "2024-05-01T10:00:03Z"
    assert output.text({"code": 79, "ok": False}) == "code=79 ok=false"


def test_flags_win_over_environment_over_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "current-context: a\ncontexts:\n- {name: a, server: 'http://a:1/', token: ta}\n"
    )
    monkeypatch.setenv("SUPERVISOR_CONFIG", str(config))
    monkeypatch.delenv("SUPERVISOR_URL", raising=False)
    monkeypatch.delenv("SUPERVISOR_OPERATOR_TOKEN", raising=False)
    none: dict[str, Any] = {"server": None, "token": None, "context": None, "config": None}
    assert resolve(**none) == resolve(**{**none, "context": "a"})
    assert (resolve(**none).server, resolve(**none).token) == ("http://a:1", "ta")
    monkeypatch.setenv("SUPERVISOR_URL", "http://b:2")
    assert (resolve(**none).server, resolve(**none).token) == ("http://b:2", None)
    monkeypatch.setenv("SUPERVISOR_OPERATOR_TOKEN", "tb")
    assert resolve(**{**none, "server": "https://c"}) == resolve(
        server="https://c", token="tb", context=None, config="/nonexistent"
    )
    with pytest.raises(CliError) as refused:
        resolve(**{**none, "server": "c:3"})
    assert refused.value.code is ExitCode.USAGE
