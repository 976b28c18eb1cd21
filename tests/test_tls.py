"""TLS end to end: real processes and sockets, certificates from a CA made here (trustme).

The supervisor's certificate names 127.0.0.1, where the tests reach it, and a DNS name.
The host monitors share one certificate that names only their Service's DNS name, as on
Kubernetes, and are reached at 127.0.0.1: whoever calls them (the supervisor, a partner,
a worker) checks the certificate against that name (docs/security.md, "TLS"). A second CA that
issued nothing of ours stands for a wrong CA; the system's trust store knows neither.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import httpx
import pytest
import trustme
import yaml

from host_monitor.config import ConfigError as HostMonitorConfigError
from host_monitor.config import load_settings as load_host_monitor_settings
from resiliency_protocol.tls import client_context
from supervisor.config import ConfigError, load_settings
from supervisor.local.backend import LocalBackend
from supervisor.local.cluster_state import ClusterState, NodeInfo
from supervisor.local.ports import free_port
from supervisor.ops.errors import ExitCode
from tests.conftest import SettingsFactory
from tests.forked_services import start_service
from tests.test_host_monitor import (
    ACTUATOR,
    ACTUATOR_TOKEN,
    OPERATOR_TOKEN,
    WORKER,
    WORKER_TOKEN,
    Agent,
    Cluster,
    Supervisor,
    _kill_group,
    wait_for,
)
from tests.test_host_monitor_peer import PEER_TOKEN, make_checkpoint, shard
from tests.test_ops_cli import cli_env, failed, ok
from training.checkpoint.peer import PeerTier as WorkerPeerTier
from training.worker_client import WorkerClient

ROOT = Path(__file__).resolve().parent.parent
#: The name the host monitors' certificate is issued for (their Service's, on Kubernetes).
MONITOR_NAME = "host-monitor.tls-test.svc"
SUPERVISOR_NAME = "supervisor.tls-test.svc"
VERIFY_FAILED = "CERTIFICATE_VERIFY_FAILED"

# A worker on the worker client: writes what it was told of TLS, registers, reports steps
# and serves emergency checkpoints until OUT_DIR/stop exists, then reports `stopping`
# (http.client, not httpx) and exits 3: `stopped`, not `exited`, only if that report
# went through.
TLS_WORKER = r"""
import json, os, sys, time
from pathlib import Path
from training.worker_client import WorkerClient

out = Path(os.environ["OUT_DIR"])
keys = ("HOST_MONITOR_URL", "HOST_MONITOR_CA_FILE", "HOST_MONITOR_SERVER_NAME")
told = {k: os.environ.get(k) for k in keys}
(out / f"env-{os.environ['RANK']}.json").write_text(json.dumps(told))
client = WorkerClient.from_env(report_interval_s=0.05)
if not client.register():
    sys.exit(5)
step = 0
client.on_emergency_checkpoint(lambda: step)
while not (out / "stop").exists():
    step += 1
    client.at_safe_point()
    client.report_step(step)
    time.sleep(0.02)
