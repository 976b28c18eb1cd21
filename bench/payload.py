"""Realistic heartbeat bodies, shared by the load generator and the in-process benchmarks.

Kept free of supervisor imports so the load-generator process stays lean.
"""

from __future__ import annotations

import json
from typing import Any

WORKERS_PER_NODE = 8
JOB = "bench"
_STEP_SENTINEL = 987654321


def node_name(index: int) -> str:
    return f"bench-node-{index:05d}"


def heartbeat_dict(index: int, step: int) -> dict[str, Any]:
    """One node of job "bench", 8 running workers at `step`: raises no event."""
    return {
        "node": node_name(index),
        "state": "running",
        "job": JOB,
        "workers": [
            {
                "rank": index * WORKERS_PER_NODE + local,
                "local_rank": local,
                "pid": 10_000 + local,
                "state": "running",
                "step": step,
            }
            for local in range(WORKERS_PER_NODE)
        ],
        "address": f"10.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}",
        "topology": {
            "zone": f"zone-{index % 4}",
            "superblock": f"sb-{index // 256}",
            "subblock": f"b-{index // 16}",
        },
    }


def heartbeat_json(index: int, step: int) -> bytes:
    """The heartbeat as compact JSON, as a host monitor would send it."""
    return json.dumps(heartbeat_dict(index, step), separators=(",", ":")).encode()


def heartbeat_template(index: int) -> bytes:
    """The heartbeat with `%d` in place of each worker's step: `template % ((step,) * 8)`."""
    body = heartbeat_json(index, _STEP_SENTINEL)
    assert b"%" not in body.replace(str(_STEP_SENTINEL).encode(), b"")
    return body.replace(str(_STEP_SENTINEL).encode(), b"%d")
