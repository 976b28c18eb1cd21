"""A PyTorch training workload: a small decoder-only transformer language model.

Trained data-parallel with DDP over `torch.distributed` (gloo on CPU, NCCL on GPUs) on
synthetic tokens that depend only on the seed, the step and the batch (the rank's, or
each of several in a smaller world: elastic.py), with the checkpoint tiers of
`training.checkpoint`. Every source of randomness is either derived from (seed, step,
batch) or saved with the checkpoint, so a run that was interrupted and resumed ends with
bit-identical weights. Run with torchrun-style environment (`RANK`,
`WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`): `python -m training.torch_workload`;
`config.py` lists the settings.

DDP, not FSDP: each replica holds the whole model here (a few million parameters), and
FSDP's CPU path on gloo adds nothing this workload needs to show.

Nothing is imported here so that the package stays cheap to import.
"""
