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


def heartbeat_dict(
    index: int,
    step: int,
    workers: int = WORKERS_PER_NODE,
    job: str = JOB,
    first_rank: int | None = None,
) -> dict[str, Any]:
    """One node of `job`, `workers` running workers at `step`: raises no event. Its ranks
    start at `first_rank` (by default: the node's index times `workers`)."""
    base = index * workers if first_rank is None else first_rank
    return {
        "node": node_name(index),
        "state": "running",
        "job": job,
        "workers": [
            {
                "rank": base + local,
                "local_rank": local,
                "pid": 10_000 + local,
                "state": "running",
                "step": step,
            }
            for local in range(workers)
        ],
        "address": f"10.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}",
        "topology": {
            "zone": f"zone-{index % 4}",
            "superblock": f"sb-{index // 256}",
            "subblock": f"b-{index // 16}",
        },
    }


def heartbeat_json(index: int, step: int, **shape: Any) -> bytes:
    """The heartbeat as compact JSON, as a host monitor would send it (`shape`: the
    keyword arguments of `heartbeat_dict`)."""
    return json.dumps(heartbeat_dict(index, step, **shape), separators=(",", ":")).encode()


def heartbeat_template(index: int, **shape: Any) -> bytes:
    """The heartbeat with `%d` in place of each worker's step:
    `template % ((step,) * workers)`."""
    body = heartbeat_json(index, _STEP_SENTINEL, **shape)
    assert b"%" not in body.replace(str(_STEP_SENTINEL).encode(), b"")
    return body.replace(str(_STEP_SENTINEL).encode(), b"%d")
