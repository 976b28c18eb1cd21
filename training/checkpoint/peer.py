"""The peer tier as a training rank sees it: requests to its own host monitor.

The copy itself goes host monitor to host monitor (authenticated with the peer token,
which workers never hold): a rank only asks its node's host monitor to push a committed
RAM checkpoint to the partner node, to say what step of this rank the partner holds, and
to fetch that copy into this node's RAM tier. Nothing here raises because the host
monitor is absent or the peer tier is off: the answer is then "no peer copy".

A fetch is received by the rank itself: its host monitor relays each file from the
partner over its data channel (host_monitor/peer/channel.py, op `relay`, the worker
token), and the rank writes it into its RAM tier, checking it against the manifest. The
RAM tier is tmpfs, whose pages are charged to the memory cgroup of the process that
writes them: the rank's, sized for its RAM tier, not the host monitor's, which a copy of
many GB would kill. A host monitor without a channel fetches the copy itself (HTTP).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import ssl
import struct
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from resiliency_protocol.checkpoint_manifest import (
    MANIFEST,
    Checksum,
    FileEntry,
    Manifest,
    first_error,
)
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.peer_checkpoints import (
    ChannelReply,
    FetchPeerRequest,
    FetchPeerResult,
    PeerCopy,
    ReplicateRequest,
)
from training.checkpoint import format as fmt
from training.errors import TrainingError
from training.worker_client import (
    ENV_CA_FILE,
    ENV_MONITOR_URL,
    ENV_SERVER_NAME,
    ENV_TOKEN,
    ssl_context_for,
)

log = logging.getLogger(__name__)

_TIMEOUT_S = 5.0
#: What the host monitor may take to answer what the partner holds: two attempts of a
#: partner that is slow to answer (host_monitor/peer/client.py's lookup), and a margin.
LOOKUP_WAIT_S = 30.0


class PeerTier:
    def __init__(
        self,
        monitor_url: str | None,
        token: str | None,
        rank: int,
        *,
        fetch_timeout_s: float,
        ca_file: str | None = None,
        server_name: str | None = None,
    ) -> None:
        """An https:// monitor is verified as the worker client does (`ca_file`, else the
        system's trust store; `server_name`, else the URL's host)."""
        self.rank = rank
        self.fetch_timeout_s = fetch_timeout_s
        self._http: httpx.Client | None = None
        self._warned: set[str] = set()
        self._token = token or ""
        self._host = urllib.parse.urlsplit(monitor_url or "").hostname or ""
        self._ssl: ssl.SSLContext | None = None
        if monitor_url:
            ssl_context = ssl_context_for(monitor_url, ca_file, server_name)
            self._ssl = ssl_context
            self._http = httpx.Client(
                base_url=monitor_url.rstrip("/"),
                headers={"Authorization": f"Bearer {token}"} if token else {},
                timeout=_TIMEOUT_S,
                trust_env=False,
                verify=ssl_context if ssl_context is not None else True,
            )

    @classmethod
    def from_env(cls, rank: int, *, fetch_timeout_s: float = 300.0) -> PeerTier:
        """The worker client's variables: HOST_MONITOR_URL, HOST_MONITOR_WORKER_TOKEN,
        HOST_MONITOR_CA_FILE and HOST_MONITOR_SERVER_NAME."""
        return cls(
            os.environ.get(ENV_MONITOR_URL) or None,
            os.environ.get(ENV_TOKEN) or None,
            rank,
            fetch_timeout_s=fetch_timeout_s,
            ca_file=os.environ.get(ENV_CA_FILE) or None,
            server_name=os.environ.get(ENV_SERVER_NAME) or None,
        )

    @property
    def available(self) -> bool:
        return self._http is not None

    def replicate(self, step: int, path: Path) -> bool:
        """Ask the host monitor to push this committed directory to the partner (it
        answers at once and copies in the background)."""
        try:
            body = ReplicateRequest(step=step, path=str(path))
        except ValidationError as exc:
            self._warn("replicate", f"step {step} at {path} not asked for: {exc}")
            return False
        return self._call("POST", "replicate", json=body.model_dump(mode="json")) is not None

    def newest(self) -> int | None:
        """The step of this rank the partner holds, if any."""
        copy = self.newest_copy()
        return None if copy is None else copy[0]

    def newest_copy(self) -> tuple[int, int | None] | None:
        """(step, world it was written in; None: not known) of the partner's copy."""
        copies = self.copies()
        return copies[0] if copies else None

    def copies(self) -> list[tuple[int, int | None]]:
        """(step, world it was written in; None: not known) of each copy of this rank the
        partner keeps, the newest first (the save before it too: host_monitor/peer/
        retention.py)."""
        copy = self._partner_copy()
        if copy is None:
            return []
        return [(c.step, c.manifest.world) for c in (copy, *copy.older)]

    def _partner_copy(self) -> PeerCopy | None:
        """The partner's newest copy of this rank, as the host monitor answers it."""
        body = self._call("GET", Tier.PEER, timeout=LOOKUP_WAIT_S)
        if body is None:
            return None
        try:
            return PeerCopy.model_validate(body)
        except ValidationError as exc:
            self._warn(Tier.PEER, f"the partner's copy: {first_error(exc)}")
            return None

    def fetch(self, step: int, ram_root: Path) -> tuple[Path, bool] | None:
        """Fetch the partner's copy of `step` into this node's RAM tier: its directory,
        and whether every file was checked against the manifest as it arrived (False:
        the directory was there already)."""
        relayed = self._fetch_relayed(step, ram_root)
        if relayed is not None:
            return relayed
        try:
            request = FetchPeerRequest(step=step, dest=str(ram_root))
        except ValidationError as exc:
            self._warn("fetch-peer", f"step {step} into {ram_root} not asked for: {exc}")
            return None
        body = self._call(
            "POST",
            "fetch-peer",
            json=request.model_dump(mode="json"),
            timeout=self.fetch_timeout_s,
        )
        try:
            result = FetchPeerResult.model_validate(body)
        except ValidationError:
            return None  # none (already warned), or not a fetch's answer
        return Path(result.path), not result.existed

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    # --- the relay -----------------------------------------------------------------------

    def _fetch_relayed(self, step: int, ram_root: Path) -> tuple[Path, bool] | None:
        """The copy received here, relayed by the host monitor; None when it cannot be
        (no channel, another step kept, a failure: the host monitor's fetch is next)."""
        channel = self._call("GET", "channel")
        if not isinstance(channel, dict) or not isinstance(channel.get("port"), int):
            return None
        newest = self._partner_copy()
        copy = None if newest is None else newest.by_step(step)
        if copy is None:
            return None
        manifest = copy.manifest
        final = fmt.rank_dir(ram_root, step, self.rank)
        if (final / MANIFEST).exists():
            return final, False
        temp = fmt.new_temp_dir(ram_root, step, self.rank)
        address: tuple[str, int] | str = (self._host, int(channel["port"]))
        local = channel.get("local")
        if isinstance(local, str) and os.path.exists(local):
            address = local  # the host monitor's Unix socket: it hands over the partner's
        tls = bool(channel.get("tls"))
        try:
            files = sorted(manifest.files.items())
            with ThreadPoolExecutor(max(1, min(8, len(files)))) as pool:
                for _ in pool.map(
                    lambda item: self._relay_file(address, tls, step, temp, manifest, *item),
                    files,
                ):
                    pass
            fmt.commit(temp, manifest, final, sync=False)  # tmpfs: nothing to sync
        except (OSError, ValueError, ssl.SSLError, _RelayFailed) as exc:
            shutil.rmtree(temp, ignore_errors=True)
            self._warn("relay", f"relay of step {step} failed: {exc}")
            return None
        self._warned.discard("relay")
        return final, True

    def _relay_file(
        self,
        address: tuple[str, int] | str,
        tls: bool,
        step: int,
        temp: Path,
        manifest: Manifest,
        name: str,
        entry: FileEntry,
    ) -> None:
        """One file, relayed by the host monitor: over TCP (TLS as its API), or over its
        Unix socket, which hands over the partner's plain TCP connection itself."""
        header = {"token": self._token, "op": "relay", "job": "_", "rank": self.rank}
        data = json.dumps(header | {"step": step, "name": name}).encode()
        if isinstance(address, str):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(self.fetch_timeout_s)
            raw.connect(address)
        else:
            raw = socket.create_connection(address, timeout=self.fetch_timeout_s)
        with raw:
            sock = raw
            if tls and not isinstance(address, str):
                context = self._ssl or ssl.create_default_context()
                sock = context.wrap_socket(raw, server_hostname=self._host)
            with sock:
                sock.sendall(_MAGIC + _LENGTH.pack(len(data)) + data)
                reply, handed = _reply(sock)
                if reply.status != 200 or reply.size != entry.size:
                    if handed is not None:
                        handed.close()
                    raise _RelayFailed(f"{name}: {reply.status} {reply.detail}")
                source = handed or sock
                try:
                    source.settimeout(self.fetch_timeout_s)
                    crc = _receive(source, temp / name, entry.size, manifest.checksum)
                finally:
                    if handed is not None:
                        handed.close()
        if crc != entry.checksum:
            raise _RelayFailed(f"{name}: checksum {crc}, the manifest says {entry.checksum}")

    def _call(self, method: str, what: str, **kwargs: Any) -> Any | None:
        if self._http is None:
            return None
        path = f"/v1/workers/{self.rank}/checkpoints/{what}"
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self._warn(what, f"{method} {path} failed: {exc!r}")
            return None
        if response.status_code == 404:
            return None
        if response.status_code >= 300:
            self._warn(what, f"{method} {path}: HTTP {response.status_code} {response.text[:300]}")
            return None
        self._warned.discard(what)
        try:
            return response.json() if response.content else {}
        except ValueError:
            return {}

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("peer tier: %s", message)


