"""The training loop of one worker.

Exit codes: 0 done, 2 bad settings, 3 a collective timed out (a peer is gone), 128 +
signal number on SIGTERM / SIGINT (143 / 130), 1 anything else.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.logs import configure_worker_logging
from training.checkpoint.fencing import StaleWorldCommit, WorldStart
from training.errors import TrainingError
from training.numpy_workload.checkpoint import CheckpointStore, write_output
from training.numpy_workload.collective import CollectiveTimeout, FileCollective
from training.numpy_workload.config import ConfigError, WorkloadConfig
from training.numpy_workload.fence import TierFence, starts_roots
from training.numpy_workload.model import (
    ShardState,
    apply_update,
    ground_truth,
    init_state,
    local_gradient,
)
from training.worker_client import CheckpointTier, HostLeaseExpired, WorkerClient

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_COLLECTIVE_TIMEOUT = 3
#: The step's simulated work runs in slices this short: a slice cut short by a stop of
#: the process still counts whole, so short slices make a stop cost what it would cost
#: real work.
COMPUTE_SLICE_S = 0.005

log = logging.getLogger("training.numpy_workload")


class Terminated(TrainingError):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class CheckpointSavesRefused(TrainingError):
    """`max_consecutive_save_failures` saves in a row to one tier were refused: a newer
    world has started, so this worker trains on a branch no restore continues."""


class _StopFlag:
    """SIGTERM / SIGINT only set a flag; the loop checks it at its safe points, so no
    write is ever cut in half by the signal."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum


