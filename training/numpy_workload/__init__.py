"""A demo training workload: real (NumPy) synchronous data-parallel training.

`NUM_DP_REPLICAS` x `NUM_NODES_PER_DP` processes, one per node, rank = replica * N +
shard. The model is sharded across the N nodes of a replica and identical across
replicas; each step every worker computes a least-squares gradient on its own
micro-batch, the workers of a shard average their gradients with an all-reduce over a
shared directory (which is also a barrier across all ranks), and everyone updates. The
result depends only on the seed and the number of steps, never on timing, so a run that
was interrupted and resumed from a checkpoint ends with bit-identical weights.

Run it with `python -m training.numpy_workload`; `config.py` lists the environment
variables it reads. It talks to its node's host monitor through
`training.worker_client` (progress, emergency checkpoints on SIGUSR1, checkpoint
reports), or runs offline without one.

Nothing is imported here so that the package stays cheap to import.
"""
