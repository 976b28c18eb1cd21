"""The parts `training.worker_client.WorkerClient` is made of, one job each.

- `connection`: the HTTP link to the host monitor (bodies checked, failures logged once).
- `registration`: registering this process, and again when the monitor forgot it.
- `reporter`: the reporting thread (progress, the heartbeat, and checkpoint reports).
- `stopping`: SIGTERM, and the `stopping` report that says an exit is on purpose.
- `emergency`: emergency checkpoints on SIGUSR1, at safe points or from a thread.
- `worlds`: the new worlds of an in-process restart.

Light like the client: stdlib, httpx, pydantic and resiliency_protocol only.
"""
