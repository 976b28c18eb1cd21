"""The peer checkpoint tier on this node: the partner, pushes to it, fetches from it.

After each save to its RAM tier, a worker asks its host monitor to replicate the
committed directory (`.../step-<step:010d>/rank-<rank>/`) to the partner node: a
background push uploads each file, then commits the manifest (the partner verifies
every size and checksum). One push at a time per rank; a newer request replaces a
queued older one, a running push finishes. A worker on a swapped-in spare (empty RAM)
receives the partner's copy of its rank into its RAM tier, each file relayed by its
host monitor from the partner (channel.py), or has it downloaded by the host monitor
(fetch.py).

Files move over the partners' data channels (channel.py serves ours,
client.py uses theirs), lookups and commits over the HTTP API. Directories workers
name are opened by paths.py. No HTTP server here: the routes are in routes.py
and worker_routes.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from host_monitor.checkpoint_forwarder import CheckpointForwarder
from host_monitor.config import HostMonitorSettings
from host_monitor.metrics import PeerCounts
from host_monitor.node import Node
from host_monitor.peer.channel import PeerChannel, RelayRefused
from host_monitor.peer.client import PartnerClient
from host_monitor.peer.fetch import Fetch
from host_monitor.peer.files import rank_dir_name, step_dir_name
from host_monitor.peer.paths import (
    O_FILE,
    PeerTierError,
    open_dir_under,
    read_dir_manifest,
)
from host_monitor.peer.store import PeerStore
from host_monitor.peer.worlds import PeerWorlds
from resiliency_protocol.checkpoint_manifest import MANIFEST, Manifest
from resiliency_protocol.checkpoint_reports import CheckpointReport, Tier
from resiliency_protocol.clock import utcnow
from resiliency_protocol.error_reading import error_message
from resiliency_protocol.node_commands import CheckpointPeer
from resiliency_protocol.peer_checkpoints import (
    NO_JOB,
    ChannelInfo,
    ChannelRequest,
    CommitResult,
    FetchPeerRequest,
    FetchPeerResult,
    PeerCopy,
    PeerTierStatus,
    ReplicateRequest,
    ReplicateStatus,
)
from resiliency_protocol.tls import server_context

log = logging.getLogger(__name__)

__all__ = ["PeerTier", "PeerTierError"]

LOCAL_SOCKET = ".peer-channel.sock"  # in checkpoint_root

# --- pushes -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Push:
    rank: int
    step: int
    job: str  # path segment: the job, or NO_JOB
    directory: Path  # real path of the committed rank directory
    manifest: Manifest


@dataclass(slots=True)
class _RankPushes:
    latest: _Push | None = None  # the newest asked for; the status is about it
    pending: _Push | None = None
    task: asyncio.Task[None] | None = None
    status: ReplicateStatus = field(default_factory=ReplicateStatus)


class PeerTier:
    def __init__(
        self,
        settings: HostMonitorSettings,
        node: Node,
        forwarder: CheckpointForwarder | None = None,
    ) -> None:
        self.node = node
        self.forwarder = forwarder
        self.settings = settings
        self.checkpoint_root = settings.checkpoint_root
        # What this node's pushes moved to the partner (metrics; received: the channel's).
        self.pushed_bytes = 0
        self.pushed_s = 0.0
        self.store_dir = settings.peer_store
        self.timeout_s = settings.peer_timeout_s
        token = settings.peer_token
        # An empty token (an unset variable passed through) turns the tier off too.
        self.token = (token.get_secret_value() if token is not None else "") or None
        # Pushes of an older world than the job's newest seen here are refused.
        self.worlds = PeerWorlds()
        self.store = (
            None
            if self.token is None
            else PeerStore(
                self.store_dir,
                max_file_bytes=settings.peer_max_file_bytes,
                max_bytes=settings.peer_store_max_bytes,
                worlds=self.worlds,
            )
        )
        self._http: httpx.AsyncClient | None = None
        self._pushes: dict[int, _RankPushes] = {}
        # The partner is reached at its address and checked against tls_server_name.
        self._ssl = settings.peer_ssl_context()
        self.client = PartnerClient(self.token or "", self.timeout_s, self._ssl)
        self.channel: PeerChannel | None = None

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def start(self) -> None:
        if self.store is not None:
            self.store.start()
            self._open_checkpoint_root()
            log.info(
                "peer checkpoint tier on: copies in %s, workers' checkpoints under %s",
                self.store_dir,
                self.checkpoint_root,
            )
        else:
            log.info("peer checkpoint tier off (peer_token not set)")

    def _open_checkpoint_root(self) -> None:
        """Make `checkpoint_root` writable by workers of any user, sticky (as /dev/shm and
        /tmp are: none removes another's files), when it is ours: on Kubernetes it is a
        hostPath the kubelet creates as root 0755, and the workers' pods run as others."""
        root = self.checkpoint_root
        try:
            root.mkdir(parents=True, exist_ok=True)
            st = root.stat()
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o1777:
                root.chmod(0o1777)
        except OSError as exc:
            log.warning("checkpoint_root %s: cannot open it to the workers: %s", root, exc)

    def start_channel(self, worker_token: str) -> None:
        """Serve the data channel (in the running event loop) when the tier and
        peer_channel are on: on the API's address, TLS when the API has it. Workers
        (`worker_token`) have files of the partner's copy of their rank relayed."""
        s = self.settings
        if self.store is None or self.token is None or not s.peer_channel:
            return
        context = None
        if s.tls_cert_file is not None and s.tls_key_file is not None:
            context = server_context(s.tls_cert_file, s.tls_key_file)
        self.channel = PeerChannel(
            self.store,
            self.token,
            timeout_s=self.timeout_s,
            ssl_context=context,
            worker_token=worker_token,
            relay_source=self._relay_source,
        )
        # Under checkpoint_root, which the workers' pods mount too.
        self.channel.start(s.host, s.peer_channel_port, self.checkpoint_root / LOCAL_SOCKET)

    def channel_info(self, *, worker: bool = False) -> ChannelInfo:
        """GET /v1/peer/channel (partners), /v1/workers/{rank}/checkpoints/channel."""
        channel = self.channel
        local = None if channel is None or not worker else channel.local_path
        return ChannelInfo(
            port=None if channel is None else channel.port,
            tls=channel is not None and channel.tls,
            local=None if local is None else str(local),
        )

    async def close(self) -> None:
        tasks = [p.task for p in self._pushes.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.channel is not None:
            await self.channel.close()
        if self.store is not None:
            await self.store.close()
        self.client.close()
        if self._http is not None:
            await self._http.aclose()

    def status(self) -> PeerTierStatus:
        return PeerTierStatus(
            enabled=self.enabled,
            peer=self.node.checkpoint_peer,
            checkpoint_root=str(self.checkpoint_root),
            peer_store_dir=str(self.store_dir),
        )

    # --- helpers ------------------------------------------------------------------------

    def _job(self) -> str:
        return self.node.job or NO_JOB

    def _partner(self) -> tuple[CheckpointPeer, httpx.AsyncClient]:
        if self.token is None:
            raise PeerTierError(503, Tier.PEER, "peer tier off: peer_token is not set")
        peer = self.node.checkpoint_peer
        if peer is None:
            raise PeerTierError(
                503, Tier.PEER, f"node {self.node.name} has no checkpoint partner (checkpoint_peer)"
            )
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                headers={"Authorization": f"Bearer {self.token}"},
                verify=self._ssl,
            )
        return peer, self._http

    # --- the partner's copy -------------------------------------------------------------

    async def partner_copy(self, rank: int) -> PeerCopy:
        """GET /v1/workers/{rank}/checkpoints/peer: the partner's newest copy of `rank`."""
        peer, http = self._partner()
        return await self.client.lookup(peer, http, self._job(), rank)

    async def fetch(self, rank: int, req: FetchPeerRequest) -> FetchPeerResult:
        """Download the partner's copy of `rank` at `req.step` into the RAM tier `dest`."""
        peer, http = self._partner()
        fetch = Fetch(self.client, peer, http, self._job(), rank, req)
        return await fetch.run(self.checkpoint_root)

    async def _relay_source(self, req: ChannelRequest) -> tuple[socket.socket, int]:
        """The partner's channel, answering a `get` of a file of its copy of `req.rank`
        (of this node's job, whatever the worker said) at `req.step`."""
        try:
            peer, http = self._partner()
            return await self.client.open_get(peer, http, self._job(), req.rank, req.step, req.name)
        except PeerTierError as exc:
            raise RelayRefused(exc.status, str(exc)) from None

    # --- replicate ------------------------------------------------------------------------

    def replicate(self, rank: int, req: ReplicateRequest) -> ReplicateStatus:
        """Queue a push of a committed directory; the answer is at once (202)."""
        self._partner()
        push = self._checked_push(rank, req)
        pushes = self._pushes.setdefault(rank, _RankPushes())
        if pushes.pending is not None:
            log.info(
                "rank %d: push of step %d replaced by step %d before it ran",
                rank,
                pushes.pending.step,
                push.step,
            )
        pushes.pending = pushes.latest = push
        pushes.status = ReplicateStatus(
            step=push.step,
            state="queued",
            bytes=push.manifest.total_bytes,
            replicated_step=pushes.status.replicated_step,
        )
        if pushes.task is None or pushes.task.done():
            pushes.task = asyncio.create_task(self._drain(pushes), name=f"peer-push-rank{rank}")
        return pushes.status

    def replicate_status(self, rank: int) -> ReplicateStatus:
        pushes = self._pushes.get(rank)
        return ReplicateStatus() if pushes is None else pushes.status

    def _checked_push(self, rank: int, req: ReplicateRequest) -> _Push:
        fd, real = open_dir_under(self.checkpoint_root, req.path, "path")
        try:
            expected = (step_dir_name(req.step), rank_dir_name(rank))
            if (real.parent.name, real.name) != expected:
                raise PeerTierError(
                    422, "path", f"{req.path} is not a .../{expected[0]}/{expected[1]} directory"
                )
            manifest = read_dir_manifest(fd, "path")
        finally:
            os.close(fd)
        if (manifest.step, manifest.rank) != (req.step, rank):
            raise PeerTierError(
                422,
                "path",
                f"its {MANIFEST} is of rank {manifest.rank} at step {manifest.step}, "
                f"not rank {rank} at step {req.step}",
            )
        job = self._job()
        if manifest.job is not None and manifest.job != job:
            raise PeerTierError(
                409, "path", f"its {MANIFEST} is of job {manifest.job!r}; this node runs {job!r}"
            )
        return _Push(rank, req.step, job, real, manifest)

    async def _drain(self, pushes: _RankPushes) -> None:
        while pushes.pending is not None:
            push, pushes.pending = pushes.pending, None
            newest = pushes.latest is push
            if newest:
                pushes.status = pushes.status.model_copy(update={"state": "running"})
            started = time.monotonic()
            error: str | None = None
            try:
                result = await self._push(push)
                if not result.committed:
                    error = f"the partner keeps a newer save of this rank (step {result.kept_step})"
            except asyncio.CancelledError:
                raise
            except PeerTierError as exc:
                error = str(exc)
            except Exception as exc:  # a push must never take the drain task down
                log.exception("push of rank %d step %d failed", push.rank, push.step)
                error = f"{type(exc).__name__}: {exc}"
            seconds = round(time.monotonic() - started, 3)
            if error is None:
                log.info(
                    "rank %d step %d replicated to the partner: %d bytes in %.2fs",
                    push.rank,
                    push.step,
                    push.manifest.total_bytes,
                    seconds,
                )
                pushes.status = pushes.status.model_copy(update={"replicated_step": push.step})
                self.pushed_bytes += push.manifest.total_bytes
                self.pushed_s += seconds
                self._report(push, seconds)
            else:
                log.warning("rank %d step %d not replicated: %s", push.rank, push.step, error)
            if newest:
                pushes.status = pushes.status.model_copy(
                    update={
                        "state": "failed" if error else "done",
                        "seconds": seconds,
                        "error": error,
                    }
                )

    def _report(self, push: _Push, seconds: float) -> None:
        if self.forwarder is None:
            return
        try:
            report = CheckpointReport(
                event="saved",
                step=push.step,
                duration_s=0.0,  # the training loop did not wait for it
                tier=Tier.PEER,
                bytes=push.manifest.total_bytes,
                total_s=seconds,
            )
            self.forwarder.add(
                report,
                rank=push.rank,
                job=None if push.job == NO_JOB else push.job,
                time=utcnow().isoformat(),
            )
        except (ValueError, OSError) as exc:
            log.error("peer checkpoint report of rank %d not kept: %s", push.rank, exc)

    async def _push(self, push: _Push) -> CommitResult:
        peer, http = self._partner()
        commit_url = f"{self.client.base(peer, push.job, push.rank)}/{push.step}/commit"
        dir_fd, _ = open_dir_under(self.checkpoint_root, str(push.directory), "path")
        body = push.manifest.model_dump(mode="json")
        try:
            for full_pass in (1, 2):
                # The files at once, each in a thread of the client's pool; all of them
                # end (or fail) before the directory is closed.
                results = await asyncio.gather(
                    *(
                        self.client.upload(
                            peer,
                            http,
                            push.job,
                            push.rank,
                            push.step,
                            name,
                            lambda name=name, size=entry.size: _open_saved(dir_fd, name, size),  # type: ignore[misc]
                            push.manifest,
                        )
                        for name, entry in sorted(push.manifest.files.items())
                    ),
                    return_exceptions=True,
                )
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                response = await self.client.request(
                    peer, "commit", lambda: http.post(commit_url, json=body)
                )
                if response.status_code == 200:
                    return CommitResult.model_validate_json(response.content)
                stale = error_message(response).startswith("world:")  # never resent
                if response.status_code == 409 and full_pass == 1 and not stale:
                    # A file did not arrive as saved: the partner dropped it; send all again.
                    log.warning(
                        "rank %d step %d: partner refused the commit (%s); sending again",
                        push.rank,
                        push.step,
                        error_message(response),
                    )
                    continue
                raise self.client.refused_by(peer, "the commit", response)
        finally:
            os.close(dir_fd)
        raise AssertionError("unreachable")  # pragma: no cover


def _open_saved(dir_fd: int, name: str, size: int) -> int:
    """A file of a worker's committed directory, as its manifest lists it: 409 if it is
    not a regular file of that size (a symlink is not followed)."""
    try:
        fd = os.open(name, O_FILE, dir_fd=dir_fd)
    except OSError as exc:
        raise PeerTierError(409, "path", f"{name}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise PeerTierError(409, "path", f"{name}: {st.st_size} bytes, its manifest says {size}")
    return fd


def peer_counts(tier: PeerTier) -> PeerCounts:
    """Bytes and seconds of peer copies each way: pushed to the partner, and what the data
    channel received (pushes from the partner) and sent (fetches of the copies kept)."""
    channel = tier.channel
    moved = dict(channel.moved) if channel is not None else {"sent": 0, "received": 0}
    took = dict(channel.moved_s) if channel is not None else {"sent": 0.0, "received": 0.0}
    moved["sent"] += tier.pushed_bytes
    took["sent"] += tier.pushed_s
    return PeerCounts(bytes=moved, seconds=took, stale_world_refusals=tier.worlds.refused)
