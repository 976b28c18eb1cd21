"""The training loop of one rank.

Exit codes: 0 done (or stopped after STOP_AFTER_STEP), 2 bad settings, 3 a collective
failed (a peer is gone) and no one stopped this rank within PEER_LOSS_WAIT_S, 1 anything
else.

A rank whose collective fails stays up for PEER_LOSS_WAIT_S when a host monitor is there:
its state is still that of the last completed step, and the supervisor's emergency
checkpoint (served by the worker client's thread) saves it before the job is restarted;
exiting at once would lose it. Without a host monitor it exits at once (code 3).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.checkpoint import Checkpointer, CheckpointSettings
from training.torch_workload.config import ConfigError, TorchWorkloadConfig
from training.torch_workload.model import DecoderLM, batch
from training.worker_client import WorkerClient

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_PEER_LOST = 3

log = logging.getLogger("training.torch_workload")


def weights_sha256(model: torch.nn.Module) -> str:
    """A hash of every weight and buffer, by name: equal hashes, bit-identical models."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        data = tensor.detach().cpu().contiguous().clone()  # its own storage, exactly its bytes
        digest.update(bytes(data.untyped_storage()))
    return digest.hexdigest()


def say(cfg: TorchWorkloadConfig, message: str) -> None:
    with contextlib.suppress(OSError):  # stdout gone (closed pipe): keep training
        print(f"torch workload rank={cfg.rank}: {message}", flush=True)


def run(cfg: TorchWorkloadConfig, settings: CheckpointSettings) -> int:
    torch.set_num_threads(1)  # several ranks share a machine; and determinism
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != cfg.world_size or dist.get_rank() != cfg.rank:
        raise ConfigError("RANK / WORLD_SIZE differ from the process group's")
    torch.manual_seed(cfg.seed)
    model = DecoderLM(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=cfg.learning_rate)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.total_steps)
    client = WorkerClient.from_env()
    client.register(world_size=cfg.world_size)
    ckpt = Checkpointer(
        ddp,
        optimizer,
        lr_scheduler=scheduler,
        settings=settings,
        client=client if client.online else None,
    )
    try:
        step = ckpt.restore()
        restored = ckpt.last_restore
        tier = restored.tier if restored is not None else None
        started = f"start attempt={cfg.attempt} world_size={cfg.world_size}:"
        if restored is not None and restored.step:
            say(cfg, f"{started} resumed step={step} tier={tier}")
        else:
            say(cfg, f"{started} starting from step=0 (no checkpoint every rank can load)")
        client.report_step(step)
        parameters = sum(p.numel() for p in model.parameters())
        if step == 0:
            say(cfg, f"model: {parameters:,} parameters")
        while step < cfg.total_steps and not (cfg.stop_after_step and step >= cfg.stop_after_step):
            inputs, targets = batch(
                cfg.seed,
                step + 1,
                cfg.rank,
                batch_size=cfg.batch_size,
                seq_len=cfg.seq_len,
                vocab_size=cfg.vocab_size,
            )
            try:
                logits = ddp(inputs)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]  # DDP's all-reduce runs here
            except RuntimeError as exc:  # torch.distributed's errors included
                say(cfg, f"step {step + 1} failed in a collective: {first_line(exc)}")
                return wait_for_stop(cfg, step, client)
            optimizer.step()
            scheduler.step()
            step += 1
            client.report_step(step)
            ckpt.step_done(step)
            if step % cfg.log_every_steps == 0 or step == cfg.total_steps:
                say(cfg, f"step={step}/{cfg.total_steps} loss={loss.item():.4f}")
            if cfg.step_time_s or client.slowdown_s:
                time.sleep(cfg.step_time_s + client.slowdown_s)
    finally:
        ckpt.close()
    if step == cfg.total_steps and cfg.rank == 0 and cfg.output_dir is not None:
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        out = Path(cfg.output_dir) / "weights.sha256"
        out.write_text(weights_sha256(model) + "\n")
        say(cfg, f"done step={step} weights={out}")
    client.close()  # flushes its reports
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return EXIT_OK


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def wait_for_stop(cfg: TorchWorkloadConfig, step: int, client: WorkerClient) -> int:
    """Stay up, holding the state of `step`, so that an emergency checkpoint can still
    save it; the supervisor stops this rank when it restarts the job. Without a host
    monitor nobody will ask: exit at once (a launcher such as torchrun restarts the
    group when a rank exits)."""
    if not client.online:
        client.close()
        return EXIT_PEER_LOST
    say(cfg, f"holding step={step} for an emergency checkpoint ({cfg.peer_loss_wait_s:g}s)")
    time.sleep(cfg.peer_loss_wait_s)  # SIGTERM ends it (the worker client's handler)
    say(cfg, "nobody stopped this rank: exiting")
    client.close()
    return EXIT_PEER_LOST


def main() -> int:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s: %(message)s"
    )
    try:
        cfg = TorchWorkloadConfig.from_env()
        settings = CheckpointSettings.from_env()
    except ValueError as exc:  # ConfigError included
        print(f"torch workload: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    try:
        return run(cfg, settings)
    except ConfigError as exc:
        print(f"torch workload: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except Exception:
        log.exception("torch workload failed")
        return EXIT_ERROR
