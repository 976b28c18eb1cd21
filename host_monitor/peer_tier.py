"""The peer checkpoint tier on this node: the partner, pushes to it, fetches from it.

After each save to its RAM tier, a worker asks its host monitor to replicate the
committed directory (`.../step-<step:010d>/rank-<rank>/`) to the partner node: a
background push uploads each file, streamed, then commits the manifest (the partner
verifies every size and checksum). One push at a time per rank; a newer request replaces a
queued older one, a running push finishes. A worker on a swapped-in spare (empty RAM)
asks for the partner's copy of its rank and has it downloaded, verified, into its RAM
tier, under a temporary name renamed into place.

Workers may only name directories under `checkpoint_root` (symlinks resolved, and the
directory actually opened checked again): the host monitor may run as root, and must
not read or write anything else for them. No HTTP server here: the routes are in
peer_routes.py and peer_worker_routes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import logging
import os
import random
import shutil
import ssl
import stat
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import ValidationError

from host_monitor.checkpoint_forwarder import CheckpointForwarder
from host_monitor.config import HostMonitorSettings
from host_monitor.errors import HostMonitorError
from host_monitor.node import Node
from host_monitor.peer_protocol import (
    MANIFEST,
    NO_JOB,
    Checksum,
    CommitResult,
    FetchPeerRequest,
    FetchPeerResult,
    FileEntry,
    Manifest,
    PeerCopy,
    PeerTierStatus,
    ReplicateRequest,
    ReplicateStatus,
)
from host_monitor.peer_store import (
    CHUNK,
    MAX_MANIFEST_BYTES,
    PeerStore,
    rank_dir_name,
    step_dir_name,
    write_all,
)
from host_monitor.protocol import CheckpointPeer
from resiliency_protocol.backoff import attempt_delay
from resiliency_protocol.errors import error_message
from resiliency_protocol.states import utcnow
from resiliency_protocol.tls import client_context

log = logging.getLogger(__name__)

ATTEMPTS = 4  # per request to the partner: transport errors, 5xx and 429 are retried
BACKOFF_S = 0.5  # doubled each time, with jitter
# A lookup answers a worker that waits (its client gives up after 5 s): fail fast, it can
# ask again.
LOOKUP_ATTEMPTS = 2
LOOKUP_TIMEOUT_S = 2.0
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
O_OVERWRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC

T = TypeVar("T")


class PeerTierError(HostMonitorError):
    """A worker's request that cannot be served: HTTP `status`, `field` names why."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.status = status
        self.field = field
        self.message = message


class _Transient(HostMonitorError):
    """A failed attempt worth retrying."""


# --- directories workers name -------------------------------------------------------------


def _opened_path(fd: int) -> Path:
    """Where an open directory really is (after any symlink swap)."""
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


def open_dir_under(root: Path, path: str, field: str, *, create: bool = False) -> tuple[int, Path]:
    """Open the directory `path`, which must lie under `root` once symlinks are resolved:
    (fd, real path). 403 outside; 422 when not a directory (404 when missing)."""
    given = Path(path)
    if not given.is_absolute():
        raise PeerTierError(422, field, f"{path!r} is not an absolute path")
    real_root = root.resolve()
    outside = PeerTierError(403, field, f"{path} is outside checkpoint_root {root}")
    resolved = given.resolve()
    if not resolved.is_relative_to(real_root):
        raise outside
    if create:
        try:
            resolved.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PeerTierError(422, field, f"cannot create {path}: {exc.strerror}") from None
    try:
        fd = os.open(resolved, O_DIR)
    except FileNotFoundError:
        raise PeerTierError(404, field, f"{path}: no such directory") from None
    except OSError as exc:
        raise PeerTierError(422, field, f"{path}: {exc.strerror or exc}") from None
    real = _opened_path(fd)
    if not real.is_relative_to(real_root):  # a component was swapped for a symlink
        os.close(fd)
        raise outside
    return fd, real


