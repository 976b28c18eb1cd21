"""The agent: every part of the host monitor in one asyncio loop.

Tasks, each independent of the others so that none can starve the rest:
- the local HTTP API (uvicorn, on a socket we bind first, so a port of 0 is known before
  anything uses our address);
- the process monitor: polls the workers every 0.1 s and triggers a heartbeat on any
  change; releases the node to spare once its (self-registered) workers are all gone;
- the heartbeat sender; when the supervisor refuses workers of an older world than their
  job's newest (a node cut off during a heal, heard again), they are killed at once and
  the node becomes a spare: it fences itself;
- the XID and ECC watchdogs.

SIGTERM/SIGINT stop the workers we launched (SIGTERM, `shutdown_grace_s`, SIGKILL),
then the API, then the rest; the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import signal
import socket
import ssl
from collections.abc import Generator

import uvicorn

from host_monitor.checkpoint_forwarder import CheckpointForwarder
from host_monitor.config import HostMonitorSettings
from host_monitor.fault_actor import FaultActor
from host_monitor.heartbeat import HeartbeatSender
from host_monitor.launch import Launch, Launcher
from host_monitor.metrics import HeartbeatCounts, HostMonitorMetrics
from host_monitor.node import CheckpointRecord, Node
from host_monitor.peer.probes import PeerProbes
from host_monitor.peer.tier import PeerTier, peer_counts
from host_monitor.server import create_app
from host_monitor.watchdogs import GpuReporter, Watchdog
from host_monitor.watchdogs.ecc import EccWatchdog, SyntheticEcc
from host_monitor.watchdogs.nvidia_smi import GpuTopology
from host_monitor.watchdogs.nvml import NvmlWatchdog
from host_monitor.watchdogs.xid import XidWatchdog, open_kernel_log
from host_monitor.wire import GpuReport
from resiliency_protocol.node_commands import StopWorkersRequest
from resiliency_protocol.shared_settings import SERVER_KEEP_ALIVE_S
from resiliency_protocol.worlds import StaleWorld

log = logging.getLogger("host_monitor")

PROCESS_POLL_S = 0.1
SERVER_STOP_TIMEOUT_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the agent owns SIGTERM/SIGINT, because
    stopping means stopping the workers first, not only the API."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)  # launched workers must not hold our port open
    return sock


WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def urls(sock: socket.socket, scheme: str = "http") -> tuple[str, str]:
    """(URL for this machine, URL for the supervisor) of the bound socket.

    Bound to a wildcard address, workers reach us on loopback and the supervisor by
    host name; otherwise both use the address we bound.
    """
    host, port = sock.getsockname()[:2]
    if host in WILDCARDS:
        return _url(scheme, WILDCARDS[host], port), _url(scheme, socket.getfqdn(), port)
    return _url(scheme, host, port), _url(scheme, host, port)


class Agent:
    def __init__(self, settings: HostMonitorSettings, launch: Launch | None = None) -> None:
        self.settings = settings
        self.launch = launch  # --launch: the node's workers are ours to start
        self.actuator_token = self._token("actuator_token", log_it=True)
        self.worker_token = self._token("worker_token", log_it=False)
        self._stopping = asyncio.Event()
        self._nvml: NvmlWatchdog | None = None
        self._ssl: ssl.SSLContext | None = None
        self._fencing: set[asyncio.Task[list[int]]] = set()

    def _token(self, name: str, *, log_it: bool) -> str:
        value = getattr(self.settings, name)
        if value is not None:
            token: str = value.get_secret_value()
            return token
        token = secrets.token_urlsafe(32)
        if log_it:  # the actuator must be told it; the workers we launch get theirs in env
            log.warning("%s not set; generated one for this run: %s", name, token)
        else:
            log.info("%s not set; generated one for this run (given to launched workers)", name)
        return token

    def request_stop(self) -> None:
        if not self._stopping.is_set():
            log.info("signal received: shutting down")
        self._stopping.set()

    async def run(self) -> int:
        s = self.settings
        sock = bind(s.host, s.host_daemon_port)
        url, advertised = urls(sock, s.scheme)
        self._ssl = s.ssl_context()  # checked at start-up (cli.py)
        node = Node(s, self.worker_token, url)
        probes = self._probes()
        sender = self._sender(node, advertised, probes)
        forwarder = self._forwarder(node)  # hooked before any worker can report
        xid, ecc, faults = await self._watchdogs(node, sender)
        peer = PeerTier(s, node, forwarder)
        if sender is not None:  # the supervisor's worlds fence the peer copies
            sender.on_job_world = peer.worlds.current
        peer.start()  # clears what a crash left in the peer store
        peer.start_channel(self.worker_token)
        metrics = self._metrics(node, sender, [xid, ecc, *([self._nvml] if self._nvml else [])])
        if peer.store is not None:
            metrics.sources.peer = lambda: peer_counts(peer)
        app = create_app(
            node,
            faults,
            worker_token=self.worker_token,
            actuator_token=self.actuator_token,
            peer=peer,
            metrics=metrics,
            metrics_token=s.metrics_token.get_secret_value() if s.metrics_token else None,
        )
        server = _Server(
            uvicorn.Config(
                app,
                log_config=None,  # ours (cli.py)
                log_level=s.log_level,
                access_log=False,
                lifespan="off",
                server_header=False,
                timeout_graceful_shutdown=2,
                timeout_keep_alive=SERVER_KEEP_ALIVE_S,
                # Both or neither (checked by the settings): HTTPS with them.
                ssl_certfile=s.tls_cert_file,
                ssl_keyfile=s.tls_key_file,
            )
        )

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

        serving = asyncio.create_task(server.serve(sockets=[sock]), name="http")
        while not server.started:
            # uvicorn has no "started" event to await; look every 10 ms.
            await asyncio.wait({serving}, timeout=0.01)
            if serving.done():
                serving.result()  # raises what stopped it
                return 1
        print(f"host-monitor {s.node} listening on {url}", flush=True)

        tasks = [
            asyncio.create_task(self._watch_workers(node), name="process-monitor"),
            asyncio.create_task(xid.run(), name="xid-watchdog"),
            asyncio.create_task(ecc.run(), name="ecc-watchdog"),
        ]
        if self._nvml is not None:
            tasks.append(asyncio.create_task(self._nvml.run(), name="nvml-watchdog"))
        if sender is not None:
            tasks.append(asyncio.create_task(sender.run(), name="heartbeat"))
        if probes is not None:
            tasks.append(asyncio.create_task(probes.run(), name="peer-probes"))
        if forwarder is not None:
            tasks.append(asyncio.create_task(forwarder.run(), name="checkpoint-forwarder"))
        if self.launch is not None:
            delivered = (lambda: sender.delivered) if sender is not None else None
            launcher = Launcher(self.launch, s, node, advertised, delivered, self._ssl)
            tasks.append(asyncio.create_task(launcher.run(self._stopping.set), name="launcher"))
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait(
                [stopping, serving, *tasks], return_when=asyncio.FIRST_COMPLETED
            )
            clean = stopping in done
            for task in done:
                if task is not stopping and not task.cancelled():
                    # Each of these runs forever: ending at all is a failure.
                    log.error("%s stopped unexpectedly: %r", task.get_name(), task.exception())
            await node.shutdown(s.shutdown_grace_s)
        finally:
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(serving), SERVER_STOP_TIMEOUT_S)
            except (TimeoutError, Exception):
                server.force_exit = True
                serving.cancel()
            for task in (*tasks, stopping):
                task.cancel()
            await asyncio.gather(*tasks, stopping, serving, return_exceptions=True)
            await peer.close()
            xid.close()
            faults.close()
            if self._nvml is not None:
                self._nvml.close()
            sock.close()
        log.info("host monitor of %s stopped", s.node)
        return 0 if clean else 1

    def _metrics(
        self, node: Node, sender: HeartbeatSender | None, watchdogs: list[Watchdog]
    ) -> HostMonitorMetrics:
        metrics = HostMonitorMetrics(self.settings.node)
        sources = metrics.sources
        if sender is not None:
            sources.heartbeats = lambda: HeartbeatCounts(
                sent=sender.delivered,
                failed=sender.failed_total,
                failing_in_a_row=sender.failing_in_a_row,
                last_success_unix_s=sender.last_delivered_unix_s,
            )
        sources.watchdogs = lambda: {w.name: w.healthy for w in watchdogs}
        sources.worker_starts = lambda: node.registry.starts
        sources.worker_states = lambda: [w.state.value for w in node.registry.statuses()]
        node.rounds.on_round_done = metrics.emergency_round
        return metrics

    def _probes(self) -> PeerProbes | None:
        s = self.settings
        credential = s.supervisor_credential()
        if s.supervisor_url is None or credential is None or not s.probe_peers:
            return None
        return PeerProbes(
            s.supervisor_url,
            credential,
            s.node,
            s.heartbeat_polling_period_s,
            ssl_context=self._ssl,
            peer_ssl_context=s.peer_ssl_context(),
        )

    def _sender(
        self, node: Node, address: str, probes: PeerProbes | None
    ) -> HeartbeatSender | None:
        s = self.settings
        if s.supervisor_url is None:
            log.warning("supervisor_url not set: no heartbeats will be sent")
            return None
        credential = s.supervisor_credential()
        assert credential is not None  # a supervisor_url is set
        sender = HeartbeatSender(
            s.supervisor_url,
            credential,
            s.node,
            s.heartbeat_polling_period_s,
            node.snapshot,
            address=address,
            on_delivered=node.delivered,
            ssl_context=self._ssl,
            mirrors=s.shadow_supervisor_urls,
            relay_url=s.heartbeat_relay_url,
            on_stale_world=lambda stale: self._stale_world(node, stale),
            unreachable_peers=probes.unreachable if probes is not None else None,
        )
        node.on_change = sender.trigger
        node.supervisor_heard = sender.heard_s
        node.wait_for_delivery = True
        return sender

    def _stale_world(self, node: Node, stale: StaleWorld) -> None:
        task = asyncio.get_running_loop().create_task(fence(node, stale), name="fence")
        self._fencing.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._fencing.discard)

    def _forwarder(self, node: Node) -> CheckpointForwarder | None:
        """Forwards the workers' checkpoint reports to the supervisor (for goodput)."""
        s = self.settings
        if s.supervisor_url is None:
            return None
        credential = s.supervisor_credential()
        assert credential is not None  # a supervisor_url is set
        forwarder = CheckpointForwarder(
            s.supervisor_url,
            credential,
            s.node,
            s.run_dir / f"{s.node}.checkpoint-outbox.jsonl",
            max_backoff_s=max(s.heartbeat_polling_period_s, 1.0),
            ssl_context=self._ssl,
        )

        def forward(record: CheckpointRecord, job: str | None) -> None:
            worker = node.registry.workers.get(record.rank)
            forwarder.add(
                record.report,
                rank=record.rank,
                job=job,
                time=record.time,
                world=node.world_of(worker) if worker is not None else None,
                key=record.key,
            )

        node.on_checkpoint = forward
        return forwarder

    async def _watchdogs(
        self, node: Node, sender: HeartbeatSender | None
    ) -> tuple[XidWatchdog, EccWatchdog, FaultActor]:
        """The GPU watchdogs, and the fault actor that feeds them. Says once at start
        which sources are missing."""
        s = self.settings

        def deliver(report: GpuReport) -> None:
            if sender is not None:
                sender.add_gpu_report(report)

        reporter = GpuReporter(s.gpu_report_cooldown_s, deliver)
        nvidia_smi = shutil.which(s.nvidia_smi)
        self._nvml, line = (
            NvmlWatchdog.open(reporter, s.watchdog_period_s)
            if s.nvml
            else (None, "nvml watchdog off (nvml: false)")
        )
        (log.info if self._nvml is not None else log.warning)("%s", line)
        ecc_smi = nvidia_smi
        if self._nvml is not None:
            self._nvml.start_events(asyncio.get_running_loop())
            ecc_smi = None  # NVML reads the ECC counts; injected ones still go through
            log.info("ecc watchdog: injected errors only (NVML reads the GPUs' counts)")
        elif nvidia_smi is None:
            log.warning(
                "ecc watchdog disabled: %s not found on PATH (injected ECC faults are still "
                "reported)",
                s.nvidia_smi,
            )
        else:
            log.info("ecc watchdog: reading %s every %.1fs", nvidia_smi, s.watchdog_period_s)
        source, line = open_kernel_log(s.kernel_log, s.kernel_log_disabled)
        (log.info if source is not None else log.warning)("%s", line)
        topology = await GpuTopology.discover(nvidia_smi)
        xid = XidWatchdog(source, topology, reporter, s.watchdog_period_s)
        synthetic = SyntheticEcc()
        ecc = EccWatchdog(ecc_smi, synthetic, reporter, s.watchdog_period_s)
        silence = sender.silence if sender is not None else lambda: None
        return xid, ecc, FaultActor(node, xid, ecc, synthetic, silence)

    async def _watch_workers(self, node: Node) -> None:
        # Cheap (one waitpid or kill(pid, 0) per worker), so exits are seen within 0.1 s.
        while True:
            node.registry.poll()
            node.release_if_idle()
            await asyncio.sleep(PROCESS_POLL_S)


async def fence(node: Node, stale: StaleWorld) -> list[int]:
    """Kill the workers the supervisor refused as an older world's (no grace: what they
    would save on the way out belongs to that world), and release the node when none is
    left. Ranks the node has since been told to join the newer world are kept. Returns
    the ranks stopped."""
    if node.job != stale.job:
        return []
    live = node.registry.live()
    doomed = []
    for worker in live:
        world = node.world_of(worker)
        if worker.rank in stale.ranks and world is not None and world < stale.world:
            doomed.append(worker)
    if not doomed:
        return []
    ranks = [w.rank for w in doomed]
    log.warning(
        "fenced: killing ranks %s of job %s (world older than %d)", ranks, stale.job, stale.world
    )
    if len(doomed) == len(live):
        await node.stop_workers(StopWorkersRequest(grace_s=0, release=True))
    else:
        await node.registry.stop(0, only=doomed)
    return ranks
