"""The protocol package's own exceptions, under one root (standard library only: the
training processes import this package and should not pay for pydantic to do so).

ProtocolError
├── HeartbeatError   a body that is not a valid heartbeat; `loc` names the field (heartbeat.py)
├── CommandNotFound  a launcher's command that cannot be run here (launch.py)
└── TLSError         a certificate, key or CA file that cannot be used (tls.py)
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Root of the protocol package's errors."""