client.finished()
client.close()
sys.exit(3)
"""


@dataclass(frozen=True)
class Pki:
    ca: Path
    wrong_ca: Path
    supervisor_cert: Path
    supervisor_key: Path
    monitor_cert: Path
    monitor_key: Path


def make_pki(out: Path) -> Pki:
    """A CA and its certificates for the supervisor and the host monitors, and another CA,
    written into `out`."""
    ca, wrong = trustme.CA(), trustme.CA()
    supervisor = ca.issue_cert("127.0.0.1", SUPERVISOR_NAME)
    monitor = ca.issue_cert(MONITOR_NAME)  # not the address: reached at 127.0.0.1
    ca.cert_pem.write_to_path(str(out / "ca.crt"))
    wrong.cert_pem.write_to_path(str(out / "wrong-ca.crt"))
    supervisor.cert_chain_pems[0].write_to_path(str(out / "supervisor.crt"))
    supervisor.private_key_pem.write_to_path(str(out / "supervisor.key"))
    monitor.cert_chain_pems[0].write_to_path(str(out / "monitor.crt"))
    monitor.private_key_pem.write_to_path(str(out / "monitor.key"))
    return Pki(
        out / "ca.crt",
        out / "wrong-ca.crt",
        out / "supervisor.crt",
        out / "supervisor.key",
        out / "monitor.crt",
        out / "monitor.key",
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# --- the supervisor over HTTPS ----------------------------------------------------------------


class HttpsSupervisor(Supervisor):
    """`supervisor serve` with a certificate; its own clients verify with the CA."""

    def __init__(self, tmp: Path, pki: Pki) -> None:
        super().__init__(
            tmp,
            env={
                "SUPERVISOR_TLS_CERT_FILE": str(pki.supervisor_cert),
                "SUPERVISOR_TLS_KEY_FILE": str(pki.supervisor_key),
            },
        )
        self.url = f"https://127.0.0.1:{self.port}"
        self.verify = client_context(pki.ca)
        self.http.close()
        self.http = httpx.Client(base_url=self.url, headers=self.http.headers, verify=self.verify)

    def start(self) -> None:
        args = ["serve", "--port", str(self.port)]
        self.proc = start_service("supervisor.cli", args, self.env, self.log)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                return self.http.get("/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, 30, "supervisor ready over https")


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[HttpsSupervisor]:
    server = HttpsSupervisor(tmp_path_factory.mktemp("supervisor"), pki)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_supervisor_serves_https_that_only_its_ca_verifies(
    supervisor: HttpsSupervisor, pki: Pki
) -> None:
    r = httpx.get(f"{supervisor.url}/readyz", verify=client_context(pki.ca), timeout=5)
    assert r.status_code == 200, r.text
    # The system's trust store, another CA, httpx's own bundle: none of them vouches for it.
    for verify in (client_context(), client_context(pki.wrong_ca), True):
        with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
            httpx.get(f"{supervisor.url}/readyz", verify=verify, timeout=5)
    # Plain HTTP to the same port gets no HTTP answer at all.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{supervisor.port}/readyz", timeout=5)


def test_the_system_trust_store_is_read_once_per_process_and_a_ca_files_context_is_its_own(
    pki: Pki,
) -> None:
    # A host monitor made one per client at every start (about 30-65 ms of CPU each).
    assert client_context() is client_context() is client_context(ca_name="tls_ca_file")
    assert client_context().verify_mode is ssl.CERT_REQUIRED
    assert client_context().check_hostname
    mine, again = client_context(pki.ca), client_context(pki.ca)
    assert mine is not again and mine is not client_context()
    named = client_context(server_name=MONITOR_NAME)
    assert named is not client_context() and named is not client_context(server_name=MONITOR_NAME)


def test_host_monitors_heartbeat_over_https_and_a_wrong_ca_is_refused(
    supervisor: HttpsSupervisor, pki: Pki, tmp_path: Path
) -> None:
    cluster = Cluster(tmp_path)
    try:
        good = cluster.start_agent(supervisor.url, tls_ca_file=pki.ca)
        wrong = cluster.start_agent(supervisor.url, tls_ca_file=pki.wrong_ca)
        system = cluster.start_agent(supervisor.url)  # no CA: the system's trust store
        known = wait_for(lambda: supervisor.node(good.node), 10, "heartbeats over https")
        assert known["alive"] is True
        time.sleep(1.0)  # five heartbeat periods for the two others to fail in
        for agent in (wrong, system):
            assert supervisor.node(agent.node) is None
            assert agent.proc.poll() is None  # retrying with backoff, not crashing
            failures = [
                line
                for line in agent.log.read_text().splitlines()
                if "heartbeat to" in line and "failed" in line
            ]
            # Said once, however many retries failed the same way.
            assert len(failures) == 1 and VERIFY_FAILED in failures[0], failures
    finally:
        cluster.teardown()


# --- the host monitors over HTTPS -------------------------------------------------------------


def monitor_verify(pki: Pki) -> ssl.SSLContext:
    return client_context(pki.ca, server_name=MONITOR_NAME)


def start_tls_agent(cluster: Cluster, pki: Pki, *, ca: Path | None = None, **flags: Any) -> Agent:
    """A host monitor serving HTTPS with the shared certificate; its test clients (actuator,
    worker) verify it as the supervisor does."""
    agent = cluster.start_agent(
        flags.pop("supervisor_url", None),
        tls_cert_file=pki.monitor_cert,
        tls_key_file=pki.monitor_key,
        tls_ca_file=ca or pki.ca,
        tls_server_name=MONITOR_NAME,
        **flags,
    )
    agent.api.close()
    agent.worker_api.close()
    verify = monitor_verify(pki)
    agent.api = httpx.Client(base_url=agent.url, headers=ACTUATOR, timeout=10, verify=verify)
    agent.worker_api = httpx.Client(base_url=agent.url, headers=WORKER, timeout=10, verify=verify)
    return agent


def start_tls_workers(agent: Agent, ranks: list[int], out: Path, job: str = "j1") -> None:
    script = out / "worker.py"
    script.write_text(TLS_WORKER)
    body = {
        "request_id": f"start-{out.name}-{ranks}",
        "job": job,
        "command": [sys.executable, str(script)],
        "env": {"OUT_DIR": str(out), "PYTHONPATH": str(ROOT)},
        "workers": [{"rank": r, "local_rank": i} for i, r in enumerate(ranks)],
    }
    r = agent.api.post("/v1/workers/start", json=body)
    assert r.status_code == 200, r.text


def wait_steps(agent: Agent, ranks: list[int], min_step: int = 3) -> None:
    def running() -> bool:
        workers = agent.workers()
        return all(
            workers.get(r, {}).get("state") == "running" and (workers[r]["step"] or 0) >= min_step
            for r in ranks
        )

    wait_for(running, 15, f"ranks {ranks} reporting steps over https")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for script in tmp_path.glob("*/worker.py"):  # TLS workers end on their own too
            (script.parent / "stop").touch()
        c.teardown()


def test_a_host_monitor_serves_https_for_its_certificates_name(cluster: Cluster, pki: Pki) -> None:
    agent = start_tls_agent(cluster, pki)
    assert agent.url.startswith("https://127.0.0.1:")
    assert agent.status()["node"] == agent.node
    # Reached at 127.0.0.1, the certificate names only MONITOR_NAME: checked against that.
    for verify in (client_context(pki.ca), client_context(pki.ca, server_name="other.svc")):
        with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
            httpx.get(f"{agent.url}/healthz", verify=verify, timeout=5)
    with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
        httpx.get(
            f"{agent.url}/healthz", verify=client_context(pki.wrong_ca, server_name=MONITOR_NAME)
        )


def test_launched_workers_verify_their_host_monitor_with_what_it_hands_them(
    cluster: Cluster, pki: Pki, tmp_path: Path
) -> None:
    agent = start_tls_agent(cluster, pki)
    out = tmp_path / "workers"
    out.mkdir()
    start_tls_workers(agent, [0], out)
    wait_steps(agent, [0])  # registered and reporting: the worker client's httpx path
    told = json.loads((out / "env-0.json").read_text())
    assert told == {
        "HOST_MONITOR_URL": agent.url,
        "HOST_MONITOR_CA_FILE": str(pki.ca.resolve()),
        "HOST_MONITOR_SERVER_NAME": MONITOR_NAME,
    }
    # Its `stopping` report goes over http.client: only if it arrived is the exit (3)
    # `stopped` rather than `exited`.
    (out / "stop").touch()
    state = wait_for(
        lambda: agent.workers()[0]["state"] in ("stopped", "exited") and agent.workers()[0],
        10,
        "worker gone",
    )
    assert state["state"] == "stopped", state


def test_a_worker_client_with_the_wrong_ca_or_name_is_refused(
    cluster: Cluster, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    agent = start_tls_agent(cluster, pki)
    for ca, name in ((pki.wrong_ca, MONITOR_NAME), (pki.ca, None), (None, MONITOR_NAME)):
        caplog.clear()
        client = WorkerClient(
            5,
            0,
            monitor_url=agent.url,
            token=WORKER_TOKEN,
            ca_file=None if ca is None else str(ca),
            server_name=name,
        )
        with caplog.at_level(logging.WARNING, logger="training.worker_client"):
            assert client.register(attempts=1) is False
        client.close()
        assert VERIFY_FAILED in caplog.text, (ca, name, caplog.text)
    assert 5 not in agent.workers()
    with pytest.raises(ValueError, match=r"HOST_MONITOR_CA_FILE .*missing\.crt: cannot read it"):
        WorkerClient(0, 0, monitor_url=agent.url, ca_file=str(pki.ca.parent / "missing.crt"))


def test_the_peer_tier_copies_over_https_and_a_wrong_ca_is_refused(
    cluster: Cluster, pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def start(name: str, ca: Path = pki.ca) -> tuple[Agent, Path]:
        root = tmp_path / name / "ram"
        root.mkdir(parents=True)
        agent = start_tls_agent(
            cluster,
            pki,
            ca=ca,
            node=name,
            env={"HOST_MONITOR_PEER_TOKEN": PEER_TOKEN},
            initial_state="running",
            job="j1",
            checkpoint_root=root,
            peer_store_dir=tmp_path / name / "peer",
            peer_timeout_s=5,
        )
        return agent, root

    (a, a_root), (b, _), (s, s_root) = start("node-a"), start("node-b"), start("node-s")
    w, _ = start("node-w", ca=pki.wrong_ca)
    for agent in (a, s, w):
        r = agent.api.put("/v1/checkpoint-peer", json={"node": b.node, "url": b.url})
        assert r.status_code == 200, r.text

    # A pushes to B (httpx).
    files = {".metadata": shard(300, 1), "__0_0.distcp": shard(256 * 1024 + 3, 2)}
    saved = make_checkpoint(a_root / "tier", 120, 0, files)
    r = a.worker_api.post(
        "/v1/workers/0/checkpoints/replicate", json={"step": 120, "path": str(saved)}
    )
    assert r.status_code == 202, r.text

    def pushed() -> dict[str, Any] | None:
        state: dict[str, Any] = a.worker_api.get("/v1/workers/0/checkpoints/replicate").json()
        return state if state["state"] in ("done", "failed") else None

    state = wait_for(pushed, 15, "push to the partner")
    assert state["state"] == "done" and state["replicated_step"] == 120, state

    # The spare's worker asks its host monitor over HTTPS (the training side's peer tier),
    # which downloads B's copy (http.client), verified against the same name.
    tier = WorkerPeerTier(
        s.url, WORKER_TOKEN, 0, fetch_timeout_s=15, ca_file=str(pki.ca), server_name=MONITOR_NAME
    )
    try:
        assert tier.newest() == 120
        fetched = tier.fetch(120, s_root / "tier")
    finally:
        tier.close()
    restored = s_root / "tier" / "step-0000000120" / "rank-0"
    assert fetched == (restored, True)
    for name, data in files.items():
        assert (restored / name).read_bytes() == data

    # W's CA did not issue B's certificate: W will not talk to it.
    r = w.worker_api.get("/v1/workers/0/checkpoints/peer")
    assert r.status_code == 503 and VERIFY_FAILED in r.text, r.text
    # Nor does a worker with the wrong CA talk to its own host monitor.
    bad = WorkerPeerTier(
        s.url,
        WORKER_TOKEN,
        0,
        fetch_timeout_s=5,
        ca_file=str(pki.wrong_ca),
        server_name=MONITOR_NAME,
    )
    with caplog.at_level(logging.WARNING, logger="training.checkpoint.peer"):
        assert bad.newest() is None
    bad.close()
    assert VERIFY_FAILED in caplog.text


# --- the supervisor's clients of the host monitors --------------------------------------------


async def test_the_local_backend_verifies_host_monitors(
    cluster: Cluster, pki: Pki, tmp_path: Path, make_settings: SettingsFactory
) -> None:
    agent = start_tls_agent(cluster, pki)
    run_dir = tmp_path / "local"
    run_dir.mkdir()
    nodes = {agent.node: NodeInfo(address=agent.url)}
    ClusterState(run_dir=str(run_dir), actuator_token=ACTUATOR_TOKEN, nodes=nodes).save()

    good = LocalBackend(
        run_dir,
        make_settings(tls_ca_file=str(pki.ca), tls_host_monitor_server_name=MONITOR_NAME),
    )
    try:
        status = await good.cluster.call(agent.node, "/v1/status")
        assert status["node"] == agent.node
    finally:
        await good.close()
    for tls in (
        {"tls_ca_file": str(pki.ca)},  # the certificate does not name 127.0.0.1
        {"tls_ca_file": str(pki.wrong_ca), "tls_host_monitor_server_name": MONITOR_NAME},
        {"tls_host_monitor_server_name": MONITOR_NAME},  # the system's trust store
    ):
        backend = LocalBackend(run_dir, make_settings(**tls))
        try:
            with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
                await backend.cluster.call(agent.node, "/v1/status")
            assert not await backend.cluster.reachable(agent.node)
        finally:
            await backend.close()


# --- the operator CLI -------------------------------------------------------------------------


def cli(home: Path, *args: str, env: dict[str, str] | None = None) -> CompletedProcess[str]:
    """The operator CLI as a user runs it (tests/test_ops_cli.py), with `env` only."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(home, **(env or {})),
    )