# The data channel's frames (host_monitor/peer/wire.py): `RSPW`, a 4-byte big-endian
# length, JSON.
_MAGIC = b"RSPW"
_LENGTH = struct.Struct(">I")
_BUFFER = 1024 * 1024


class _RelayFailed(TrainingError):
    """The host monitor could not relay a file, or it arrived other than the manifest says."""


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise _RelayFailed("the host monitor closed the connection")
        data += chunk
    return bytes(data)


def _reply(sock: socket.socket) -> tuple[ChannelReply, socket.socket | None]:
    """The host monitor's answer, and the connection it handed over with it (a Unix
    socket's answer may carry the partner's connection: the file's bytes come on it)."""
    prefix = len(_MAGIC) + _LENGTH.size
    handed: socket.socket | None = None
    if sock.family == socket.AF_UNIX:
        head, fds, _, _ = socket.recv_fds(sock, prefix, 1)
        if fds:
            handed = socket.socket(fileno=fds[0])
        if not head:
            raise _RelayFailed("the host monitor closed the connection")
        head += _recv_exact(sock, prefix - len(head))
    else:
        head = _recv_exact(sock, prefix)
    if head[: len(_MAGIC)] != _MAGIC:
        raise _RelayFailed("the host monitor's answer is not a frame")
    (length,) = _LENGTH.unpack(head[len(_MAGIC) :])
    try:
        body = json.loads(_recv_exact(sock, min(length, 65536)))
        if not isinstance(body, dict):
            raise _RelayFailed("the host monitor's answer is not an object")
        return ChannelReply.model_validate(body), handed
    except BaseException:
        if handed is not None:
            handed.close()
        raise


def _receive(sock: socket.socket, path: Path, size: int, checksum: Checksum) -> int:
    """`size` bytes into a new file at `path`, through one buffer: their checksum."""
    buffer = bytearray(min(_BUFFER, max(size, 1)))
    view = memoryview(buffer)
    got, crc = 0, 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        while got < size:
            n = sock.recv_into(view, min(len(view), size - got))
            if not n:
                raise _RelayFailed(f"{path.name}: the connection ended at {got} of {size} bytes")
            crc = checksum(view[:n], crc)
            chunk = view[:n]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
            got += n
    finally:
        os.close(fd)
    return crc
