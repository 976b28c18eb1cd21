"""The operator CLI's kubectl habits, run as a user runs them against a real `supervisor
serve`: -o wide|name|json|yaml|jsonpath=..., --no-headers, the AGE column, durations
such as 1h30m, `get -w`, a lost node shown as lost, and shell completion."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.ops import jsonpath
from supervisor.ops.args import duration_s, positive_duration
from supervisor.ops.errors import ExitCode
from tests.conftest import OPERATOR_TOKEN
from tests.http import http
from tests.test_api import heartbeat
from tests.test_e2e import Server, serving
from tests.test_ops_cli import OPERATOR, beat, cli, cli_env, failed, ok, rows
from tests.timing import scaled

ROOT = Path(__file__).resolve().parent.parent


#: The module's supervisor records every event and remedies none: what the commands print
#: is the picture the heartbeats and the operator's own actions left, not a remedy's.
QUIET_POLICY = """
from supervisor.policy import Policy


class Watching(Policy):
    name = "watching"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # n1 and n2 beat once: with a 2 s timeout they are lost soon after; s1 beats on.
    tmp = tmp_path_factory.mktemp("supervisor")
    (tmp / "watching.py").write_text(QUIET_POLICY)
    with serving(
        tmp,
        heartbeat_polling_period_s=0.5,
        heartbeat_timeout_s=2,
        policy=f"{tmp / 'watching.py'}:Watching",
    ) as s:
        beat(s, heartbeat("n1"), heartbeat("n2"), heartbeat("s1", job=None))
        done = threading.Event()

        def spare() -> None:
            while not done.wait(0.3):
                with contextlib.suppress(httpx.TransportError, AssertionError):
                    beat(s, heartbeat("s1", job=None))

        thread = threading.Thread(target=spare, daemon=True)
        thread.start()
        try:
            yield s
        finally:
            done.set()
            thread.join(10)


