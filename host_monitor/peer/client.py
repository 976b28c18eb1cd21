"""Requests to the partner host monitor: lookups and commits over its HTTP API (peer
token), files over its data channel (channel.py), or over HTTP when it has none (a
partner of an older version, during a rolling upgrade).

Every request is retried on transport errors, 5xx and 429 (but 507: the partner's store
is full, and stays so for a while). A file that arrives with another checksum than its
manifest names was corrupted on the way: sent again. The data channel speaks TLS exactly
when the partner's API does: a channel of another kind is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import logging
import os
import random
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx
from pydantic import ValidationError

from host_monitor.errors import HostMonitorError
from host_monitor.peer.files import CHUNK, write_all
from host_monitor.peer.paths import PeerTierError
from host_monitor.peer.wire import (
    BUFFER,
    ChannelClosed,
    configure,
    recv_file,
    recv_frame,
    send_file,
    send_frame,
)
from resiliency_protocol.backoff import attempt_delay
from resiliency_protocol.checkpoint_manifest import Checksum, FileEntry, Manifest
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.error_reading import error_message
from resiliency_protocol.node_commands import CheckpointPeer
from resiliency_protocol.peer_checkpoints import ChannelInfo, ChannelReply, ChannelRequest, PeerCopy
from resiliency_protocol.tls import client_context

log = logging.getLogger(__name__)

ATTEMPTS = 4  # per request to the partner
BACKOFF_S = 0.5  # doubled each time, with jitter
# A lookup answers a worker that waits for it (training/checkpoint/peer.py gives it
# LOOKUP_WAIT_S). A partner that does not take the connection is gone, or its node is:
# fail fast, the worker restores from another tier. One that took it is alive, if busy (a
# loaded node answers in seconds): wait for its answer, or the restore falls back to an
# older step than the partner holds.
LOOKUP_ATTEMPTS = 2
LOOKUP_CONNECT_TIMEOUT_S = 2.0
LOOKUP_READ_TIMEOUT_S = 10.0
TRANSFERS = 8  # files moving at once (threads)
T = TypeVar("T")
Transfer = tuple[int, int, int, str]  # (status, bytes, checksum, error detail)


class Transient(HostMonitorError):
    """A failed attempt worth retrying."""


def _retried(status: int) -> bool:
    return (status >= 500 and status != 507) or status == 429


class PartnerClient:
    def __init__(self, token: str, timeout_s: float, ssl_context: ssl.SSLContext) -> None:
        self.token = token
        self.timeout_s = timeout_s
        self.ssl_context = ssl_context
        self._channels: dict[str, ChannelInfo] = {}
        self._pool = ThreadPoolExecutor(TRANSFERS, thread_name_prefix="peer-transfer")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    @staticmethod
    def base(peer: CheckpointPeer, job: str, rank: int) -> str:
        return f"{peer.url.rstrip('/')}/v1/peer/checkpoints/{job}/{rank}"

    async def retrying(
        self,
        peer: CheckpointPeer,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        attempts: int = ATTEMPTS,
    ) -> T:
        """`attempt()` until it does not raise Transient (or a transport error); 503
        naming the partner after `attempts` tries."""
        for number in range(1, attempts + 1):
            try:
                return await attempt()
            except Transient as exc:
                problem = str(exc)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if number == attempts:
                break
            log.info("%s: %s (attempt %d of %d)", what, problem, number, attempts)
            await asyncio.sleep(attempt_delay(BACKOFF_S, number, jitter=random.random))
        raise PeerTierError(
            503, Tier.PEER, f"partner {peer.node} ({peer.url}) unreachable: {what}: {problem}"
        )

    async def request(
        self,
        peer: CheckpointPeer,
        what: str,
        send: Callable[[], Awaitable[httpx.Response]],
        attempts: int = ATTEMPTS,
    ) -> httpx.Response:
        """A request to the partner's API, retried on transport errors, 5xx and 429."""

        async def attempt() -> httpx.Response:
            response = await send()
            if _retried(response.status_code):
                raise Transient(f"HTTP {response.status_code}: {error_message(response)}")
            return response

        return await self.retrying(peer, what, attempt, attempts)

    @staticmethod
    def refused_by(peer: CheckpointPeer, what: str, response: httpx.Response) -> PeerTierError:
        return PeerTierError(
            503,
            Tier.PEER,
            f"partner {peer.node} refused {what}: HTTP {response.status_code}: "
            f"{error_message(response)}",
        )

    # --- the API ---------------------------------------------------------------------------

    async def lookup(
        self, peer: CheckpointPeer, client: httpx.AsyncClient, job: str, rank: int
    ) -> PeerCopy:
        url = self.base(peer, job, rank)
        timeout = httpx.Timeout(
            min(self.timeout_s, LOOKUP_READ_TIMEOUT_S),
            connect=min(self.timeout_s, LOOKUP_CONNECT_TIMEOUT_S),
        )
        response = await self.request(
            peer, "lookup", lambda: client.get(url, timeout=timeout), LOOKUP_ATTEMPTS
        )
        if response.status_code == 404:
            raise PeerTierError(
                404, "rank", f"partner {peer.node} has no copy of rank {rank} of job {job}"
            )
        if response.status_code != 200:
            raise self.refused_by(peer, "the lookup", response)
        try:
            return PeerCopy.model_validate_json(response.content)
        except ValidationError:
            raise PeerTierError(503, Tier.PEER, f"partner {peer.node} sent no valid copy") from None

    async def channel(self, peer: CheckpointPeer, client: httpx.AsyncClient) -> ChannelInfo | None:
        """The partner's data channel, if it has one of the kind its API is (TLS or not)."""
        known = self._channels.get(peer.url)
        if known is not None:
            return known if known.port is not None else None
        url = f"{peer.url.rstrip('/')}/v1/peer/channel"
        response = await self.request(peer, "channel lookup", lambda: client.get(url))
        info = ChannelInfo(port=None, tls=False)
        if response.status_code == 200:
            with contextlib.suppress(ValidationError):  # not one: files go over HTTP
                info = ChannelInfo.model_validate_json(response.content)
        elif response.status_code != 404:  # 404: a partner from before the channel
            raise self.refused_by(peer, "the channel lookup", response)
        if info.port is not None and info.tls != peer.url.startswith("https:"):
            log.warning(
                "partner %s: its data channel is %s, its API is not: files go over HTTP",
                peer.node,
                "TLS" if info.tls else "plain TCP",
            )
            info = ChannelInfo(port=None, tls=info.tls)
        self._channels[peer.url] = info
        return info if info.port is not None else None

    def _connect(self, peer: CheckpointPeer, info: ChannelInfo) -> socket.socket:
        host = urllib.parse.urlsplit(peer.url).hostname or ""
        assert info.port is not None
        sock = socket.create_connection((host, info.port), timeout=self.timeout_s)
        try:
            configure(sock, self.timeout_s)
            if info.tls:
                return self.ssl_context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        return sock

    def _forget(self, peer: CheckpointPeer) -> None:
        """The channel failed: ask for it again next time (the partner may have moved)."""
        self._channels.pop(peer.url, None)

    # --- uploads ---------------------------------------------------------------------------

    async def upload(
        self,
        peer: CheckpointPeer,
        client: httpx.AsyncClient,
        job: str,
        rank: int,
        step: int,
        name: str,
        open_file: Callable[[], int],
        manifest: Manifest,
    ) -> None:
        """One file of a copy to the partner: `open_file()` opens it (the size its manifest
        says); the thread that sends it closes it."""
        entry = manifest.files[name]
        info = await self.channel(peer, client)
        if info is None:
            fd = open_file()
            try:
                await self._upload_http(peer, client, job, rank, step, name, fd, entry)
            finally:
                os.close(fd)
            return
        request = ChannelRequest(
            token=self.token,
            op="put",
            job=job,
            rank=rank,
            step=step,
            name=name,
            size=entry.size,
            checksum=manifest.checksum_name,
            world_size=manifest.world_size,
            created=manifest.created,
            world=manifest.world,
        )

        def put(info: ChannelInfo) -> ChannelReply:
            fd = open_file()
            try:
                with self._connect(peer, info) as sock:
                    send_frame(sock, request)
                    reply = ChannelReply.model_validate_json(recv_frame(sock))
                    if reply.status != 100:
                        return reply
                    send_file(sock, fd, entry.size)
                    return ChannelReply.model_validate_json(recv_frame(sock))
            finally:
                os.close(fd)

        async def attempt() -> None:
            # Asked again after a failure: the partner may have restarted on another port.
            current = await self.channel(peer, client) or info
            try:
                reply = await self._in_thread(lambda: put(current))
            except (OSError, ChannelClosed, ssl.SSLError, ValidationError) as exc:
                self._forget(peer)
                raise Transient(f"data channel: {type(exc).__name__}: {exc}") from None
            if _retried(reply.status):
                raise Transient(f"data channel: {reply.status}: {reply.detail}")
            if reply.status != 200:
                raise PeerTierError(
                    503,
                    Tier.PEER,
                    f"partner {peer.node} refused the upload of {name}: "
                    f"{reply.status}: {reply.detail}",
                )
            if (reply.size, reply.checksum) != (entry.size, entry.checksum):
                raise Transient(
                    f"{name}: the partner got {reply.size} bytes with checksum "
                    f"{reply.checksum}, expected {entry.size} with {entry.checksum}"
                )

        await self.retrying(peer, f"upload of {name}", attempt)

    async def _upload_http(
        self,
        peer: CheckpointPeer,
        client: httpx.AsyncClient,
        job: str,
        rank: int,
        step: int,
        name: str,
        fd: int,
        entry: FileEntry,
    ) -> None:
        url = f"{self.base(peer, job, rank)}/{step}/files/{name}"
        headers = {"Content-Length": str(entry.size), "Content-Type": "application/octet-stream"}
        response = await self.request(
            peer,
            f"upload of {name}",
            lambda: client.put(url, content=_read_chunks(fd, entry.size), headers=headers),
        )
        if response.status_code != 200:
            raise self.refused_by(peer, f"the upload of {name}", response)

    # --- relays ----------------------------------------------------------------------------

    async def open_get(
        self,
        peer: CheckpointPeer,
        client: httpx.AsyncClient,
        job: str,
        rank: int,
        step: int,
        name: str,
    ) -> tuple[socket.socket, int]:
        """A connection to the partner's channel that answered a `get` of the file: its
        bytes follow (the caller reads them and closes it), and its size."""
        info = await self.channel(peer, client)
        if info is None:
            raise PeerTierError(503, Tier.PEER, f"partner {peer.node} has no data channel")
        request = ChannelRequest(
            token=self.token, op="get", job=job, rank=rank, step=step, name=name
        )

        def open_() -> tuple[socket.socket, ChannelReply]:
            sock = self._connect(peer, info)
            try:
                send_frame(sock, request)
                return sock, ChannelReply.model_validate_json(recv_frame(sock))
            except BaseException:
                sock.close()
                raise

        async def attempt() -> tuple[socket.socket, int]:
            try:
                sock, reply = await self._in_thread(open_)
            except (OSError, ChannelClosed, ssl.SSLError, ValidationError) as exc:
                self._forget(peer)
                raise Transient(f"data channel: {type(exc).__name__}: {exc}") from None
            if reply.status == 200 and reply.size is not None:
                return sock, reply.size
            sock.close()
            if _retried(reply.status):
                raise Transient(f"data channel: {reply.status}: {reply.detail}")
            raise PeerTierError(
                404 if reply.status == 404 else 502,
                "step" if reply.status == 404 else Tier.PEER,
                f"partner {peer.node}: {reply.status}: {reply.detail}",
            )

        return await self.retrying(peer, f"relay of {name}", attempt)

    # --- downloads -------------------------------------------------------------------------

    async def download(
        self,
        peer: CheckpointPeer,
        client: httpx.AsyncClient,
        job: str,
        rank: int,
        step: int,
        name: str,
        open_file: Callable[[], int],
        entry: FileEntry,
        checksum: Checksum,
    ) -> None:
        """One file of the partner's copy into the fd `open_file()` opens (each attempt
        writes it from its start); verified against `entry`."""
        info = await self.channel(peer, client)
        url = f"{self.base(peer, job, rank)}/{step}/files/{name}"
        request = ChannelRequest(
            token=self.token, op="get", job=job, rank=rank, step=step, name=name
        )

        def get(fd: int, info: ChannelInfo | None) -> Transfer:
            if info is None:
                return _get_into(url, self.token, fd, entry.size, self.timeout_s, checksum,
                                 self.ssl_context)  # fmt: skip
            with self._connect(peer, info) as sock:
                send_frame(sock, request)
                reply = ChannelReply.model_validate_json(recv_frame(sock))
                if reply.status != 200:
                    return reply.status, 0, 0, reply.detail or ""
                if reply.size != entry.size:
                    return 200, reply.size or 0, 0, ""
                buffer = bytearray(min(BUFFER, max(entry.size, 1)))
                return 200, entry.size, recv_file(sock, fd, entry.size, checksum, buffer), ""

        def opened_get(info: ChannelInfo | None) -> Transfer:
            fd = open_file()
            try:
                return get(fd, info)
            finally:
                os.close(fd)

        async def attempt() -> None:
            # Asked again after a failure: the partner may have restarted on another port.
            current = await self.channel(peer, client) if info is not None else None
            try:
                status, size, crc, detail = await self._in_thread(lambda: opened_get(current))
            except (OSError, ChannelClosed, ssl.SSLError, ValidationError) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise  # the RAM tier is full: no retry frees it
                self._forget(peer)
                raise Transient(f"{type(exc).__name__}: {exc}") from None
            except http.client.HTTPException as exc:
                raise Transient(f"{type(exc).__name__}: {exc}") from None
            if status == 404:
                raise PeerTierError(
                    404,
                    "step",
                    f"partner {peer.node} no longer has step {step} (a newer save replaced it)",
                )
            if _retried(status):
                raise Transient(f"download: {status}")
            if status != 200:
                raise PeerTierError(
                    502,
                    Tier.PEER,
                    f"partner {peer.node} refused the download of {name}: {status} "
                    f"{detail[:300]!r}",
                )
            if (size, crc) != (entry.size, entry.checksum):
                # Corrupted on the way (the partner verified it at commit): once more.
                raise Transient(
                    f"{name}: got {size} bytes with checksum {crc}, expected {entry.size} "
                    f"bytes with checksum {entry.checksum}"
                )

        await self.retrying(peer, f"download of {name}", attempt)


def _get_into(
    url: str,
    token: str,
    fd: int,
    expected: int,
    timeout_s: float,
    checksum: Checksum,
    ssl_context: ssl.SSLContext | None = None,
) -> Transfer:
    """GET `url` and write its body to `fd` (a partner with no data channel).

    Blocking, for a thread: `http.client` reads the body straight into one reused buffer
    (recv_into). Reads at most `expected` + 1 bytes.
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
            return response.status, 0, 0, response.read(2000).decode(errors="replace")
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
        return response.status, size, crc, ""
    finally:
        connection.close()


async def _read_chunks(fd: int, size: int) -> AsyncIterator[bytes]:
    """The file from its start (pread: every attempt of an upload starts over)."""
    offset = 0
    while offset < size:
        chunk = await asyncio.to_thread(os.pread, fd, min(CHUNK, size - offset), offset)
        if not chunk:
            raise OSError(errno.EIO, "the file shrank while it was sent")
        offset += len(chunk)
        yield chunk
