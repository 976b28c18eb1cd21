"""The fleet on a real Kubernetes API server (`python -m bench --only kube-scale`).

The tests' control plane (tests/control_plane.py: etcd, kube-apiserver with RBAC, the
controller manager, the scheduler, the JobSet controller, kwok) with N kwok nodes and a
spare, one JobSet of N pods (a whole node each), and `supervisor serve` on the Kubernetes
backend as the chart's ServiceAccount. Measured:

- start: the process spawned until `/readyz` answers 200, which it does only once the
  backend's four informers (JobSets, Jobs, pods, GPU nodes) have listed; and, from the
  API server's audit log, the first of those lists received until the last answered;
- the supervisor's requests over a window once started, from the audit log (only its
  ServiceAccount is logged), by verb and resource; beside them every client's
  (`apiserver_request_total` of `/metrics`: kwok's node and lease updates, the
  controllers'), over the same window;
- its memory (RSS, and its peak) at the end of the window;
- a node of the job turned NotReady (kwok lets go of it, its Ready condition written
  False) until the supervisor's first request after it, and its first write: the
  hot-swap onto the spare (the policy without emergency checkpoints: no host monitor
  runs on the job's nodes to ask). The spare heartbeats as its host monitor would (the
  bench posts its heartbeat every second): a node no host monitor speaks for is no spare
  to the supervisor, which then restarts the whole JobSet as a last resort.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.kube_fleet import (
    NS,
    AuditedPlane,
    create_nodes,
    ready_nodes,
    running_pods,
    set_not_ready,
    start_workload,
    supervisor_identity,
    supervisor_user,
    wait_for,
)
from bench.kube_requests import (
    AuditedRequest,
    audited_requests,
    describe,
    first_after,
    growth,
    received_between,
    request_totals,
)
from bench.table import Row, verdict
from supervisor.local.ports import free_port

POOL = "scale"
JOBSET = "scale"
WINDOW_S = 30.0
#: The node watch says NotReady at once (no deadline of its own): the target is 1 s.
NOT_READY_DEADLINE_S = 0.0
POLICY = "policies.examples.periodic_checkpoints_only:PeriodicCheckpointsOnly"
NODE_OR_POD_LISTS = {("list", "nodes"), ("list", "pods")}
AGENT_TOKEN = "kube-scale-agent-token"
SPARE_BEAT_S = 1.0


@dataclass
class KubeScaleResult:
    nodes: int
    start_s: float
    lists_s: float | None
    first_list_s: float | None  # spawned -> the first list received: imports, database
    window_s: float
    supervisor: dict[tuple[str, str], int]
    everyone: dict[tuple[str, str], int]
    rss_mib: float
    peak_mib: float
    first_call: AuditedRequest | None
    first_write: AuditedRequest | None
    not_ready_at: float
    setup_s: float
    remedy: str  # what the controller decided for the NotReady node, from its log


def _memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


def _serve(run_dir: Path, kubeconfig: Path, port: int) -> subprocess.Popen[bytes]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
        "SUPERVISOR_DATABASE_URL": f"sqlite:///{run_dir}/supervisor.db",
        "SUPERVISOR_AGENT_TOKEN": AGENT_TOKEN,
        "SUPERVISOR_OPERATOR_TOKEN": "kube-scale-operator-token",
        "SUPERVISOR_BACKEND": "kubernetes",
        "SUPERVISOR_POLICY": POLICY,
        "SUPERVISOR_KUBE_CONFIG": str(kubeconfig),
        "SUPERVISOR_KUBE_NAMESPACE": NS,
        "SUPERVISOR_KUBE_GPU_NODE_SELECTOR": f"pool={POOL}",
    }
    # Killed with the bench, as the plane's processes are (setpriv execs: same pid).
    guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    with (run_dir / "supervisor.log").open("ab") as log:
        return subprocess.Popen(
            [*guard, sys.executable, "-m", "supervisor.cli", "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _beat_as_spare(port: int, node: str, stop: threading.Event) -> None:
    """The spare's host monitor, as far as the supervisor can tell: a spare's heartbeat
    every `SPARE_BEAT_S`, until `stop`."""
    body = {"node": node, "state": "spare"}
    headers = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        while not stop.is_set():
            r = http.post("/api/v1/heartbeats", json=body, headers=headers)
            if r.status_code not in (202, 204):
                raise RuntimeError(f"the spare's heartbeat: {r.status_code} {r.text}")
            stop.wait(SPARE_BEAT_S)


def _metrics(plane: AuditedPlane) -> dict[tuple[str, str], float]:
    with plane.client() as api:
        r = api.get("/metrics")
    r.raise_for_status()
    return request_totals(r.text)


def _lists_s(requests: list[AuditedRequest], ready_at: float) -> float | None:
    """The informers' first lists (pages of 500 each), the first received -> the last
    answered: those received before the supervisor was ready."""
    lists = [r for r in requests if r.verb == "list" and r.received < ready_at]
    done = [r.completed for r in lists if r.completed is not None]
    if not lists or len(done) < len(lists):
        return None
    return max(done) - lists[0].received


def run(nodes: int, window_s: float = WINDOW_S, keep: Path | None = None) -> KubeScaleResult:
    """One measurement. Its folder (the plane's logs and etcd, the supervisor's log and
    database) is removed after a run that succeeded, unless it is made under `keep`."""
    work = Path(tempfile.mkdtemp(prefix="kube-scale-", dir=keep))
    plane = AuditedPlane(work / "plane")
    began = time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    user = supervisor_user()
    stop_beats = threading.Event()
    try:
        plane.start(within=300)
        who = supervisor_identity(plane)
        names = create_nodes(plane, POOL, nodes + 1)  # and a spare, as a hot-swap needs
        wait_for(f"{nodes + 1} nodes Ready", lambda: ready_nodes(plane, POOL) > nodes, 600)
        start_workload(plane, JOBSET, POOL, nodes)
        wait_for(
            f"{nodes} pods running", lambda: len(running_pods(plane, JOBSET)) >= nodes, 1200, 3.0
        )
        setup_s = time.monotonic() - began
        port = free_port()
        spawned, spawned_at = time.monotonic(), time.time()
        proc = _serve(work, who.kubeconfig, port)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:

            def ready() -> bool:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"supervisor exited; see {work / 'supervisor.log'}")
                try:
                    return http.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for("the supervisor ready", ready, 300, 0.05)
        start_s, ready_at = time.monotonic() - spawned, time.time()
        busy = {p["spec"]["nodeName"] for p in running_pods(plane, JOBSET)}
        spare = next(n for n in names if n not in busy)
        threading.Thread(target=_beat_as_spare, args=(port, spare, stop_beats), daemon=True).start()
        time.sleep(5.0)  # its first events and writes, if any, before the window
        before, since = _metrics(plane), time.time()
        time.sleep(window_s)
        after, until = _metrics(plane), time.time()
        rss, peak = _memory_mib(proc.pid)
        requests = audited_requests(plane.audit_lines(), user)
        victim = running_pods(plane, JOBSET)[0]["spec"]["nodeName"]
        at = set_not_ready(plane, victim)
        first_write = None
        deadline = time.monotonic() + 60
        while first_write is None and time.monotonic() < deadline:
            time.sleep(0.1)
            later = audited_requests(plane.audit_lines(), user)
            first_write = first_after(later, at, writes_only=True)
        later = audited_requests(plane.audit_lines(), user)
        time.sleep(1.0)  # the controller's log line of the decision
        result = KubeScaleResult(
            nodes=nodes,
            start_s=start_s,
            lists_s=_lists_s(requests, ready_at),
            first_list_s=next(
                (r.received - spawned_at for r in requests if r.verb == "list"), None
            ),
            window_s=until - since,
            supervisor=dict(received_between(requests, since, until)),
            everyone=dict(growth(before, after)),
            rss_mib=rss,
            peak_mib=peak,
            first_call=first_after(later, at),
            first_write=first_write,
            not_ready_at=at,
            setup_s=setup_s,
            remedy=_decision(work / "supervisor.log", victim),
        )
    except BaseException:
        print(f"kube-scale: the run's logs are in {work}", file=sys.stderr)
        raise
    finally:
        stop_beats.set()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        plane.stop()
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _decision(log: Path, node: str) -> str:
    """The controller's decision on the node's node_not_ready event ("?" if not logged)."""
    marker = f"node_not_ready node={node} "
    for line in log.read_text(errors="replace").splitlines():
        if marker in line and " -> " in line:
            return line.split(" -> ", 1)[1].split(" [", 1)[0]
    return "?"


def _call(r: AuditedRequest | None, at: float) -> str:
    if r is None:
        return "none within 60 s"
    target = f"{r.resource} {r.name}".strip()
    return f"{r.received - at:.2f} s ({r.verb} {target})"


def result_rows(r: KubeScaleResult) -> list[Row]:
    n = f"{r.nodes:,}"
    lists = f"{r.lists_s:.2f} s" if r.lists_s is not None else "not in the audit log"
    spawn = (
        f"serve spawned -> first list {r.first_list_s:.1f} s (imports, database),"
        f" -> /readyz {r.start_s:.1f} s"
        if r.first_list_s is not None
        else f"serve spawned -> /readyz {r.start_s:.1f} s"
    )
    node_lists = sum(r.supervisor.get(k, 0) for k in NODE_OR_POD_LISTS)
    total = sum(r.supervisor.values())
    rate = total / r.window_s
    others = sum(r.everyone.values())
    first = r.first_call.received - r.not_ready_at if r.first_call else None
    limit = NOT_READY_DEADLINE_S + 1.0
    return [
        Row(
            f"Kubernetes fleet, {n} kwok nodes + 1 spare, one JobSet of {n} pods: start, "
            "the informers' first lists (first received -> last answered)",
            lists,
            f"{spawn}; the plane set up in {r.setup_s:.0f} s",
            "-",
            "info",
        ),
        Row(
            f"  supervisor's requests over {r.window_s:.0f} s once started (audit log)",
            describe(r.supervisor, r.window_s),
            f"every client (/metrics): {others} ({others / r.window_s:.1f}/s), most: "
            + ", ".join(f"{c} {verb} {res}" for (verb, res), c in _top(r.everyone).items()),
            "no list of nodes or pods; < 1 req/s whatever N",
            verdict(node_lists == 0 and rate < 1.0),
        ),
        Row(
            "  supervisor's memory (RSS, peak)",
            f"{r.rss_mib:.0f} MiB, {r.peak_mib:.0f} MiB",
            "-",
            "-",
            "info",
        ),
        Row(
            f"  node NotReady -> the remedy's first API call, first write ({r.remedy})",
            f"{_call(r.first_call, r.not_ready_at)}; write {_call(r.first_write, r.not_ready_at)}",
            "-",
            f"<= NotReady deadline ({NOT_READY_DEADLINE_S:g} s, the node watch) + 1 s",
            verdict(first is not None and first <= limit),
        ),
    ]


def _top(counts: dict[tuple[str, str], int], keep: int = 6) -> dict[tuple[str, str], int]:
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:keep])


def rows(nodes: int, keep: Path | None = None) -> list[Row]:
    return result_rows(run(nodes, keep=keep))


if __name__ == "__main__":
    from bench.table import render

    print(render(rows(int(sys.argv[1]) if len(sys.argv) > 1 else 200)))
