"""The training side: what runs inside the user's training processes.

- `worker_client`: the link to the node's host monitor (register, progress, checkpoint
  reports, emergency checkpoints on SIGUSR1); standard library and httpx only. Its
  parts, one job each, are in `monitor_link`.
- `checkpoint`: checkpoint tiers (RAM, peer, durable) for a PyTorch training state, with
  `torch.distributed.checkpoint` (extra `torch`).
- `numpy_workload`: the demo workload of local mode (extra `demo`: NumPy).
- `auto_progress`: a PyTorch script's optimizer steps reported as its progress when it
  reports none itself (started by `supervisor run` and `pod_launch`; stdlib at start).

Nothing here imports the supervisor or the host monitor: they are other processes, and
talk to this package only over HTTP.
"""
