"""The host monitor's exceptions, under one root. Each is defined beside the code that
raises it; the routes map the ones a request can meet to an HTTP status.

HostMonitorError
├── ConfigError          settings that cannot be used (config.py)
├── LaunchError          a --launch that cannot start, naming the flag (launch.py)
├── CredentialError      a credential file that cannot be read, or is empty (credentials.py)
├── InvalidRequest       a request naming a bad field: 422 (request_checks.py)
├── WorkerNotFound       no worker with this rank on this node: 404 (workers.py)
├── WorkerConflict       the request does not fit the workers' state: 409 (workers.py)
├── PidNotFound          no single process matches a worker's identity (pidns.py)
├── UnknownRound         no emergency-checkpoint round with this id: 404 (emergency.py)
├── StaleLeaderRefused   a command from an older supervisor epoch: 409 (leader_fence.py)
├── NvidiaSmiError       nvidia-smi failed, timed out or printed nonsense (watchdogs/nvidia_smi.py)
├── PeerTierError        a worker's peer-tier request that cannot be served (peer/tier.py)
├── RelayRefused         the partner's copy cannot be relayed to a worker (peer/channel.py)
├── ChannelClosed        the data channel's other side closed or sent no frame (peer/wire.py)
├── Transient            a partner transfer's attempt worth retrying (peer/client.py)
└── PeerStoreError       a partner's upload or read the store refuses (peer/store.py)
    ├── Invalid          422
    ├── NotFound         404
    ├── TooLarge         413
    ├── Full             507: the store would go over its max_bytes
    ├── Mismatch         409: the files do not match the manifest
    └── Superseded       409: a newer copy or the job's departure dropped this one
        └── StaleWorld   409: a save of an older world than the job's newest (peer/store.py)
"""

from __future__ import annotations


class HostMonitorError(Exception):
    """Root of the host monitor's errors."""
