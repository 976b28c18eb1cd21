"""The credential the host monitor presents to the supervisor (heartbeats, checkpoint
reports), as `Authorization: Bearer ...`.

One of (host_monitor/README.md, "Credentials"):
- `agent_token`: the token all host monitors share (weakest: it speaks for any node);
- `node_credential` or `node_credential_file`: this node's own credential, printed by
  `supervisor node-credential NODE`;
- `service_account_token_file`: the pod's projected service account token, bound to the
  supervisor's audience (Kubernetes). The kubelet rewrites it before it expires.

A file is read again when it changes (its inode, size or mtime: the kubelet swaps a
projected volume's files atomically) and after the supervisor answers 401, so a rotated
token is sent from the next request on.
"""

from __future__ import annotations

import os
from pathlib import Path

from host_monitor.errors import HostMonitorError


class CredentialError(HostMonitorError, ValueError):
    """The credential file cannot be read, or is empty."""


class BearerCredential:
    def __init__(self, *, token: str | None = None, path: Path | None = None) -> None:
        if (token is None) == (path is None):
            raise ValueError("give a token or a file, not both")
        self.path = path
        self._header = f"Bearer {token}" if token is not None else ""
        self._seen: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, credential: str | BearerCredential) -> BearerCredential:
        return credential if isinstance(credential, BearerCredential) else cls(token=credential)

    def header(self) -> str:
        """The Authorization header's value. Raises CredentialError for an unreadable file."""
        if self.path is None:
            return self._header
        try:
            st = os.stat(self.path)
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if seen != self._seen:
                token = self.path.read_text().strip()
                if not token:
                    raise CredentialError(f"credential file {self.path} is empty")
                self._header, self._seen = f"Bearer {token}", seen
        except OSError as exc:
            raise CredentialError(f"cannot read credential file {self.path}: {exc}") from None
        return self._header

    def refresh(self) -> None:
        """Read the file again before the next request (the supervisor refused it)."""
        self._seen = None
