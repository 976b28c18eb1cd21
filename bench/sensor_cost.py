"""The supervisor's own work on a steady heartbeat, without HTTP: `python -m bench.sensor_cost`.

Decoding (msgspec, `parse_heartbeat`) and the sensor's update (`Sensor.ingest`) of every
node's heartbeat in turn, 4 rounds after one that registers them, on a fresh `Sensor`;
CPU (user + system) per heartbeat, for 2,000 and 25,000 nodes of 8 workers in jobs of
8,000 ranks and 25,000 nodes of 1 worker in jobs of 1,000. What the HTTP rows of
`--only ingest-fleet` spend beyond this is the server stack's and the route's.

Then the controller's snapshot of the cluster (`Sensor.snapshot`, taken before each
decision: a burst of losses takes one each): the first after every node beat (each
node's view built, its last heartbeat decoded), and the next ones of a burst, each after
1% of the nodes beat again (only theirs built again); CPU per snapshot, 2,000 and 25,000
nodes of 8 workers.
"""

from __future__ import annotations

import random
import resource

from bench.fleet_loadgen import node_template
from bench.loops import run as run_loop
from resiliency_protocol.heartbeat import parse_heartbeat
from supervisor.config import Settings
from supervisor.sensor import Sensor

ROUNDS = 4


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sensor() -> Sensor:
    settings = Settings(heartbeat_timeout_s=600, heartbeat_polling_period_s=300)
    return Sensor(settings.sensing, settings.workload, lambda _: None)


def _templates(nodes: int, workers: int, ranks_per_job: int) -> list[bytes]:
    per_job = max(1, ranks_per_job // workers)
    return [node_template(i, workers, per_job) for i in range(nodes)]


def _beat(sensor: Sensor, templates: list[bytes], step: int, workers: int) -> None:
    """Each template's node beats at `step`: its heartbeat decoded and ingested."""
    for template in templates:
        body = template % ((step,) * workers)
        sensor.ingest(parse_heartbeat(body), body)


async def cost_us(nodes: int, workers: int, ranks_per_job: int) -> float:
    """CPU microseconds per steady heartbeat (formatting its body included)."""
    sensor = _sensor()
    templates = _templates(nodes, workers, ranks_per_job)
    try:
        _beat(sensor, templates, 1, workers)  # registers them
        started = _cpu_s()
        for step in range(2, ROUNDS + 2):
            _beat(sensor, templates, step, workers)
        return 1e6 * (_cpu_s() - started) / (nodes * ROUNDS)
    finally:
        sensor.close()


#: Snapshots of a burst measured after the first, and the share of nodes heard before each.
BURST = 20
BEAT_BETWEEN = 0.01


async def snapshot_ms(
    nodes: int, workers: int = 8, ranks_per_job: int = 8_000
) -> tuple[float, float]:
    """CPU milliseconds of (the first snapshot, each next one of a burst)."""
    sensor = _sensor()
    templates = _templates(nodes, workers, ranks_per_job)
    try:
        for step in (1, 2):
            _beat(sensor, templates, step, workers)
        started = _cpu_s()
        sensor.snapshot()
        first = _cpu_s() - started
        rng = random.Random(1)
        spent = 0.0
        for step in range(3, 3 + BURST):
            _beat(sensor, rng.sample(templates, max(1, int(nodes * BEAT_BETWEEN))), step, workers)
            started = _cpu_s()
            sensor.snapshot()
            spent += _cpu_s() - started
        return 1e3 * first, 1e3 * spent / BURST
    finally:
        sensor.close()


def main() -> None:
    for nodes, workers, ranks in ((2_000, 8, 8_000), (25_000, 8, 8_000), (25_000, 1, 1_000)):
        us = run_loop(cost_us(nodes, workers, ranks))
        print(f"{nodes:,} nodes x {workers} workers, jobs of {ranks:,} ranks: {us:.1f} us")
    for nodes in (2_000, 25_000):
        first, next_ = run_loop(snapshot_ms(nodes))
        print(
            f"snapshot of {nodes:,} nodes x 8 workers: first {first:.1f} ms, then "
            f"{next_:.1f} ms each ({BEAT_BETWEEN:.0%} of the nodes heard before each)"
        )


if __name__ == "__main__":
    main()
