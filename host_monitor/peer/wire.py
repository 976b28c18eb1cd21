"""The peer data channel's bytes on a socket: framed headers and whole files, blocking.

A transfer between host monitors is one TCP connection (TLS where configured): a header
frame from the client, a reply frame, the file's bytes, and for an upload a final reply
frame. A frame is `RSPW`, a 4-byte big-endian length and that many bytes of JSON
(ChannelRequest and ChannelReply of resiliency_protocol.peer_checkpoints). Nothing here
knows what a header means: channel.py serves them, client.py sends them.

Files go at the speed of the wire: a plain socket sends with `sendfile` (the kernel
copies from the page cache, no Python per chunk) and receives with `recv_into` into one
preallocated buffer, filled whole (MSG_WAITALL) before it is checksummed and written. TLS
cannot use `sendfile` (the kernel would send plaintext): the file is read into a buffer
and encrypted from there. Every function here blocks: run them in threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import ssl
import struct

from pydantic import BaseModel

from host_monitor.errors import HostMonitorError
from resiliency_protocol.checkpoint_manifest import Checksum

MAGIC = b"RSPW"
_LENGTH = struct.Struct(">I")
MAX_FRAME = 64 * 1024
#: Bytes received (and checksummed, and written) at a time: large enough that the
#: per-call cost vanishes, small enough to stay in the CPU's cache for the checksum.
BUFFER = 1024 * 1024
SENDFILE_MAX = 1 << 30  # per call: Linux sends at most 2 GiB - 4 KiB at once


class ChannelClosed(HostMonitorError, ConnectionError):
    """The other side closed the connection, or sent something that is not a frame."""


def configure(sock: socket.socket, timeout_s: float) -> None:
    """Blocking, with `timeout_s` per send or receive as socket options (a Python-level
    timeout would make the socket non-blocking underneath, and MSG_WAITALL useless)."""
    sock.settimeout(None)
    seconds = int(timeout_s)
    micro = int((timeout_s - seconds) * 1_000_000)
    value = struct.pack("ll", seconds, micro)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def frame(body: BaseModel) -> bytes:
    data = body.model_dump_json(exclude_none=True).encode()
    return MAGIC + _LENGTH.pack(len(data)) + data


def send_frame(sock: socket.socket, body: BaseModel) -> None:
    sock.sendall(frame(body))


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    if _fill(sock, memoryview(buffer)) != size:
        raise ChannelClosed(f"connection closed after {len(buffer)} of {size} bytes")
    return bytes(buffer)


def recv_frame(sock: socket.socket) -> bytes:
    """The JSON of one frame; ChannelClosed for anything that is not one."""
    head = recv_exact(sock, len(MAGIC) + _LENGTH.size)
    if head[: len(MAGIC)] != MAGIC:
        raise ChannelClosed("not a peer channel frame")
    (length,) = _LENGTH.unpack(head[len(MAGIC) :])
    if length > MAX_FRAME:
        raise ChannelClosed(f"frame of {length} bytes, more than {MAX_FRAME}")
    return recv_exact(sock, length)


def _fill(sock: socket.socket, view: memoryview) -> int:
    """Receive until `view` is full or the connection ends: the bytes received."""
    got = 0
    size = len(view)
    plain = not isinstance(sock, ssl.SSLSocket)
    while got < size:
        if plain:
            n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        else:
            n = sock.recv_into(view[got:], size - got)
        if not n:
            break
        got += n
    return got


def send_file(sock: socket.socket, fd: int, size: int) -> None:
    """`size` bytes of the open file `fd` from its start."""
    if not isinstance(sock, ssl.SSLSocket):
        offset = 0
        while offset < size:
            sent = os.sendfile(sock.fileno(), fd, offset, min(size - offset, SENDFILE_MAX))
            if not sent:
                raise OSError(f"the file ended at {offset} of {size} bytes")
            offset += sent
        return
    buffer = bytearray(BUFFER)
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        n = os.preadv(fd, [view[: min(BUFFER, size - offset)]], offset)
        if not n:
            raise OSError(f"the file ended at {offset} of {size} bytes")
        sock.sendall(view[:n])
        offset += n


def recv_file(
    sock: socket.socket, fd: int, size: int, checksum: Checksum, buffer: bytearray
) -> int:
    """Receive `size` bytes into the file `fd` (written at its current offset), through
    `buffer`: the bytes' checksum. ChannelClosed when the sender stops short."""
    view = memoryview(buffer)
    got, crc = 0, 0
    while got < size:
        chunk = view[: min(len(view), size - got)]
        n = _fill(sock, chunk)
        if n:
            crc = checksum(chunk[:n], crc)
            _write_all(fd, chunk[:n])
            got += n
        if n < len(chunk):
            raise ChannelClosed(f"connection closed after {got} of {size} bytes")
    return crc


def relay(source: socket.socket, dest: socket.socket, size: int) -> None:
    """Pass `size` bytes from `source` on to `dest`: spliced in the kernel (through a pipe,
    no copy into Python) between plain sockets, through a buffer when either is TLS."""
    if isinstance(source, ssl.SSLSocket) or isinstance(dest, ssl.SSLSocket):
        buffer = bytearray(BUFFER)
        view = memoryview(buffer)
        left = size
        while left:
            n = _fill(source, view[: min(BUFFER, left)])
            if not n:
                raise ChannelClosed(f"the source closed {left} bytes short")
            dest.sendall(view[:n])
            left -= n
        return
    read_end, write_end = os.pipe()
    try:
        with contextlib.suppress(OSError):  # a larger pipe: fewer calls
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, BUFFER)
        left = size
        while left:
            n = os.splice(source.fileno(), write_end, min(BUFFER, left), flags=_SPLICE_FLAGS)
            if not n:
                raise ChannelClosed(f"the source closed {left} bytes short")
            moved = 0
            while moved < n:
                moved += os.splice(read_end, dest.fileno(), n - moved, flags=_SPLICE_FLAGS)
            left -= n
    finally:
        os.close(read_end)
        os.close(write_end)


_SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_MORE


def await_close(sock: socket.socket) -> None:
    """Wait for the other side to close: closing first, with anything unread here (a TLS
    session ticket, say), would reset the connection and lose bytes still in flight."""
    try:
        while sock.recv(65536):
            pass
    except OSError:  # reset, timed out: nothing more to wait for
        pass


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]