def test_the_operator_cli_verifies_the_server_with_a_flag_env_or_context(
    supervisor: HttpsSupervisor, pki: Pki, tmp_path: Path
) -> None:
    env = {"SUPERVISOR_URL": supervisor.url, "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN}
    nodes = json.loads(
        ok(
            cli(
                tmp_path,
                "get",
                "nodes",
                "-o",
                "json",
                "--certificate-authority",
                str(pki.ca),
                env=env,
            )
        )
    )
    assert isinstance(nodes, list)
    ok(cli(tmp_path, "get", "nodes", env={**env, "SUPERVISOR_CA_FILE": str(pki.ca)}))
    failed(cli(tmp_path, "get", "nodes", env=env), ExitCode.UNAVAILABLE, "--certificate-authority")
    wrong = cli(tmp_path, "get", "nodes", "--certificate-authority", str(pki.wrong_ca), env=env)
    failed(wrong, ExitCode.UNAVAILABLE, VERIFY_FAILED)
    missing = str(tmp_path / "missing.crt")
    failed(
        cli(tmp_path, "get", "nodes", "--certificate-authority", missing, env=env),
        ExitCode.USAGE,
        f"certificate-authority {missing}: cannot read it",
    )

    # A context keeps the CA's path and the name to check, for its own server only:
    # reached as localhost, which its certificate does not name (as through a port-forward).
    port_forwarded = f"https://localhost:{supervisor.port}"
    ok(
        cli(
            tmp_path,
            "config",
            "set-context",
            "tls",
            "--server",
            port_forwarded,
            "--token",
            OPERATOR_TOKEN,
            "--certificate-authority",
            str(pki.ca),
            "--tls-server-name",
            SUPERVISOR_NAME,
        )
    )
    config = yaml.safe_load(
        (tmp_path / ".config" / "resiliency-supervisor" / "config.yaml").read_text()
    )
    assert config["contexts"][0]["certificate-authority"] == str(pki.ca)
    assert config["contexts"][0]["tls-server-name"] == SUPERVISOR_NAME
    by_context = json.loads(ok(cli(tmp_path, "get", "nodes", "-o", "json")))
    assert [n["name"] for n in by_context] == [n["name"] for n in nodes]
    ok(cli(tmp_path, "config", "set-context", "no-name", "--server", port_forwarded))
    mismatch = cli(
        tmp_path,
        "get",
        "nodes",
        "--context",
        "no-name",
        "--certificate-authority",
        str(pki.ca),
        env={"SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN},
    )
    failed(mismatch, ExitCode.UNAVAILABLE, "not valid for 'localhost'")
    assert "(the name its certificate holds: --tls-server-name)" in mismatch.stderr
    ok(cli(tmp_path, "config", "set-context", "bare", "--server", supervisor.url))
    failed(
        cli(
            tmp_path,
            "get",
            "nodes",
            "--context",
            "bare",
            env={"SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN},
        ),
        ExitCode.UNAVAILABLE,
        VERIFY_FAILED,
    )


# --- configuration errors ---------------------------------------------------------------------


def test_a_certificate_without_its_key_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_cert_file is set without tls_key_file"):
        load_settings(tls_cert_file=str(tmp_path / "c.crt"))
    with pytest.raises(ConfigError, match="tls_key_file is set without tls_cert_file"):
        load_settings(tls_key_file=str(tmp_path / "c.key"))
    with pytest.raises(HostMonitorConfigError, match="tls_cert_file is set without tls_key_file"):
        load_host_monitor_settings(node="n1", tls_cert_file=str(tmp_path / "c.crt"))
    with pytest.raises(HostMonitorConfigError, match="tls_key_file is set without tls_cert_file"):
        load_host_monitor_settings(node="n1", tls_key_file=str(tmp_path / "c.key"))


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("SUPERVISOR_", "HOST_MONITOR_"))
    }
    proc = subprocess.Popen(
        [sys.executable, *argv],
        env={**clean, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{argv} did not stop: {stderr}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def test_unusable_tls_files_stop_start_up_with_one_line(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.crt"
    serve = ["-m", "supervisor.cli", "serve", "--port", str(free_port())]
    base = {"SUPERVISOR_DATABASE_URL": f"sqlite:///{tmp_path}/s.db"}
    cases = [
        (
            {
                "SUPERVISOR_TLS_CERT_FILE": str(missing),
                "SUPERVISOR_TLS_KEY_FILE": str(pki.supervisor_key),
            },
            f"supervisor: tls_cert_file {missing}: cannot read it (No such file or directory)",
        ),
        (
            # The host monitors' key with the supervisor's certificate.
            {
                "SUPERVISOR_TLS_CERT_FILE": str(pki.supervisor_cert),
                "SUPERVISOR_TLS_KEY_FILE": str(pki.monitor_key),
            },
            f"supervisor: tls_cert_file {pki.supervisor_cert} and tls_key_file {pki.monitor_key}",
        ),
        (
            {"SUPERVISOR_TLS_CA_FILE": str(pki.supervisor_key)},
            f"supervisor: tls_ca_file {pki.supervisor_key}: no PEM certificate in it",
        ),
    ]
    for env, says in cases:
        done = _run(serve, {**base, **env})
        assert done.returncode == 1, (env, done.stderr)
        assert done.stderr.strip().splitlines()[-1].startswith(says), done.stderr
        assert "Traceback" not in done.stderr

    monitor = ["-m", "host_monitor.cli", "--node", "n1", "--port", "0", "--kernel-log", "none"]
    done = _run([*monitor, "--tls-ca-file", str(missing)], {})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"host-monitor: tls_ca_file {missing}: cannot read it (No such file or directory)"
    )
    done = _run([*monitor, "--tls-key-file", str(pki.monitor_key)], {})
    assert done.returncode == 2, done.stderr
    assert "tls_key_file is set without tls_cert_file" in done.stderr
