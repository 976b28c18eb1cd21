"""A node agent that can be observed: `GET /metrics` of a real `host-monitor` process,
scraped as Prometheus scrapes it (its own token), while its heartbeats fail and then get
through, its workers start and crash, and an emergency checkpoint round runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.local.ports import free_port
from tests.http import http
from tests.test_host_monitor import ACTUATOR_TOKEN, Cluster, Supervisor, wait_for
from tests.test_host_monitor import supervisor as supervisor  # the fixture

METRICS_TOKEN = "hm-test-metrics-token"


def scrape(
    url: str, token: str = METRICS_TOKEN
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
    }


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    for (sample, have), v in samples.items():
        if sample == name and all(dict(have).get(k) == want for k, want in labels.items()):
            return v
    raise KeyError(f"{name} {labels} not in {sorted({s for s, _ in samples})}")


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("metrics"))
    try:
        yield c
    finally:
        c.teardown()


def test_metrics_need_a_token_and_count_failed_heartbeats(cluster: Cluster) -> None:
    # Nothing listens on the supervisor's port: every heartbeat fails.
    agent = cluster.start_agent(
        f"http://127.0.0.1:{free_port()}",
        node="lonely",
        env={"HOST_MONITOR_METRICS_TOKEN": METRICS_TOKEN},
    )
    assert http.get(f"{agent.url}/metrics", timeout=5).status_code == 401
    wrong = http.get(f"{agent.url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=5)
    assert wrong.status_code == 401

    def failing() -> bool:
        s = scrape(agent.url)
        return value(s, "host_monitor_heartbeats_failed_total", node="lonely") >= 2

    wait_for(failing, 20, "failed heartbeats counted")
    samples = scrape(agent.url, ACTUATOR_TOKEN)  # the actuator's token reads them too
    assert value(samples, "host_monitor_heartbeats_sent_total", node="lonely") == 0
    assert value(samples, "host_monitor_heartbeat_consecutive_failures", node="lonely") >= 2
    assert value(samples, "host_monitor_watchdog_up", watchdog="xid watchdog") == 1


def test_metrics_follow_heartbeats_workers_and_emergency_rounds(
    supervisor: Supervisor, cluster: Cluster
) -> None:
    agent = cluster.start_agent(
        supervisor.url, node="observed", env={"HOST_MONITOR_METRICS_TOKEN": METRICS_TOKEN}
    )
    cluster.start_workers(agent, [0, 1])
    cluster.wait_running(agent, [0, 1])
    r = agent.api.post("/v1/emergency-checkpoint", json={"request_id": "m-1", "timeout_s": 5})
    assert r.status_code == 200, r.text
    agent.fault(kind="worker_crash", rank=1)
    wait_for(lambda: agent.workers()[1]["state"] == "exited", 10, "rank 1 exited")

    samples = scrape(agent.url)
    assert value(samples, "host_monitor_heartbeats_sent_total", node="observed") >= 1
    assert value(samples, "host_monitor_heartbeat_consecutive_failures", node="observed") == 0
    assert value(samples, "host_monitor_heartbeat_last_success_timestamp_seconds") > 0
    assert value(samples, "host_monitor_worker_starts_total", node="observed") == 2
    assert value(samples, "host_monitor_workers", state="running") == 1
    assert value(samples, "host_monitor_workers", state="exited") == 1
    assert value(samples, "host_monitor_emergency_checkpoint_seconds_count") == 1
    assert value(samples, "host_monitor_emergency_checkpoint_seconds_sum") < 5
