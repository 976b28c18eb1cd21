"""The host monitor: one agent process per node.

It launches or adopts the node's training workers, watches their processes and progress,
watches the GPUs (kernel-log XIDs, nvidia-smi ECC counts), serves a small local HTTP API
to the workers and to the supervisor's actuator, and heartbeats the supervisor.

Nothing is imported here so that `python -m host_monitor.cli` and the protocol module
stay cheap to import.
"""
