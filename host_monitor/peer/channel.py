"""The peer data channel's server: files of the copies this node keeps, in and out, over
plain TCP (TLS where the API has it) at the speed of the wire.

HTTP through the API server parses every body chunk in Python; a checkpoint of tens of
GB moves here instead, one connection per file (wire.py): the header names the file
and carries the peer token, which is checked before anything else is read; an upload is
told to go ahead only once the store accepts it (size, room, not older than the copy
kept), so no byte of a refused file is ever read. Uploads land in the store as the HTTP
route's do (store.py), their checksum computed as they arrive and kept for the
commit, which then need not read them again; the commit itself stays on HTTP.

Transfers block in threads of their own pool, never in the event loop's default one:
heartbeats and the API never wait behind a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from host_monitor.errors import HostMonitorError
from host_monitor.peer.store import (
    Full,
    NotFound,
    PeerStore,
    PeerStoreError,
    Superseded,
    TooLarge,
)
from host_monitor.peer.wire import (
    BUFFER,
    ChannelClosed,
    await_close,
    configure,
    frame,
    recv_file,
    recv_frame,
    relay,
    send_file,
    send_frame,
)
from resiliency_protocol.checkpoint_manifest import CHECKSUM_BY_NAME
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.peer_checkpoints import ChannelReply, ChannelRequest

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # transfers at once; more wait for a slot
HEADER_TIMEOUT_S = 10.0  # a connection that sends no header in this long is dropped
T = TypeVar("T")
#: A relay's source: a connection to the partner's channel that answered a `get` of the
#: file the worker asked for, and the file's size; RelayRefused when there is none.
RelaySource = Callable[[ChannelRequest], Awaitable[tuple[socket.socket, int]]]


class RelayRefused(HostMonitorError):
    """The partner's copy cannot be relayed: HTTP-like `status`, `detail`."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _Refused(HostMonitorError):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _status_of(exc: PeerStoreError) -> int:
    if isinstance(exc, TooLarge):
        return 413
    if isinstance(exc, Full):
        return 507
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, Superseded):
        return 409
    return 422