def _owner(dir_fd: int) -> tuple[int, int] | None:
    """Files we create in a worker's directory get its owner when we run as root, so the
    worker can delete them."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(dir_fd)
    return st.st_uid, st.st_gid


def _chown(name: str, dir_fd: int, owner: tuple[int, int] | None) -> None:
    if owner is not None:
        os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)


def _read_manifest(dir_fd: int, field: str) -> Manifest:
    try:
        fd = os.open(MANIFEST, O_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        raise PeerTierError(422, field, f"no {MANIFEST}: not a committed checkpoint") from None
    try:
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PeerTierError(
            422, field, f"{MANIFEST}: {where}: {first['msg']}".replace("Value error, ", "")
        ) from None


def _committed(dir_fd: int, name: str) -> bool:
    try:
        os.stat(f"{name}/{MANIFEST}", dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _get_into(
    url: str,
    token: str,
    fd: int,
    expected: int,
    timeout_s: float,
    checksum: Checksum,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[int, int, int, bytes]:
    """GET `url` and write its body to `fd`: (status, bytes, checksum, error body).

    Blocking, for a thread: `http.client` reads the body straight into one reused buffer
    (recv_into), which moves a multi-GB checkpoint several times faster than an async
    client's 64 KiB chunks. Reads at most `expected` + 1 bytes.
    """
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port
    connection = (
        http.client.HTTPSConnection(
            host,
            port or 443,
            timeout=timeout_s,
            context=ssl_context if ssl_context is not None else client_context(),
        )
        if parts.scheme == "https"
        else http.client.HTTPConnection(host, port or 80, timeout=timeout_s)
    )
    try:
        connection.request("GET", parts.path, headers={"Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        if response.status != 200:
            return response.status, 0, 0, response.read(2000)
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        size, crc = 0, 0
        while size <= expected:
            n = response.readinto(view)
            if not n:
                break
            size += n
            crc = checksum(view[:n], crc)
            write_all(fd, view[:n])
        return response.status, size, crc, b""
    finally:
        connection.close()


def _remove_dir(name: str, dir_fd: int) -> None:
    shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)


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
        self.checkpoint_root = settings.checkpoint_root
        self.store_dir = settings.peer_store
        self.timeout_s = settings.peer_timeout_s
        token = settings.peer_token
        # An empty token (an unset variable passed through) turns the tier off too.
        self.token = (token.get_secret_value() if token is not None else "") or None
        self.store = (
            None
            if self.token is None
            else PeerStore(self.store_dir, max_file_bytes=settings.peer_max_file_bytes)
        )
        self._http: httpx.AsyncClient | None = None
        self._pushes: dict[int, _RankPushes] = {}
        # The partner is reached at its address and checked against tls_server_name.
        self._ssl = settings.peer_ssl_context()

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

    async def close(self) -> None:
        tasks = [p.task for p in self._pushes.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
            raise PeerTierError(503, "peer", "peer tier off: peer_token is not set")
        peer = self.node.checkpoint_peer
        if peer is None:
            raise PeerTierError(
                503, "peer", f"node {self.node.name} has no checkpoint partner (checkpoint_peer)"
            )
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                headers={"Authorization": f"Bearer {self.token}"},
                verify=self._ssl,
            )
        return peer, self._http

    @staticmethod
    def _base(peer: CheckpointPeer, job: str, rank: int) -> str:
        return f"{peer.url.rstrip('/')}/v1/peer/checkpoints/{job}/{rank}"

    async def _retrying(
        self,
        peer: CheckpointPeer,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        attempts: int = ATTEMPTS,
    ) -> T:
        """`attempt()` until it does not raise _Transient (or a transport error); 503
        naming the partner after `attempts` tries."""
        for number in range(1, attempts + 1):
            try:
                return await attempt()
            except _Transient as exc:
                problem = str(exc)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if number == attempts:
                break
            log.info("%s: %s (attempt %d of %d)", what, problem, number, attempts)
            await asyncio.sleep(attempt_delay(BACKOFF_S, number, jitter=random.random))
        raise PeerTierError(
            503, "peer", f"partner {peer.node} ({peer.url}) unreachable: {what}: {problem}"
        )

    async def _request(
        self,
        peer: CheckpointPeer,
        what: str,
        send: Callable[[], Awaitable[httpx.Response]],
        attempts: int = ATTEMPTS,
    ) -> httpx.Response:
        """A request to the partner, retried on transport errors, 5xx and 429."""

        async def attempt() -> httpx.Response:
            response = await send()
            if response.status_code >= 500 or response.status_code == 429:
                raise _Transient(f"HTTP {response.status_code}: {error_message(response)}")
            return response

        return await self._retrying(peer, what, attempt, attempts)

    def _refused_by(self, peer: CheckpointPeer, what: str, response: httpx.Response) -> Exception:
        return PeerTierError(
            503,
            "peer",
            f"partner {peer.node} refused {what}: HTTP {response.status_code}: "
            f"{error_message(response)}",
        )

    # --- the partner's copy -------------------------------------------------------------

    async def partner_copy(self, rank: int) -> PeerCopy:
        """GET /v1/workers/{rank}/checkpoints/peer: the partner's newest copy of `rank`."""
        peer, client = self._partner()
        return await self._partner_copy(peer, client, self._job(), rank)

    async def _partner_copy(
        self, peer: CheckpointPeer, client: httpx.AsyncClient, job: str, rank: int
    ) -> PeerCopy:
        url = self._base(peer, job, rank)
        timeout = min(self.timeout_s, LOOKUP_TIMEOUT_S)
        response = await self._request(
            peer, "lookup", lambda: client.get(url, timeout=timeout), LOOKUP_ATTEMPTS
        )
        if response.status_code == 404:
            raise PeerTierError(
                404, "rank", f"partner {peer.node} has no copy of rank {rank} of job {job}"
            )
        if response.status_code != 200:
            raise self._refused_by(peer, "the lookup", response)
        try:
            return PeerCopy.model_validate_json(response.content)
        except ValidationError:
            raise PeerTierError(503, "peer", f"partner {peer.node} sent no valid copy") from None

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
            manifest = _read_manifest(fd, "path")
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
            self.forwarder.add(
                rank=push.rank,
                job=None if push.job == NO_JOB else push.job,
                event="saved",
                step=push.step,
                duration_s=0.0,  # the training loop did not wait for it
                tier="peer",
                size_bytes=push.manifest.total_bytes,
                total_s=seconds,
                time=utcnow().isoformat(),
            )
        except (ValueError, OSError) as exc:
            log.error("peer checkpoint report of rank %d not kept: %s", push.rank, exc)

    async def _push(self, push: _Push) -> CommitResult:
        peer, client = self._partner()
        base = f"{self._base(peer, push.job, push.rank)}/{push.step}"
        dir_fd, _ = open_dir_under(self.checkpoint_root, str(push.directory), "path")
        body = push.manifest.model_dump(mode="json")
        try:
            for full_pass in (1, 2):
                for name, entry in sorted(push.manifest.files.items()):
                    await self._upload(peer, client, f"{base}/files/{name}", dir_fd, name, entry)
                response = await self._request(
                    peer, "commit", lambda: client.post(f"{base}/commit", json=body)
                )
                if response.status_code == 200:
                    return CommitResult.model_validate_json(response.content)
                if response.status_code == 409 and full_pass == 1:
                    # A file did not arrive as saved: the partner dropped it; send all again.
                    log.warning(
                        "rank %d step %d: partner refused the commit (%s); sending again",
                        push.rank,
                        push.step,
                        error_message(response),
                    )
                    continue
                raise self._refused_by(peer, "the commit", response)
        finally:
            os.close(dir_fd)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _upload(
        self,
        peer: CheckpointPeer,
        client: httpx.AsyncClient,
        url: str,
        dir_fd: int,
        name: str,
        entry: FileEntry,
    ) -> None:
        try:
            fd = os.open(name, O_FILE, dir_fd=dir_fd)
        except OSError as exc:
            raise PeerTierError(409, "path", f"{name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                raise PeerTierError(
                    409,
                    "path",
                    f"{name}: {st.st_size} bytes, its manifest says {entry.size}",
                )
            headers = {
                "Content-Length": str(entry.size),
                "Content-Type": "application/octet-stream",
            }
            response = await self._request(
                peer,
                f"upload of {name}",
                lambda: client.put(url, content=_read_chunks(fd, entry.size), headers=headers),
            )
        finally:
            os.close(fd)
        if response.status_code != 200:
            raise self._refused_by(peer, f"the upload of {name}", response)

    # --- fetch ------------------------------------------------------------------------------

    async def fetch(self, rank: int, req: FetchPeerRequest) -> FetchPeerResult:
        """Download the partner's copy of `rank` at `req.step` into
        `<dest>/step-<step>/rank-<rank>/` (temporary directory, verified, renamed)."""
        peer, client = self._partner()
        job = self._job()
        started = time.monotonic()
        step_name, rank_name = step_dir_name(req.step), rank_dir_name(rank)
        dest_fd, dest = open_dir_under(self.checkpoint_root, req.dest, "dest", create=True)
        path = dest / step_name / rank_name
        owner = _owner(dest_fd)
        made_step_dir = False
        done = False
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(step_name, 0o755, dir_fd=dest_fd)
                made_step_dir = True
                _chown(step_name, dest_fd, owner)
            try:
                step_fd = os.open(step_name, O_DIR, dir_fd=dest_fd)
            except OSError as exc:
                raise PeerTierError(422, "dest", f"{dest / step_name}: {exc.strerror}") from None
            try:
                if _committed(step_fd, rank_name):
                    done = True
                    return self._fetched(req, path, 0, started, existed=True)
                try:
                    size = await self._fetch_into(peer, client, job, rank, req.step, step_fd, owner)
                except OSError as exc:  # e.g. the RAM tier is full
                    code = 507 if exc.errno == errno.ENOSPC else 500
                    raise PeerTierError(code, "dest", f"{path}: {exc.strerror or exc}") from None
                done = True
                if size is None:  # another fetch committed it meanwhile
                    return self._fetched(req, path, 0, started, existed=True)
                log.info(
                    "rank %d step %d restored from partner %s into %s (%d bytes)",
                    rank,
                    req.step,
                    peer.node,
                    path,
                    size,
                )
                return self._fetched(req, path, size, started, existed=False)
            finally:
                os.close(step_fd)
        finally:
            if made_step_dir and not done:
                with contextlib.suppress(OSError):  # only if still empty
                    os.rmdir(step_name, dir_fd=dest_fd)
            os.close(dest_fd)

    @staticmethod
    def _fetched(
        req: FetchPeerRequest, path: Path, size: int, started: float, *, existed: bool
    ) -> FetchPeerResult:
        seconds = round(time.monotonic() - started, 3)
        return FetchPeerResult(
            step=req.step, path=str(path), bytes=size, seconds=seconds, existed=existed
        )

    async def _fetch_into(
        self,
        peer: CheckpointPeer,
        client: httpx.AsyncClient,
        job: str,
        rank: int,
        step: int,
        step_fd: int,
        owner: tuple[int, int] | None,
    ) -> int | None:
        """Download into a temporary directory of `step_fd`, renamed to rank-<rank> once
        complete: the bytes downloaded, None when rank-<rank> was committed meanwhile."""
        copy = await self._partner_copy(peer, client, job, rank)
        if copy.step != step:
            raise PeerTierError(
                404,
                "step",
                f"partner {peer.node} keeps step {copy.step} of rank {rank}, not {step}",
            )
        base = f"{self._base(peer, job, rank)}/{step}"
        rank_name = rank_dir_name(rank)
        tmp_name = f".{rank_name}.tmp-{uuid.uuid4().hex[:12]}"
        os.mkdir(tmp_name, 0o755, dir_fd=step_fd)
        renamed = False
        try:
            _chown(tmp_name, step_fd, owner)
            tmp_fd = os.open(tmp_name, O_DIR, dir_fd=step_fd)
            try:
                files = sorted(copy.manifest.files.items())
                checksum = copy.manifest.checksum
                # The files at once: each download runs in a thread of its own.
                await asyncio.gather(
                    *(
                        self._download(
                            peer, f"{base}/files/{name}", tmp_fd, name, e, step, checksum
                        )
                        for name, e in files
                    )
                )
                for name, _ in files:
                    _chown(name, tmp_fd, owner)
                size = sum(e.size for _, e in files)
                fd = os.open(MANIFEST, O_NEW, 0o644, dir_fd=tmp_fd)
                try:
                    write_all(fd, copy.manifest.model_dump_json(indent=1).encode())
                finally:
                    os.close(fd)
                _chown(MANIFEST, tmp_fd, owner)
            finally:
                os.close(tmp_fd)
            try:
                os.rename(tmp_name, rank_name, src_dir_fd=step_fd, dst_dir_fd=step_fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if not _committed(step_fd, rank_name):
                    raise PeerTierError(
                        409, "dest", f"{rank_name} of step {step} exists, not committed"
                    ) from None
                return None
            renamed = True
            return size
        finally:
            if not renamed:
                await asyncio.to_thread(_remove_dir, tmp_name, step_fd)

    async def _download(
        self,
        peer: CheckpointPeer,
        url: str,
        dir_fd: int,
        name: str,
        entry: FileEntry,
        step: int,
        checksum: Checksum,
    ) -> None:
        async def attempt() -> None:
            fd = os.open(name, O_OVERWRITE, 0o644, dir_fd=dir_fd)
            try:
                status, size, crc, body = await asyncio.to_thread(
                    _get_into,
                    url,
                    self.token or "",
                    fd,
                    entry.size,
                    self.timeout_s,
                    checksum,
                    self._ssl,
                )
            except (OSError, http.client.HTTPException) as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from None
            finally:
                os.close(fd)
            if status == 404:
                raise PeerTierError(
                    404,
                    "step",
                    f"partner {peer.node} no longer has step {step} (a newer save replaced it)",
                )
            if status >= 500 or status == 429:
                raise _Transient(f"HTTP {status}")
            if status != 200:
                raise PeerTierError(
                    502,
                    "peer",
                    f"partner {peer.node} refused the download of {name}: "
                    f"HTTP {status} {body[:300]!r}",
                )
            if (size, crc) != (entry.size, entry.checksum):
                # Corrupted on the way (the partner verified it at commit): once more.
                raise _Transient(
                    f"{name}: got {size} bytes with checksum {crc}, expected {entry.size} "
                    f"bytes with checksum {entry.checksum}"
                )

        await self._retrying(peer, f"download of {name}", attempt)


async def _read_chunks(fd: int, size: int) -> AsyncIterator[bytes]:
    """The file from its start (pread: every attempt of an upload starts over)."""
    offset = 0
    while offset < size:
        chunk = await asyncio.to_thread(os.pread, fd, min(CHUNK, size - offset), offset)
        if not chunk:
            raise OSError(errno.EIO, "the file shrank while it was sent")
        offset += len(chunk)
        yield chunk
