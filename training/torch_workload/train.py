"""The training loop of one rank.

Exit codes: 0 done (or stopped after STOP_AFTER_STEP), 2 bad settings, 3 a collective
failed (a peer is gone) and no one stopped this rank within PEER_LOSS_WAIT_S, 4 no world
assigned within WORLD_WAIT_S, 1 anything else.

A rank whose collective fails stays up for PEER_LOSS_WAIT_S when a host monitor is there:
its state is still that of the last completed step, and the supervisor's emergency
checkpoint (served by the worker client's thread) saves it; exiting at once would lose
it. When the supervisor heals the job in-process, the host monitor hands the rank a new
world (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, WORKLOAD_ATTEMPT): it leaves the failed
process group, joins the new one and trains on from the state it holds (tier `memory`),
while the replacement rank loads that step from the tiers. Otherwise the supervisor
restarts every rank. Without a host monitor it exits at once (code 3).

With WORLD_WAIT_S set (the pods of a JobSet that heals in-process), even the first world
comes from the supervisor, through the host monitor: a replacement pod, started by its
Job as any other, cannot tell from its environment which world the survivors are in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from resiliency_protocol.logs import configure_worker_logging
from training.checkpoint import Checkpointer, CheckpointSettings
from training.healing import (
    abandon_process_group,
    first_line,
    join_process_group,
    wait_for_master,
)
from training.torch_workload.config import ConfigError, TorchWorkloadConfig
from training.torch_workload.elastic import (
    batch_loss,
    elastic_step_gradients,
    takes_elastic_steps,
)
from training.torch_workload.parallel import Built, build, data_parallel, weights_sha256
from training.worker_client import WorkerClient

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_PEER_LOST = 3
EXIT_NO_WORLD = 4

log = logging.getLogger("training.torch_workload")


def say(cfg: TorchWorkloadConfig, message: str) -> None:
    # One write per line: a pod's ranks share its log, unbuffered (`python -u`), where
    # print() writes the text and its newline apart and two ranks' lines would interleave.
    with contextlib.suppress(OSError):  # stdout gone (closed pipe): keep training
        sys.stdout.write(f"torch workload rank={cfg.rank}: {message}\n")
        sys.stdout.flush()


def run(cfg: TorchWorkloadConfig, settings: CheckpointSettings) -> int:
    torch.set_num_threads(1)  # several ranks share a machine; and determinism
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(cfg.local_rank)  # a GPU per rank of the node, as torchrun's
    client = WorkerClient.from_env()
    assigned = bool(cfg.world_wait_s) and client.online  # offline: nobody assigns one
    if assigned:
        # Registered first: the host monitor hands the world to a registered worker.
        client.register(world_size=cfg.world_size)
        world = client.new_world(cfg.world_wait_s, first=True)
        if world is None:
            say(cfg, f"no world assigned within WORLD_WAIT_S={cfg.world_wait_s:g}s: exiting")
            client.close()
            return EXIT_NO_WORLD
        cfg = enter_world(cfg, *world)
        wait_for_master(cfg.rank, cfg.world_wait_s)
    collectives = timedelta(seconds=cfg.collective_timeout_s)
    join_process_group(backend, collectives, cfg.world_wait_s if assigned else 0.0)
    if dist.get_world_size() != cfg.world_size or dist.get_rank() != cfg.rank:
        raise ConfigError("RANK / WORLD_SIZE differ from the process group's")
    if assigned:
        client.joined(cfg.attempt)
    else:
        # Registered once in the process group: a registration in an attempt then means
        # this rank has joined that attempt's world (the supervisor waits for it).
        client.register(world_size=cfg.world_size)
    built = build(cfg)
    # The Checkpointer gets the model itself, not its DDP wrapper: an in-process restart
    # wraps it again for each new world. DDP's state is the same on every rank; a sharded
    # one is built again in each world (see parallel.py).
    ckpt = Checkpointer(
        built.model,
        built.optimizer,
        lr_scheduler=built.scheduler,
        settings=settings,
        client=client if client.online else None,
        replicated=cfg.parallelism == "ddp",
    )
    in_memory = False
    step = 0
    try:
        while True:
            # Restore before DDP wraps the model: DDP broadcasts rank 0's weights, which
            # in a new world may be a fresh replacement's.
            try:
                step = ckpt.restore(in_memory=in_memory)
                failure = None
            except RuntimeError as exc:  # the new world broke too (another fault)
                if not in_memory:
                    raise
                failure = exc
            if failure is not None:
                say(cfg, f"restoring in world {cfg.attempt} failed: {first_line(failure)}")
            else:
                restored = ckpt.last_restore
                tier = restored.tier if restored is not None else None
                started = f"start attempt={cfg.attempt} world_size={cfg.world_size}:"
                if restored is not None and restored.step:
                    say(cfg, f"{started} resumed step={step} tier={tier}")
                else:
                    say(cfg, f"{started} starting from step=0 (no checkpoint every rank can load)")
                    n = sum(p.numel() for p in built.model.parameters())
                    say(cfg, f"model: {n:,} parameters ({cfg.parallelism})")
                client.report_step(step)
                # DDP's hook averages over the world: a step of another number of batches
                # sums them itself (elastic.py).
                elastic = takes_elastic_steps(cfg, built.sharded)
                trained = built.model if built.sharded or elastic else data_parallel(built.model)
                step, failure = train(cfg, trained, built, ckpt, client, step)
                del trained  # DDP's reducer's hooks on the parameters go with it
                if failure is None:
                    break
                say(cfg, f"step {step + 1} failed in a collective: {first_line(failure)}")
            # Left at once: its connections close, so that a rank still waiting in a
            # collective with this one (HSDP: the other replica group's all-reduce) fails
            # too rather than wait for gloo's timeout, and holds its step like this one.
            abandon_process_group(failure)
            world = wait_for_new_world(cfg, step, client)
            if world is None:
                return EXIT_PEER_LOST
            cfg = enter_world(cfg, *world)
            wait_for_master(cfg.rank, cfg.peer_loss_wait_s)
            # A replacement imports torch before it joins: waited for as long as this rank
            # stays up for a new world, not the collectives' timeout.
            join_process_group(backend, collectives, cfg.peer_loss_wait_s)
            if dist.get_rank() != cfg.rank or dist.get_world_size() != cfg.world_size:
                raise ConfigError("the new world gives this process another RANK / WORLD_SIZE")
            client.joined(cfg.attempt)
            in_memory = True
            if built.sharded:
                # Its DTensors belong to the old world's mesh: built again on the new one,
                # and loaded from the tiers (this node's RAM holds the step its emergency
                # checkpoint saved).
                built = build(cfg)
                ckpt.rebind(built.model, built.optimizer, lr_scheduler=built.scheduler)
                in_memory = False
    finally:
        ckpt.close()
    if step == cfg.total_steps and cfg.output_dir is not None:
        digest = weights_sha256(built.model)  # a collective when sharded
        if cfg.rank == 0 and digest is not None:
            cfg.output_dir.mkdir(parents=True, exist_ok=True)
            out = Path(cfg.output_dir) / "weights.sha256"
            out.write_text(digest + "\n")
            say(cfg, f"done step={step} weights={out}")
    if step == cfg.total_steps:
        client.finished()  # the exit that follows is no failure
    client.close()  # flushes its reports
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return EXIT_OK


def train(
    cfg: TorchWorkloadConfig,
    model: torch.nn.Module,
    built: Built,
    ckpt: Checkpointer,
    client: WorkerClient,
    step: int,
) -> tuple[int, RuntimeError | None]:
    """Train on from `step`: (the last step completed, the collective error that stopped
    it, if one did). A failed step changed no parameter: its collectives (DDP's
    all-reduce, FSDP's all-gathers and reduce-scatters) run in forward and backward,
    before `optimizer.step()`."""
    optimizer, scheduler = built.optimizer, built.scheduler
    elastic = takes_elastic_steps(cfg, built.sharded)  # a scale-down's world
    while step < cfg.total_steps and not (cfg.stop_after_step and step >= cfg.stop_after_step):
        try:
            if elastic:
                loss, compute_s = elastic_step_gradients(cfg, model, step + 1)
            else:
                computing = time.monotonic()
                loss = batch_loss(cfg, model, step + 1, cfg.rank)
                # With DDP the forward pass holds no collective (it all-reduces in
                # backward): its time is this rank's own, what a straggler shows in. (FSDP
                # all-gathers in it; on a GPU this would need the kernels' time.)
                compute_s = time.monotonic() - computing
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]  # DDP's all-reduce runs here
        except RuntimeError as exc:  # torch.distributed's errors included
            return step, exc
        optimizer.step()
        scheduler.step()
        step += 1
        client.report_step(step, compute_s=compute_s)
        ckpt.step_done(step)
        if step % cfg.log_every_steps == 0 or step == cfg.total_steps:
            say(cfg, f"step={step}/{cfg.total_steps} loss={loss.item():.4f}")
        if cfg.step_time_s:
            time.sleep(cfg.step_time_s)
    return step, None


def enter_world(cfg: TorchWorkloadConfig, attempt: str, env: dict[str, str]) -> TorchWorkloadConfig:
    """Take the world's environment (read by `init_process_group`) and its attempt."""
    os.environ.update(env)
    world_size = int(env.get("WORLD_SIZE", "") or cfg.world_size)
    return replace(cfg, attempt=attempt, world_size=world_size)


def wait_for_new_world(
    cfg: TorchWorkloadConfig, step: int, client: WorkerClient
) -> tuple[str, dict[str, str]] | None:
    """Stay up holding the state of `step`, so that an emergency checkpoint can still save
    it and, when the supervisor heals the job in-process, this rank joins the new world
    with that state: (attempt, its environment), or None (exit: the supervisor restarts
    the job with new processes, or stops this rank with SIGTERM meanwhile). Without a host
    monitor nobody will ask: None at once (a launcher such as torchrun restarts the group
    when a rank exits)."""
    if not client.online:
        client.close()
        return None
    say(cfg, f"holding step={step} for an emergency checkpoint or a new world")
    world = client.new_world(cfg.peer_loss_wait_s)
    if world is None:
        say(cfg, f"no new world within PEER_LOSS_WAIT_S={cfg.peer_loss_wait_s:g}s: exiting")
        client.close()
    return world


def main() -> int:
    configure_worker_logging("warning", text_format="%(name)s %(levelname)s: %(message)s")
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