class PeerChannel:
    def __init__(
        self,
        store: PeerStore,
        token: str,
        *,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = MAX_CONNECTIONS,
        worker_token: str | None = None,
        relay_source: RelaySource | None = None,
    ) -> None:
        self.store = store
        self._token = token.encode()
        self._worker_token = worker_token.encode() if worker_token else None
        self._relay_source = relay_source
        self.timeout_s = timeout_s
        self.ssl_context = ssl_context
        self._slots = asyncio.Semaphore(max_connections)
        self._pool = ThreadPoolExecutor(max_connections + 1, thread_name_prefix="peer-channel")
        self._listener: socket.socket | None = None
        self._local_listener: socket.socket | None = None
        self._local: asyncio.Task[None] | None = None
        self.local_path: Path | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._open: set[socket.socket] = set()
        self.port: int | None = None
        # Bytes and seconds of the files this channel received and sent (metrics).
        self.moved: dict[str, int] = {"sent": 0, "received": 0}
        self.moved_s: dict[str, float] = {"sent": 0.0, "received": 0.0}

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    def _count(self, direction: str, size: int, started: float) -> None:
        self.moved[direction] += size
        self.moved_s[direction] += time.monotonic() - started

    def start(self, host: str, port: int, local: Path | None = None) -> int:
        """Listen on (host, port), 0 for a free port: the port. `local`: a Unix socket for
        this node's workers too (relays only)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        listener.set_inheritable(False)  # launched workers must not hold it open
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept(listener), name="peer-channel")
        log.info("peer data channel on %s port %d%s", host, self.port, " (TLS)" * self.tls)
        if local is not None and self._relay_source is not None:
            try:
                self._local = self._listen_local(local)
            except OSError as exc:  # the TCP channel relays too: only slower
                log.warning("peer data channel: no Unix socket %s: %s", local, exc)
        return self.port

    def _listen_local(self, path: Path) -> asyncio.Task[None]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by a host monitor before us
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            path.chmod(0o666)  # workers of any user; the worker token is checked
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        listener.set_inheritable(False)
        self._local_listener = listener
        self.local_path = path
        log.info("peer data channel for this node's workers on %s", path)
        return asyncio.create_task(self._accept(listener), name="peer-channel-local")

    async def close(self) -> None:
        for task in (self._accepting, self._local):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                listener.close()
        if self.local_path is not None:
            with contextlib.suppress(OSError):
                self.local_path.unlink()
        for sock in list(self._open):  # wakes the threads blocked on them
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for task in list(self._serving):
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of file descriptors: try again shortly
                log.warning("peer data channel: accept failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            task = asyncio.create_task(self._serve(sock))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, raw: socket.socket) -> None:
        self._open.add(raw)
        sock = raw
        try:
            async with self._slots:
                sock = await self._in_thread(lambda: self._handshake(raw))
                self._open.add(sock)
                try:
                    request = self._authorized(await self._in_thread(lambda: recv_frame(sock)))
                    if raw.family == socket.AF_UNIX and request.op != "relay":
                        raise _Refused(403, "op: the local socket only relays")
                    if request.op == "put":
                        await self._put(sock, request)
                    elif request.op == "get":
                        await self._get(sock, request)
                    else:
                        await self._relay(sock, request)
                except _Refused as refused:
                    reply = ChannelReply(status=refused.status, detail=refused.detail)
                    await self._in_thread(lambda: send_frame(sock, reply))
        except (OSError, ChannelClosed, ssl.SSLError) as exc:
            log.info("peer data channel: connection dropped: %s", exc)
        finally:
            self._open.discard(raw)
            self._open.discard(sock)
            sock.close()
            raw.close()

    def _handshake(self, raw: socket.socket) -> socket.socket:
        configure(raw, HEADER_TIMEOUT_S)
        if self.ssl_context is None or raw.family == socket.AF_UNIX:
            return raw
        return self.ssl_context.wrap_socket(raw, server_side=True)

    def _authorized(self, frame: bytes) -> ChannelRequest:
        """The request, once its token is the peer token (401 before anything else)."""
        try:
            body = json.loads(frame)
        except ValueError:
            raise _Refused(400, "header: not JSON") from None
        if not isinstance(body, dict):
            raise _Refused(400, "header: not a JSON object")
        token, relay = body.get("token"), body.get("op") == "relay"
        # A worker of this node relays with its token; anything else takes the peer token.
        expected = self._worker_token if relay else self._token
        if (
            not isinstance(token, str)
            or expected is None
            or not secrets.compare_digest(token.encode(), expected)
        ):
            role = "worker" if relay else Tier.PEER
            raise _Refused(401, f"missing or invalid {role} token")
        try:
            return ChannelRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise _Refused(422, f"{where}: {first['msg']}".replace("Value error, ", "")) from None

    async def _put(self, sock: socket.socket, req: ChannelRequest) -> None:
        if req.size is None:
            raise _Refused(422, "size: required to upload")
        size = req.size
        try:
            self.store.check_upload(req.job, req.rank, size, req.created, req.world, req.step)
        except PeerStoreError as exc:
            raise _Refused(_status_of(exc), str(exc)) from None
        checksum = CHECKSUM_BY_NAME[req.checksum]
        buffer = bytearray(min(BUFFER, max(size, 1)))

        def receive(fd: int) -> tuple[int, int]:
            configure(sock, self.timeout_s)
            send_frame(sock, ChannelReply(status=100))  # go ahead
            return size, recv_file(sock, fd, size, checksum, buffer)

        async def fill(fd: int) -> tuple[int, int]:
            return await self._in_thread(lambda: receive(fd))

        started = time.monotonic()
        try:
            _, crc = await self.store.receive_with(
                req.job, req.rank, req.step, req.name, fill, req.checksum, reserve=size
            )
        except PeerStoreError as exc:
            raise _Refused(_status_of(exc), str(exc)) from None
        self._count("received", size, started)
        reply = ChannelReply(status=200, size=size, checksum=crc)
        await self._in_thread(lambda: send_frame(sock, reply))

    async def _relay(self, sock: socket.socket, req: ChannelRequest) -> None:
        """A file of the partner's copy of the worker's rank, passed on to the worker: the
        bytes land in the worker's memory (its RAM tier), charged to it, never to us."""
        if self._relay_source is None:
            raise _Refused(503, "peer: no partner to relay from")
        try:
            upstream, size = await self._relay_source(req)
        except RelayRefused as exc:
            raise _Refused(exc.status, exc.detail) from None
        self._open.add(upstream)
        reply = ChannelReply(status=200, size=size)

        def pass_on() -> None:
            configure(sock, self.timeout_s)
            if sock.family == socket.AF_UNIX and not isinstance(upstream, ssl.SSLSocket):
                # The partner's connection itself, to be read by the worker: its bytes
                # cross no third process.
                socket.send_fds(sock, [frame(reply)], [upstream.fileno()])
                return
            send_frame(sock, reply)
            relay(upstream, sock, size)
            await_close(sock)

        try:
            await self._in_thread(pass_on)
        finally:
            self._open.discard(upstream)
            upstream.close()

    async def _get(self, sock: socket.socket, req: ChannelRequest) -> None:
        try:
            fd, size = self.store.open_file(req.job, req.rank, req.step, req.name)
        except PeerStoreError as exc:
            raise _Refused(_status_of(exc), str(exc)) from None

        def send() -> None:
            configure(sock, self.timeout_s)
            send_frame(sock, ChannelReply(status=200, size=size))
            send_file(sock, fd, size)
            await_close(sock)

        started = time.monotonic()
        try:
            await self._in_thread(send)
        finally:
            os.close(fd)
        self._count("sent", size, started)
