"""TLS for our HTTP clients and servers. Standard library only, no imports of ours.

A client verifies the server with a CA bundle, or with the system's trust store when none
is given; verification is never turned off. `server_name` checks the server's certificate
against a fixed name instead of the host dialled: host monitors are reached at an address
(a pod IP, a node name) but hold a certificate issued for one DNS name (their Service's).

Shared by the supervisor, the host monitor and the training side.
"""

from __future__ import annotations

import functools
import socket
import ssl
from pathlib import Path

from resiliency_protocol.exceptions import ProtocolError

__all__ = ["TLSError", "client_context", "half_key_pair", "server_context"]


class TLSError(ProtocolError):
    """A certificate, key or CA file that cannot be used; the message is one line."""


class _NamedContext(ssl.SSLContext):
    """Checks `server_name` (and sends it as SNI) whatever host the connection was opened
    to. Both paths are covered: sockets (http.client, httpx's sync transport) and memory
    BIOs (asyncio and anyio, httpx's async transport)."""

    server_name: str

    def wrap_socket(
        self,
        sock: socket.socket,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        suppress_ragged_eofs: bool = True,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLSocket:
        return super().wrap_socket(
            sock,
            server_side,
            do_handshake_on_connect,
            suppress_ragged_eofs,
            self.server_name,
            session,
        )

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        return super().wrap_bio(incoming, outgoing, server_side, self.server_name, session)


def client_context(
    ca_file: str | Path | None = None,
    *,
    server_name: str | None = None,
    ca_name: str = "CA file",
) -> ssl.SSLContext:
    """A context that verifies servers: against `ca_file` (PEM), else the system's trust
    store; their certificate must name `server_name` when given, else the host dialled.
    The system store's plain context is one per process (`_system_trust`).

    Raises TLSError naming `ca_name` (the setting, say) when `ca_file` cannot be used.
    """
    if ca_file is None and not server_name:
        return _system_trust()
    if server_name:
        named = _NamedContext(ssl.PROTOCOL_TLS_CLIENT)
        named.server_name = server_name
        context: ssl.SSLContext = named
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file is None:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        return context
    try:
        context.load_verify_locations(cafile=str(ca_file))
    except ssl.SSLError as exc:  # an OSError too: first
        raise TLSError(f"{ca_name} {ca_file}: no PEM certificate in it ({_reason(exc)})") from None
    except OSError as exc:
        raise TLSError(f"{ca_name} {ca_file}: cannot read it ({_reason(exc)})") from None
    return context


@functools.cache
def _system_trust() -> ssl.SSLContext:
    """The context that verifies against the system's trust store, made once: reading the
    store takes about 65 ms of CPU, and a host monitor made one per client (heartbeats,
    peers, probes, the checkpoint forwarder) at every start. Clients only read it (httpx
    sets the same ALPN, HTTP/1.1, on each connection)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    return context


def half_key_pair(
    cert_file: object,
    key_file: object,
    *,
    cert_name: str = "tls_cert_file",
    key_name: str = "tls_key_file",
) -> str | None:
    """Why a server cannot serve HTTPS with `cert_file` and `key_file` when one is given
    without the other (None: both, or neither), naming the settings."""
    if (cert_file is None) == (key_file is None):
        return None
    given, missing = (cert_name, key_name) if key_file is None else (key_name, cert_name)
    return f"{given} is set without {missing}: HTTPS needs both"


def server_context(
    cert_file: str | Path,
    key_file: str | Path,
    *,
    cert_name: str = "certificate",
    key_name: str = "key",
) -> ssl.SSLContext:
    """A server context presenting `cert_file` (PEM, its chain after it) with `key_file`.

    Used at start-up to check the files (a server may build its own from them); raises
    TLSError naming `cert_name` or `key_name` (the settings, say).
    """
    for name, path in ((cert_name, cert_file), (key_name, key_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise TLSError(f"{name} {path}: cannot read it ({_reason(exc)})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert_file), str(key_file))
    except (OSError, ssl.SSLError) as exc:
        raise TLSError(
            f"{cert_name} {cert_file} and {key_name} {key_file}: not a PEM certificate and "
            f"its key ({_reason(exc)})"
        ) from None
    return context


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return exc.strerror or str(exc)
