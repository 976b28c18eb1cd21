"""The host monitor's exceptions, under one root. Each is defined beside the code that
raises it; the routes map the ones a request can meet to an HTTP status.

HostMonitorError
├── ConfigError          settings that cannot be used (config.py)
├── CredentialError      a credential file that cannot be read, or is empty (credentials.py)
├── InvalidRequest       a request naming a bad field: 422 (node.py)
├── WorkerNotFound       no worker with this rank on this node: 404 (workers.py)
├── WorkerConflict       the request does not fit the workers' state: 409 (workers.py)
├── PidNotFound          no single process matches a worker's identity (pidns.py)
├── UnknownRound         no emergency-checkpoint round with this id: 404 (emergency.py)
├── NvidiaSmiError       nvidia-smi failed, timed out or printed nonsense (watchdogs/nvidia_smi.py)
├── PeerTierError        a worker's peer-tier request that cannot be served (peer_tier.py)
└── PeerStoreError       a partner's upload or read the store refuses (peer_store.py)
    ├── Invalid          422
    ├── NotFound         404
    ├── TooLarge         413
    ├── Mismatch         409: the files do not match the manifest
    └── Superseded       409: a newer copy or the job's departure dropped this one
"""

from __future__ import annotations


class HostMonitorError(Exception):
    """Root of the host monitor's errors."""
