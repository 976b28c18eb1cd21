"""Per-node credentials derived from one secret, the supervisor's `node_key`.

A node's credential is `node.<node name>.<mac>`, where `<mac>` is the unpadded base64url
HMAC-SHA256, keyed with `node_key`, of `CONTEXT` followed by the node name. The
supervisor keeps no list of nodes: it recomputes the MAC of the name the credential
carries. A host monitor that holds only its own credential can speak only for its own
node; whoever holds `node_key` can mint any node's (the operator, `supervisor
node-credential NODE`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from supervisor.domain import NAME_PATTERN

PREFIX = "node."
# Binds the MAC to this use: the same key used elsewhere would give other values.
CONTEXT = b"resiliency-supervisor node credential v1\x00"
MAC_CHARS = 43  # 32 bytes, base64url without padding
MIN_KEY_CHARS = 32
_name_match = re.compile(NAME_PATTERN).fullmatch


def node_credential(key: str, node: str) -> str:
    """The credential of `node`. Raises ValueError for a name the supervisor would refuse."""
    if not _name_match(node) or len(node) > 253:
        raise ValueError(f"not a valid node name: {node!r}")
    return f"{PREFIX}{node}.{_mac(key.encode(), node)}"


def credential_node(key: bytes, credential: bytes) -> str | None:
    """The node a credential was issued for, when its MAC is right; else None."""
    if not credential.startswith(b"node."):
        return None
    name, _, mac = credential[len(PREFIX) :].rpartition(b".")
    if len(mac) != MAC_CHARS or not name:
        return None
    try:
        node = name.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not hmac.compare_digest(_mac(key, node).encode(), mac):
        return None
    return node


def _mac(key: bytes, node: str) -> str:
    digest = hmac.new(key, CONTEXT + node.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