class Trainer:
    def __init__(self, cfg: WorkloadConfig, client: WorkerClient, stop: _StopFlag) -> None:
        self.cfg = cfg
        self.client = client
        self.stop = stop
        self.state: ShardState | None = None
        tiers: dict[CheckpointTier, Path] = {
            Tier.LOCAL: cfg.local_ckpt_dir,
            Tier.DURABLE: cfg.durable_ckpt_dir,
            Tier.EMERGENCY: cfg.emergency_ckpt_dir,
        }
        self.fence = TierFence(cfg.world, starts_roots(tiers))
        self.store = CheckpointStore(
            tiers,
            shard=cfg.shard,
            num_shards=cfg.num_shards,
            keep=cfg.keep_checkpoints,
            fence=self.fence,
        )
        #: Saves refused in a row, by tier; and the last refusal (step, tier, error).
        self.refused: dict[CheckpointTier, int] = {}
        self.last_refused: tuple[int, CheckpointTier, str] | None = None
        self.collective = FileCollective(
            cfg.collective_dir,
            cfg.rank,
            cfg.world_size,
            timeout_s=cfg.collective_timeout_s,
            poll=self.safe_point,
        )
        self.prefix = f"workload rank={cfg.rank} replica={cfg.replica} shard={cfg.shard}:"

    def say(self, message: str) -> None:
        # One write per line, as the torch workload's: ranks may share a log, unbuffered.
        with contextlib.suppress(OSError):  # stdout gone (closed pipe): keep training
            sys.stdout.write(f"{self.prefix} {message}\n")
            sys.stdout.flush()

    # --- safe points -----------------------------------------------------------------

    def safe_point(self) -> None:
        """Serve a pending emergency checkpoint, then honour SIGTERM / SIGINT.

        Called between steps, while sleeping and while waiting in a collective: at each
        of these points `self.state` is the state after the last completed step.
        """
        self.client.at_safe_point()
        if self.stop.signum is not None:
            raise Terminated(self.stop.signum)

    def compute(self, seconds: float) -> None:
        """The step's work (what a GPU would do), as `seconds` of running time in slices
        of sleep: like real work, and unlike one sleep to a deadline, it takes longer
        while the process is stopped (the straggler fault stops it)."""
        left = seconds
        while left > 0:
            self.safe_point()
            part = min(left, COMPUTE_SLICE_S)
            time.sleep(part)
            left -= part

    def emergency_checkpoint(self) -> int:
        state = self.state
        if state is None:
            raise RuntimeError("no training state yet (still agreeing on the resume step)")
        self.save(state, Tier.EMERGENCY)
        return state.step

    def save(self, state: ShardState, tier: CheckpointTier) -> None:
        """Save to `tier` and report it. A save refused because a newer world has started
        is reported as failed and counted (`check_refusals`); an emergency one raises too,
        so that its ack says it failed."""
        try:
            if tier == Tier.DURABLE:  # none once the rank's lease ran out (it exits soon)
                self.client.check_lease(f"the durable save of step {state.step}")
        except HostLeaseExpired as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.client.report_checkpoint_failed(state.step, tier, error)
            self.say(f"checkpoint refused step={state.step} tier={tier}: {error}")
            return
        try:
            _, duration = self.store.save(state, tier)
        except StaleWorldCommit as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.refused[tier] = self.refused.get(tier, 0) + 1
            self.last_refused = (state.step, tier, error)
            self.client.report_checkpoint_failed(state.step, tier, error)
            self.say(f"checkpoint refused step={state.step} tier={tier}: {error}")
            if tier == "emergency":
                raise
            return
        self.refused.pop(tier, None)
        self.client.report_checkpoint_saved(state.step, duration, tier)
        what = "emergency checkpoint saved" if tier == "emergency" else "checkpoint saved"
        self.say(f"{what} step={state.step} tier={tier} duration_s={duration:.4f}")

    def check_refusals(self) -> None:
        """CheckpointSavesRefused once `max_consecutive_save_failures` saves in a row to
        one tier were refused (each reported as it was): training on would only make
        steps no restore loads."""
        limit = self.cfg.max_consecutive_save_failures
        count = max(self.refused.values(), default=0)
        if not limit or count < limit or self.last_refused is None:
            return
        step, tier, error = self.last_refused
        self.client.flush()  # the refusals' reports reach the supervisor first
        raise CheckpointSavesRefused(
            f"{count} checkpoint saves in a row to the {tier} tier failed "
            f"(max_consecutive_save_failures={limit}); the last, of step {step}: {error}"
        )

    # --- the run ---------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        self.client.on_emergency_checkpoint(self.emergency_checkpoint)
        self.say(
            f"start attempt={cfg.attempt} world_size={cfg.world_size} "
            f"({cfg.num_replicas} replicas x {cfg.num_shards} shards) seed={cfg.seed} "
            f"total_steps={cfg.total_steps} monitor={'on' if self.client.online else 'off'}"
        )
        self.client.register(world_size=cfg.world_size)
        if cfg.local_freq and cfg.durable_freq and cfg.durable_freq % cfg.local_freq:
            self.say(
                f"warning: S3_CHECKPOINTING_FREQ={cfg.durable_freq} is not a multiple of "
                f"IN_MEMORY_CHECKPOINTING_FREQ={cfg.local_freq}"
            )
        if cfg.rank == 0:
            self.collective.remove_older_attempts()
        self.state = self.resume()
        self.client.report_step(self.state.step)
        truth = ground_truth(cfg.seed, cfg.shard, cfg.model_dim)
        group = [i * cfg.num_shards + cfg.shard for i in range(cfg.num_replicas)]
        state = self.state
        while state.step < cfg.total_steps:
            self.safe_point()
            self.check_refusals()
            computing = time.monotonic()
            grad, loss = local_gradient(
                state,
                truth,
                seed=cfg.seed,
                replica=cfg.replica,
                shard=cfg.shard,
                batch_size=cfg.batch_size,
            )
            self.compute(cfg.step_time_s)
            # Its own work, before it waits for the other ranks: what stragglers show in.
            compute_s = time.monotonic() - computing
            mean = self.collective.all_reduce_mean(state.step, grad, group)
            apply_update(state, mean, learning_rate=cfg.learning_rate, momentum=cfg.momentum)
            self.client.report_step(state.step, compute_s=compute_s)
            if state.step % cfg.log_every == 0 or state.step == cfg.total_steps:
                self.say(f"step={state.step}/{cfg.total_steps} loss={loss:.6g}")
            if cfg.local_freq and state.step % cfg.local_freq == 0:
                self.save(state, Tier.LOCAL)
            if cfg.durable_freq and state.step % cfg.durable_freq == 0:
                self.save(state, Tier.DURABLE)
        self.client.finishing()  # out of the loop: its output is no hang
        if cfg.replica == 0:
            path = write_output(cfg.output_dir, cfg.shard, state.w)
            self.say(f"done step={state.step} output={path}")
        else:
            self.say(f"done step={state.step}")
        self.client.finished()  # the exit that follows is no failure
        return EXIT_OK

    def resume(self) -> ShardState:
        """Agree with every rank on the newest step all of them can load, leaving out those
        shadowed by a newer world's start, load it, and record this world's start."""
        state = self._agree_and_load()
        self.fence.record(state.step)  # before any save of this world
        return state

    def agreed_starts(self) -> list[WorldStart]:
        """The starts every rank sees, together: one recorded in a node's local tier fences
        the files other nodes hold too."""
        mine = [[start.world, start.step] for start in self.fence.starts()]
        everyone = self.collective.all_gather("worlds", mine)
        return sorted({WorldStart(int(w), int(s)) for theirs in everyone for w, s in theirs})

    def _agree_and_load(self) -> ShardState:
        cfg = self.cfg
        starts = self.agreed_starts()
        before = self.fence.world
        if self.fence.adopt(starts) != before:
            self.say(
                f"goes on as world={self.fence.world}: a newer world than {before} has "
                "started in these tiers (a new run that reuses them)"
            )
        available = self.store.available(starts)
        my_steps = sorted(available)
        mine: dict[str, object] = {
            "steps": my_steps,
            "num_shards": cfg.num_shards,
            "world_size": cfg.world_size,
            "seed": cfg.seed,
        }
        everyone = self.collective.all_gather("resume", mine)
        for rank, theirs in enumerate(everyone):
            for key in ("num_shards", "world_size", "seed"):
                if theirs[key] != mine[key]:
                    raise ConfigError(f"rank {rank} runs with {key}={theirs[key]}, not {mine[key]}")
        common = set(my_steps)
        for theirs in everyone:
            common &= set(theirs["steps"])
        if not common:
            self.say("starting from step=0 (no checkpoint every rank can load)")
            return init_state(cfg.seed, cfg.shard, cfg.model_dim)
        chosen = available[max(common)]
        state, duration = self.store.load(chosen, cfg.model_dim)
        self.client.report_checkpoint_loaded(state.step, duration, chosen.tier)
        self.say(f"resumed step={state.step} tier={chosen.tier} duration_s={duration:.4f}")
        return state


def main() -> int:
    configure_worker_logging("warning", text_format="%(name)s %(levelname)s: %(message)s")
    try:
        cfg = WorkloadConfig.from_env()
    except ConfigError as exc:
        print(f"workload: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    stop = _StopFlag()
    stop.install()
    client = WorkerClient.from_env()
    trainer = Trainer(cfg, client, stop)
    code = EXIT_ERROR
    try:
        code = trainer.run()
    except Terminated as exc:
        step = trainer.state.step if trainer.state is not None else None
        trainer.say(f"terminated by {exc} at step={step}")
        code = 128 + exc.signum
    except CollectiveTimeout as exc:
        trainer.say(f"collective timed out: {exc}")
        code = EXIT_COLLECTIVE_TIMEOUT
    except ConfigError as exc:
        trainer.say(f"error: {exc}")
        code = EXIT_CONFIG
    except CheckpointSavesRefused as exc:
        trainer.say(f"stopped: {exc}")
        code = EXIT_ERROR
    except Exception:
        log.exception("workload failed")
        code = EXIT_ERROR
    finally:
        client.close()
    return code
