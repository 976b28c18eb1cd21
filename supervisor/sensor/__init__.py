"""Turns heartbeats and GPU reports into events. Knows nothing of Kubernetes or SQL.

`Sensor` (sensor.py: what it does with a heartbeat) is the whole of it to the rest of the
supervisor. The parts it uses:

- `nodes.py`, `jobs.py`: the node and job records (the sensor's own: the rest of the
  supervisor reads them through `reads.py`, never the records themselves);
- `changes.py`: what a step produced (`Changes`);
- `claims.py`: which node holds each rank of a job (`RankClaimed`);
- `gpu_reports.py`: a node's GPU reports turned into events;
- `events.py`: a node's events, with the fault they are due to;
- `deadlines.py`: the timers (a node's loss, a job's hang, the straggler check), and
  `expiries.py`: what happens when one passes;
- `progress.py`: a job's step progress and the hang timeout learned from it;
- `finishing.py`: a job's end;
- `stragglers.py`: which ranks compute slower than their peers, and for how long;
- `fault_marks.py`: what fault injection (`supervisor.fault_injection`) tells the sensor: which
  nodes' heartbeats a fault mutes, and which fault a node's failures are due to;
- `clock.py`: event-loop time and Unix time;
- `worlds.py`: the newest world of each job, and the fence on older ones' reports.
"""

from resiliency_protocol.heartbeat import GpuReport, HostHeartbeat, WorkerReport
from supervisor.sensor.sensor import Changes, Sensor

__all__ = ["Changes", "GpuReport", "HostHeartbeat", "Sensor", "WorkerReport"]
