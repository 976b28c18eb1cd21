"""Maintenance windows from the operator CLI, run as a user runs it against a real
`supervisor serve`: `create maintenance` with times relative to now or ISO 8601,
`get maintenance` (-o wide|name|json|jsonpath=, --no-headers, its aliases), `describe`,
`delete`, a window opening and cordoning its node, and the API's refusals as one line
and a non-zero exit code."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from supervisor.ops.errors import ExitCode
from tests.http import http
from tests.test_api import heartbeat
from tests.test_e2e import Server, serving
from tests.test_ops_cli import OPERATOR, beat, cli, failed, ok, rows
from tests.test_ops_cli_kubectl import _completion_env

HEADER = ["ID", "NODE", "JOB", "STATE", "STARTS", "ENDS", "NEXT-ACTIONS", "REASON"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # No heartbeat deadline fires during the tests: only what the windows do happens.
    with serving(
        tmp_path_factory.mktemp("supervisor"),
        heartbeat_polling_period_s=5,
        heartbeat_timeout_s=600,
    ) as s:
        beat(
            s,
            heartbeat("n1"),
            heartbeat("n2"),
            heartbeat("s1", job=None),
            heartbeat("s2", job=None),
        )
        yield s


def windows(server: Server, tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = json.loads(
        ok(cli(tmp_path, "get", "maintenance", "-o", "json", *args, server=server))
    )
    return listed


def node(server: Server, name: str) -> dict[str, Any]:
    found: dict[str, Any] = http.get(
        f"{server.url}/api/v1/nodes/{name}", headers=OPERATOR, timeout=10
    ).json()
    return found


def until(condition: Callable[[], Any], what: str, within: float = 60.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {within:g} s")


def iso(seconds_from_now: float) -> str:
    moment = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=seconds_from_now)
    return moment.isoformat().replace("+00:00", "Z")


def test_a_window_to_come_listed_described_and_deleted(server: Server, tmp_path: Path) -> None:
    made = ok(
        cli(
            tmp_path,
            "create",
            "maintenance",
            "--node",
            "n1",
            "--start",
            "2h",
            "--duration",
            "1h30m",
            "--reason",
            "firmware upgrade",
            server=server,
        )
    )
    assert made.startswith("maintenance/") and " created: node n1 (job j1) " in made, made
    window_id = made.split()[0].split("/")[1]
    assert "; scheduled, next: emergency_checkpoint,hot_swap,cordon" in made

    table = rows(ok(cli(tmp_path, "get", "maintenance", server=server)))
    assert table[0] == HEADER
    (row,) = [r for r in table[1:] if r[0] == window_id]
    assert row[1:4] == ["n1", "j1", "scheduled"]
    # STARTS and ENDS from now, as an age: in 1h59m, in 3h29m.
    assert row[4] == "in" and row[5].startswith("1h5")
    assert row[6] == "in" and row[7].startswith("3h2")
    assert row[8:] == ["emergency_checkpoint,hot_swap,cordon", "firmware", "upgrade"]

    # -o wide: the times themselves (UTC), and when the next step runs.
    wide = rows(ok(cli(tmp_path, "get", "mw", window_id, "-o", "wide", server=server)))
    assert wide[0] == [*HEADER, "START", "END", "NEXT-RUN"]
    start, end, next_run = wide[1][-3:]
    assert next_run == start and start.endswith("Z") and end > start
    opens = datetime.fromisoformat(start)
    assert timedelta(minutes=118) < opens - datetime.now(UTC) <= timedelta(hours=2)
    assert datetime.fromisoformat(end) - opens == timedelta(hours=1, minutes=30)

    # The kubectl formats, under each of the resource's names.
    names = ok(cli(tmp_path, "get", "maintenance-windows", "-o", "name", server=server))
    assert f"maintenance/{window_id}" in names.split()
    bare = ok(cli(tmp_path, "get", "mw", "--node", "n1", "--no-headers", server=server))
    assert [line.split()[0] for line in bare.splitlines()] == [window_id]
    path = "jsonpath={range .items[*]}{.id}{'\\t'}{.node}{'\\t'}{.job}{'\\n'}{end}"
    assert f"{window_id}\tn1\tj1\n" in ok(cli(tmp_path, "get", "mw", "-o", path, server=server))
    assert windows(server, tmp_path, "--state", "open", "--node", "n1") == []
    (listed,) = windows(server, tmp_path, window_id)
    assert listed["reason"] == "firmware upgrade" and listed["state"] == "scheduled"

    described = ok(cli(tmp_path, "describe", "maintenance", window_id, server=server))
    fields = dict(line.split(":", 1) for line in described.splitlines())
    assert fields["node"].strip() == "n1" and fields["state"].strip() == "scheduled"
    assert fields["starts"].strip().startswith("in 1h5")
    one = cli(tmp_path, "describe", "mw", window_id, "-o", "jsonpath={.steps[*]}", server=server)
    assert ok(one) == "emergency_checkpoint hot_swap cordon\n"

    deleted = ok(cli(tmp_path, "delete", "maintenance", window_id, server=server))
    assert deleted == f"maintenance/{window_id} deleted\n"
    assert windows(server, tmp_path, "--node", "n1") == []
    gone = cli(tmp_path, "get", "maintenance", "--node", "n1", server=server)
    assert gone.returncode == 0 and gone.stdout == ""
    assert gone.stderr == "No maintenance windows found.\n"
    again = cli(tmp_path, "delete", "maintenance", window_id, server=server)
    failed(again, ExitCode.NOT_FOUND, f"maintenance window {window_id} not found (HTTP 404)")
    failed(
        cli(tmp_path, "describe", "maintenance", window_id, server=server),
        ExitCode.NOT_FOUND,
        "not found",
    )
    # Nothing ever ran: the window was cancelled before its start.
    assert node(server, "n1")["cordoned"] is False


def test_a_window_that_opens_now_cordons_its_node_until_deleted(
    server: Server, tmp_path: Path
) -> None:
    made = json.loads(
        ok(
            cli(
                tmp_path,
                "create",
                "maintenance",
                "--node",
                "s1",
                "--duration",
                "1h",
                "-o",
                "json",
                server=server,
            )
        )
    )
    # A spare runs no job: the window only cordons it.
    assert made["node"] == "s1" and made["job"] is None and made["steps"] == ["cordon"]
    until(lambda: node(server, "s1")["cordoned"], "s1 cordoned")
    (opened,) = until(
        lambda: [w for w in windows(server, tmp_path, "--state", "open") if w["id"] == made["id"]],
        "the window open",
    )
    assert opened["steps"] == ["uncordon"] and opened["next_run"] is not None
    row = rows(ok(cli(tmp_path, "get", "mw", made["id"], "--no-headers", server=server)))[0]
    assert row[1:4] == ["s1", "-", "open"]
    assert row[5:7] == ["ago", "in"] and row[8:] == ["uncordon", "-"]
    listed = rows(ok(cli(tmp_path, "get", "nodes", "s1", server=server)))
    assert listed[1][1] == "cordoned"

    deleted = ok(cli(tmp_path, "delete", "mw", made["id"], server=server))
    assert deleted == f"maintenance/{made['id']} deleted (it was open: node s1 is uncordoned now)\n"
    until(lambda: not node(server, "s1")["cordoned"], "s1 uncordoned")
    actions = json.loads(
        ok(cli(tmp_path, "get", "actions", "--node", "s1", "-o", "json", server=server))
    )
    mine = [a for a in actions if made["id"] in a["reason"]]
    assert sorted(a["type"] for a in mine) == ["cordon", "uncordon"]
    assert all(a["source"] == "maintenance" and a["status"] == "succeeded" for a in mine)


def test_the_same_key_and_times_make_one_window(server: Server, tmp_path: Path) -> None:
    start, end = iso(3 * 3600), iso(4 * 3600)
    create = ("create", "maintenance", "--node", "n2", "--idempotency-key", "rack-7-bios")
    first = ok(cli(tmp_path, *create, "--start", start, "--end", end, "-o", "name", server=server))
    again = ok(cli(tmp_path, *create, "--start", start, "--end", end, "-o", "name", server=server))
    assert first == again and first.startswith("maintenance/")
    assert len(windows(server, tmp_path, "--node", "n2")) == 1
    # The key once used names that window: other times are refused, nothing added.
    other = cli(tmp_path, *create, "--start", start, "--duration", "2h", server=server)
    failed(other, ExitCode.REFUSED, "Idempotency-Key: already used for another window (HTTP 409)")
    assert len(windows(server, tmp_path, "--node", "n2")) == 1
    ok(cli(tmp_path, "delete", "maintenance", first.strip().split("/")[1], server=server))


def test_bad_windows_are_refused_in_one_line_and_nothing_is_stored(
    server: Server, tmp_path: Path
) -> None:
    create = ("create", "maintenance", "--node", "s2")
    cases: list[tuple[tuple[str, ...], ExitCode, str]] = [
        (("--start", "3h", "--end", "2h"), ExitCode.REFUSED, "end: must be after start (HTTP 422)"),
        (
            ("--start", iso(-7200), "--end", iso(-3600)),
            ExitCode.REFUSED,
            "end: is in the past (HTTP 422)",
        ),
        (("--end", "tomorrow"), ExitCode.REFUSED, "end: expected a date and time"),
        (("--start", "soon", "--end", "3h"), ExitCode.REFUSED, "start: expected a date and time"),
        (("--start", "soon", "--duration", "1h"), ExitCode.USAGE, "--start: not an ISO 8601 time"),
        (("--duration", "1h", "--reason", "x" * 501), ExitCode.REFUSED, "reason"),
    ]
    for extra, code, says in cases:
        failed(cli(tmp_path, *create, *extra, server=server), code, says)
    unknown = cli(tmp_path, "create", "mw", "--node", "n9", "--duration", "1h", server=server)
    failed(unknown, ExitCode.NOT_FOUND, "node 'n9' not found (HTTP 404)")
    wrong = cli(
        tmp_path,
        *create,
        "--duration",
        "1h",
        server=server,
        SUPERVISOR_OPERATOR_TOKEN="not-the-token",
    )
    assert wrong.returncode == ExitCode.UNAUTHORIZED and wrong.stdout == "", wrong.stderr
    # argparse's own: neither --end nor --duration.
    usage = cli(tmp_path, *create, server=server)
    assert usage.returncode == ExitCode.USAGE
    assert "one of the arguments --end --duration is required" in usage.stderr
    assert windows(server, tmp_path, "--node", "s2") == []
    assert node(server, "s2")["cordoned"] is False


def test_deleting_several_goes_on_past_one_not_found(server: Server, tmp_path: Path) -> None:
    made = []
    for hours in (5, 6):
        create = ("create", "mw", "--node", "n2", "--start", f"{hours}h", "--duration", "30m")
        made.append(json.loads(ok(cli(tmp_path, *create, "-o", "json", server=server)))["id"])
    result = cli(tmp_path, "delete", "maintenance", made[0], "0" * 12, made[1], server=server)
    assert result.returncode == ExitCode.NOT_FOUND
    assert result.stdout.splitlines() == [f"maintenance/{i} deleted" for i in made]
    assert result.stderr.splitlines() == [
        f"supervisor delete: {'0' * 12}: maintenance window {'0' * 12} not found (HTTP 404)",
        "supervisor delete: 1 of 3 windows not deleted",
    ]
    assert windows(server, tmp_path, "--node", "n2") == []


# --- fault drills ---------------------------------------------------------------------------


def test_drills_created_listed_and_deleted(server: Server, tmp_path: Path) -> None:
    nightly = ok(
        cli(
            tmp_path,
            "create",
            "drill",
            "--cron",
            "0 2 * * *",
            "--kind",
            "xid",
            "--kind",
            "ecc",
            "--job",
            "j1",
            server=server,
        )
    )
    assert nightly.startswith("drill/") and nightly.endswith(
        " created: cron 0 2 * * *, xid,ecc on job j1\n"
    ), nightly
    nightly_id = int(nightly.split()[0].split("/")[1])
    hourly = json.loads(
        ok(
            cli(
                tmp_path,
                "create",
                "drill",
                "--every",
                "1h30m",
                "--kind",
                "ecc",
                "-o",
                "json",
                server=server,
            )
        )
    )
    assert hourly["kind"] == "schedule" and hourly["params"]["schedule"]["every_s"] == 5400

    table = rows(ok(cli(tmp_path, "get", "drills", server=server)))
    assert table[0] == ["ID", "JOB", "WHEN", "KINDS", "AGE"]
    by_id = {int(r[0]): r for r in table[1:]}
    assert by_id[nightly_id][1:8] == ["j1", "cron", "0", "2", "*", "*", "*"]
    assert by_id[nightly_id][8] == "xid,ecc"
    assert by_id[hourly["id"]][1:5] == ["-", "every", "1h30m", "ecc"]
    names = ok(cli(tmp_path, "get", "drill", "--job", "j1", "-o", "name", server=server))
    assert names == f"drill/{nightly_id}\n"
    # Other faults are not drills: not listed, and not deleted as one.
    xid = http.post(
        f"{server.url}/api/v1/faults",
        json={"kind": "xid", "node": "n2", "code": 31},
        headers=OPERATOR,
        timeout=10,
    ).json()
    assert xid["id"] not in {
        int(r[0]) for r in rows(ok(cli(tmp_path, "get", "drills", server=server)))[1:]
    }
    failed(
        cli(tmp_path, "delete", "drill", str(xid["id"]), server=server),
        ExitCode.NOT_FOUND,
        f"fault {xid['id']} is a xid fault, not a drill (supervisor end {xid['id']})",
    )

    bad = cli(tmp_path, "create", "drill", "--cron", "0 2 * *", "--kind", "xid", server=server)
    failed(bad, ExitCode.REFUSED, "schedule: cron: a cron expression has 5 fields")
    fast = cli(tmp_path, "create", "drill", "--every", "500ms", "--kind", "xid", server=server)
    failed(fast, ExitCode.REFUSED, "schedule: every_s:")
    # This server's backend runs no processes: no worker faults.
    crash = cli(
        tmp_path, "create", "drill", "--every", "1h", "--kind", "worker_crash", server=server
    )
    failed(crash, ExitCode.REFUSED, "schedule: worker_crash faults need the local backend")
    nojob = ("create", "drill", "--every", "1h", "--kind", "xid", "--job", "j9")
    failed(cli(tmp_path, *nojob, server=server), ExitCode.NOT_FOUND, "job 'j9' is not known")

    deleted = ok(
        cli(tmp_path, "delete", "drills", str(nightly_id), str(hourly["id"]), server=server)
    )
    assert deleted.splitlines() == [
        f"drill/{nightly_id} deleted: cron 0 2 * * *, xid,ecc on job j1",
        f"drill/{hourly['id']} deleted: every 1h30m, ecc on any job",
    ]
    gone = cli(tmp_path, "get", "drills", server=server)
    assert gone.returncode == 0 and gone.stdout == "" and gone.stderr == "No drills found.\n"
    failed(
        cli(tmp_path, "get", "drills", str(nightly_id), server=server),
        ExitCode.NOT_FOUND,
        f"drill {nightly_id} not found (or ended)",
    )


BASH_COMPLETE = """
source <(supervisor completion bash)
complete_words() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=();
  _supervisor_complete; echo "${COMPREPLY[*]}"; }
complete_words supervisor cr
complete_words supervisor create ''
complete_words supervisor get mw --state o
complete_words supervisor delete mw ''
complete_words supervisor describe maintenance ''
"""


def test_bash_completion_offers_the_verbs_and_the_windows_ids(
    server: Server, tmp_path: Path
) -> None:
    create = ("create", "mw", "--node", "n2", "--start", "8h", "--duration", "1h", "-o", "name")
    window_id = ok(cli(tmp_path, *create, server=server)).strip().split("/")[1]
    env = _completion_env(tmp_path, server)
    out = subprocess.run(
        ["bash", "-c", BASH_COMPLETE], capture_output=True, text=True, env=env, timeout=60
    )
    ok(cli(tmp_path, "delete", "mw", window_id, server=server))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "create"
    assert sorted(lines[1].split()) == [
        "drill",
        "drills",
        "maintenance",
        "maintenance-window",
        "maintenance-windows",
        "mw",
    ]
    assert lines[2] == "open"
    assert lines[3] == lines[4] == window_id  # asked of the server