def wait_lost(server: Server, *names: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        nodes = http.get(f"{server.url}/api/v1/nodes", headers=OPERATOR, timeout=10).json()
        if {n["name"] for n in nodes if not n["alive"]} >= set(names):
            return
        time.sleep(0.1)
    raise AssertionError(f"{names} not lost")


def test_a_lost_node_reads_lost_with_its_workers(server: Server, tmp_path: Path) -> None:
    wait_lost(server, "n1", "n2")
    table = rows(ok(cli(tmp_path, "get", "nodes", server=server)))
    assert table[0] == ["NAME", "STATUS", "JOB", "MARKS", "WORKERS", "HEARTBEAT"]
    by_name = {r[0]: r for r in table[1:]}
    assert by_name["n1"][1:5] == ["lost", "j1", "-", "0/2"]
    assert by_name["s1"][1:3] == ["spare", "-"]
    # -o wide: what the host monitor last said, beside what the node is.
    wide = rows(ok(cli(tmp_path, "get", "nodes", "n1", "-o", "wide", server=server)))
    assert wide[0][6:] == ["REPORTED", "ALIVE", "CORDONED", "LAST-HEARTBEAT"]
    assert wide[1][:2] == ["n1", "lost"] and wide[1][6:8] == ["running", "false"]
    described = ok(cli(tmp_path, "describe", "node", "n1", server=server))
    assert "status:" in described and " lost" in described.split("status:")[1].splitlines()[0]
    workers = json.loads(ok(cli(tmp_path, "describe", "node", "n1", "-o", "json", server=server)))
    assert [(w["state"], w["reported_state"]) for w in workers["workers"]] == [
        ("lost", "running"),
        ("lost", "running"),
    ]
    lost = ok(cli(tmp_path, "get", "nodes", "--status", "lost", "-o", "name", server=server))
    assert lost.split() == ["node/n1", "node/n2"]


def test_output_formats_and_headers(server: Server, tmp_path: Path) -> None:
    names = ok(cli(tmp_path, "get", "nodes", "-o", "name", server=server)).split()
    assert names == ["node/n1", "node/n2", "node/s1"]
    bare = ok(cli(tmp_path, "get", "nodes", "--no-headers", server=server)).splitlines()
    assert [line.split()[0] for line in bare] == ["n1", "n2", "s1"]
    template = "jsonpath={.items[*].name}"
    assert ok(cli(tmp_path, "get", "nodes", "-o", template, server=server)) == "n1 n2 s1\n"
    ranged = '{range .items[?(@.job=="j1")]}{.name}{"\\t"}{.workers[0].rank}{"\\n"}{end}'
    out = ok(cli(tmp_path, "get", "nodes", "-o", f"jsonpath={ranged}", server=server))
    assert out == "n1\t2\nn2\t4\n\n"
    one = ok(cli(tmp_path, "describe", "node", "s1", "-o", "jsonpath={.state}", server=server))
    assert one == "spare\n"
    jobs = ok(cli(tmp_path, "get", "jobs", "j1", "-o", "name", server=server))
    assert jobs == "job/j1\n"
    # A template that does not parse is a usage error; nothing is asked of the server.
    bad = cli(tmp_path, "get", "nodes", "-o", "jsonpath={.items[", server=server)
    assert bad.returncode == ExitCode.USAGE and "jsonpath: unclosed" in bad.stderr
    unknown = cli(tmp_path, "get", "nodes", "-o", "xml", server=server)
    assert unknown.returncode == ExitCode.USAGE and "jsonpath=TEMPLATE" in unknown.stderr
    failed(cli(tmp_path, "get", "nodes", "n9", server=server), ExitCode.NOT_FOUND, "'n9'")


def test_age_column_and_durations(server: Server, tmp_path: Path) -> None:
    fault = http.post(
        f"{server.url}/api/v1/faults",
        json={"kind": "xid", "node": "s1", "code": 31},
        headers=OPERATOR,
        timeout=10,
    ).json()
    args = ("get", "events", "--type", "gpu_xid", "--since", "1h30m", "--timeout", "1m")
    table = rows(ok(cli(tmp_path, *args, server=server)))
    assert table[0][:3] == ["ID", "AGE", "TYPE"]
    mine = [r for r in table[1:] if r[0] in {str(e) for e in fault["events"]}]
    assert mine and mine[0][2] == "gpu_xid" and mine[0][1].endswith("s"), table
    wide = rows(ok(cli(tmp_path, "get", "events", "-o", "wide", "--limit", "1", server=server)))
    assert wide[0][-2:] == ["TIME", "INCIDENT"]
    refused = cli(tmp_path, "get", "events", "--timeout", "soon", server=server)
    assert refused.returncode == ExitCode.USAGE and "1h30m" in refused.stderr


class Lines:
    """A command's stdout lines as they come, read by a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: [self.lines.put(x) for x in stdout], daemon=True).start()

    def until(self, predicate: object, within: float = 30.0) -> list[str]:
        seen: list[str] = []
        deadline = time.monotonic() + scaled(within)
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            seen.append(line.rstrip("\n"))
            if callable(predicate) and predicate(seen[-1]):
                return seen
        raise AssertionError(f"not seen in {scaled(within):g} s; saw {seen}")


def watching(tmp_path: Path, server: Server, *args: str) -> subprocess.Popen[str]:
    env = cli_env(tmp_path, SUPERVISOR_URL=server.url, SUPERVISOR_OPERATOR_TOKEN=OPERATOR_TOKEN)
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(scaled(15)) == 0  # Ctrl-C is how a watch ends: not an error


def test_get_watch_prints_changes_as_they_happen(server: Server, tmp_path: Path) -> None:
    nodes = Lines(watching(tmp_path, server, "get", "nodes", "-w"))
    events = Lines(watching(tmp_path, server, "get", "events", "-w", "--type", "gpu_ecc"))
    try:
        first = nodes.until(lambda line: line.startswith("s1"))
        assert first[0].split()[:2] == ["NAME", "STATUS"]
        # The list is printed once the stream is open: from here on nothing is missed.
        events.until(lambda line: line.startswith("ID"))
        http.post(
            f"{server.url}/api/v1/actions",
            json={"type": "cordon", "node": "s1"},
            headers=OPERATOR,
            timeout=10,
        ).raise_for_status()
        http.post(
            f"{server.url}/api/v1/faults",
            json={"kind": "ecc", "node": "s1", "count": 2},
            headers=OPERATOR,
            timeout=10,
        ).raise_for_status()
        changed = nodes.until(lambda line: line.split()[:2] == ["s1", "cordoned"])
        assert all(line.split()[0] == "s1" for line in changed)  # changes only
        row = events.until(lambda line: "gpu_ecc" in line)[-1].split()
        assert row[2:4] == ["gpu_ecc", "s1"]
    finally:
        stop(nodes.proc)
        stop(events.proc)
    http.post(
        f"{server.url}/api/v1/actions",
        json={"type": "uncordon", "node": "s1"},
        headers=OPERATOR,
        timeout=10,
    ).raise_for_status()


def _completion_env(tmp_path: Path, server: Server) -> dict[str, str]:
    """`supervisor` on PATH as this checkout's CLI, with the test server's context."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "supervisor"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m supervisor.cli "$@"\n')
    wrapper.chmod(0o755)
    env = cli_env(tmp_path, SUPERVISOR_URL=server.url, SUPERVISOR_OPERATOR_TOKEN=OPERATOR_TOKEN)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(ROOT)
    return env


BASH_COMPLETE = """
source <(supervisor completion bash)
complete_words() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=();
  _supervisor_complete; echo "${COMPREPLY[*]}"; }
complete_words supervisor ge
complete_words supervisor get no
complete_words supervisor get nodes -o w
complete_words supervisor get nodes --status lo
complete_words supervisor describe node ''
complete_words supervisor cordon s
"""


def test_bash_completion_offers_commands_options_and_names(server: Server, tmp_path: Path) -> None:
    env = _completion_env(tmp_path, server)
    out = subprocess.run(
        ["bash", "-c", BASH_COMPLETE], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "get"
    assert sorted(lines[1].split()) == ["no", "node", "nodes"]
    assert lines[2] == "wide"
    assert lines[3] == "lost"
    assert lines[4].split() == ["n1", "n2", "s1"]  # asked of the server
    assert lines[5] == "s1"


ZSH_COMPLETE = """
autoload -U compinit && compinit -u
source <(supervisor completion zsh)
COMP_WORDS=(supervisor get nodes -o j); COMP_CWORD=4; COMPREPLY=()
_supervisor_complete
print -r -- "${COMPREPLY[*]}"
COMP_WORDS=(supervisor describe node ''); COMP_CWORD=3; COMPREPLY=()
_supervisor_complete
print -r -- "${COMPREPLY[*]}"
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_loads_and_completes(server: Server, tmp_path: Path) -> None:
    env = _completion_env(tmp_path, server)
    out = subprocess.run(
        ["zsh", "-f", "-c", ZSH_COMPLETE], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["json jsonpath=", "n1 n2 s1"]


def test_durations_as_go_and_kubectl_write_them() -> None:
    assert duration_s("1h30m") == 5400
    assert duration_s("1.5h") == 5400
    assert duration_s("2d3h") == 2 * 86400 + 3 * 3600
    assert duration_s("500ms") == 0.5
    assert duration_s("90") is None and duration_s("1x") is None and duration_s("h") is None
    assert positive_duration("30") == 30 and positive_duration("2m") == 120
    for bad in ("0s", "-5", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_duration(bad)


def test_jsonpath_templates_as_kubectl_reads_them() -> None:
    data = {
        "items": [
            {"name": "a", "status": "lost", "workers": [{"step": 1}, {"step": 2}]},
            {"name": "b", "status": "running", "workers": []},
        ]
    }
    assert jsonpath.render("{.items[*].name}", data) == "a b"
    assert jsonpath.render("{.items[-1:].name}", data) == "b"
    assert jsonpath.render("{.items[?(@.status!='lost')].name}", data) == "b"
    assert jsonpath.render("{..step}", data) == "1 2"
    assert jsonpath.render("n={.items[0].workers}", data) == 'n=[{"step": 1}, {"step": 2}]'
    assert jsonpath.render('{range .items[*]}{.name}:{.status}{"\\n"}{end}', data) == (
        "a:lost\nb:running\n"
    )
    for bad in ("{.items[", "{range .items[*]}", "{end}", "{.items[?(@.a ~ 1)]}", "{.a..}"):
        with pytest.raises(jsonpath.JsonPathError):
            jsonpath.parse(bad)
