"""Structured (JSON) logs, as a log pipeline reads them: a real `supervisor serve`, a real
`host-monitor` and the worker it launches, each writing one JSON object per line with the
event, action, job, node and rank as fields."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from resiliency_protocol.logs import JsonFormatter, TextFormatter, configure_worker_logging
from tests.test_host_monitor import Cluster, Supervisor, wait_for

REPO = Path(__file__).resolve().parents[1]

# A worker as a user writes one: its logging set up by the helper, which reads the format
# its host monitor gives it; one warning, then it trains until stopped.
WORKER = r"""
import logging, time
from resiliency_protocol.logs import configure_worker_logging
from training.worker_client import WorkerClient

configure_worker_logging("info")
client = WorkerClient.from_env(report_interval_s=0.1)
client.register(attempts=3)
logging.getLogger("train").warning("started", extra={"step": 0})
step = 0
while True:
    step += 1
    client.report_step(step)
    time.sleep(0.05)
"""


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every non-empty line as JSON (a line that is not fails the test, naming it)."""
    lines = []
    for line in text.splitlines():
        if line.strip():
            try:
                lines.append(json.loads(line))
            except ValueError:
                pytest.fail(f"not a JSON line: {line!r}")
    return lines


def test_a_record_becomes_one_object_with_its_context() -> None:
    record = logging.LogRecord(
        "supervisor.x", logging.WARNING, __file__, 1, "lost %s", ("n1",), None
    )
    record.node, record.job, record.rank = "n1", "j1", 3
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "lost n1" and line["level"] == "warning"
    assert (line["node"], line["job"], line["rank"]) == ("n1", "j1", 3)
    assert line["time"].endswith("+00:00")
    text = TextFormatter().format(record)
    assert text.endswith("lost n1 [job=j1 node=n1 rank=3]"), text


def test_a_worker_gets_its_rank_and_job_as_fields_and_bad_formats_are_refused() -> None:
    stream = io.StringIO()
    env = {"RESILIENCY_LOG_FORMAT": "json", "RANK": "2", "HOST_MONITOR_JOB": "j1"}
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_worker_logging("info", env)
        root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
        logging.getLogger("train").info("hello")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    (line,) = json_lines(stream.getvalue())
    assert (line["role"], line["job"], line["rank"], line["message"]) == (
        "worker",
        "j1",
        2,
        "hello",
    )
    with pytest.raises(ValueError, match="RESILIENCY_LOG_FORMAT"):
        configure_worker_logging("info", {"RESILIENCY_LOG_FORMAT": "xml"})


def test_an_unknown_format_flag_is_refused_naming_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "serve", "--log-format", "xml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert "--log-format" in done.stderr and "xml" in done.stderr


def test_every_process_writes_json_lines_a_pipeline_can_index(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, env={"SUPERVISOR_LOG_FORMAT": "json"})
    supervisor.start()
    cluster = Cluster(tmp_path)
    try:
        agent = cluster.start_agent(supervisor.url, node="n1", log_format="json")
        body = {
            "request_id": uuid.uuid4().hex,
            "job": "j1",
            "command": [sys.executable, "-c", WORKER],
            "env": {"PYTHONPATH": str(REPO)},
            "workers": [{"rank": 0, "local_rank": 0}],
        }
        r = agent.api.post("/v1/workers/start", json=body)
        assert r.status_code == 200, r.text
        cluster.wait_running(agent, [0])
        agent.fault(kind="worker_crash", rank=0)
        supervisor.wait_event("n1", "worker_exited", within=20)

        def actions_done() -> list[dict[str, Any]]:
            items: list[dict[str, Any]] = supervisor.http.get("/api/v1/actions").json()["items"]
            return items if items and all(a["status"] != "running" for a in items) else []

        actions = wait_for(actions_done, 30, "the supervisor's actions")
        time.sleep(0.5)  # their log lines are written after the records
    finally:
        cluster.teardown()
        supervisor.stop()

    lines = json_lines(supervisor.log.read_text())
    assert all(line["role"] == "supervisor" for line in lines)
    (decided,) = [line for line in lines if line.get("event_type") == "worker_exited"]
    assert (decided["node"], decided["job"], decided["rank"]) == ("n1", "j1", 0), decided
    assert isinstance(decided["event"], int)
    finished = {line["action"]: line for line in lines if line.get("action") is not None}
    for action in actions:
        line = finished[action["id"]]
        assert (line["action_type"], line["event"]) == (action["type"], action["event_id"])
    assert decided["event"] in {line["event"] for line in finished.values()}

    # Its file holds its stdout too: one line saying where it listens, for whoever started
    # it (tests/test_host_monitor.py), not a log record.
    said = f"host-monitor n1 listening on {agent.url}\n"
    agent_lines = json_lines(agent.log.read_text().replace(said, "", 1))
    assert agent_lines and all(
        (line["role"], line["node"]) == ("host-monitor", "n1") for line in agent_lines
    )
    worker_logs = list((tmp_path / "run").rglob("*.log"))
    worker = [
        line
        for path in worker_logs
        for line in json_lines(path.read_text())
        if line.get("logger") == "train"
    ]
    assert worker, [p.read_text()[-500:] for p in worker_logs]
    assert (worker[0]["role"], worker[0]["job"], worker[0]["rank"], worker[0]["node"]) == (
        "worker",
        "j1",
        0,
        "n1",
    )
    assert worker[0]["step"] == 0
