"""The model: one least-squares regression per shard, trained with momentum SGD.

Everything random is drawn from generators seeded by fixed tuples (seed, purpose, ...),
so the data of step s for replica i and shard k is the same whenever and wherever it is
drawn: resuming from a checkpoint of step s replays exactly what an uninterrupted run
does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Vector = NDArray[np.float64]

# Purposes, mixed into the seeds so that the streams never overlap.
_TRUTH, _INIT, _BATCH = 0x7A0E, 0x1417, 0xBA7C
NOISE = 0.01


@dataclass
class ShardState:
    """One shard's training state after `step` completed steps."""

    step: int
    w: Vector
    v: Vector  # momentum buffer


def ground_truth(seed: int, shard: int, dim: int) -> Vector:
    return np.random.default_rng([seed, _TRUTH, shard]).standard_normal(dim)


def init_state(seed: int, shard: int, dim: int) -> ShardState:
    w = 0.1 * np.random.default_rng([seed, _INIT, shard]).standard_normal(dim)
    return ShardState(step=0, w=w, v=np.zeros(dim))


def local_gradient(
    state: ShardState,
    truth: Vector,
    *,
    seed: int,
    replica: int,
    shard: int,
    batch_size: int,
) -> tuple[Vector, float]:
    """Gradient and loss of 0.5 * mean((x w - y)^2) on this replica's micro-batch."""
    rng = np.random.default_rng([seed, _BATCH, state.step, replica, shard])
    x = rng.standard_normal((batch_size, truth.shape[0]))
    y = x @ truth + NOISE * rng.standard_normal(batch_size)
    residual = x @ state.w - y
    loss = 0.5 * float(np.mean(residual * residual))
    grad: Vector = x.T @ residual / batch_size
    return grad, loss


def mean_in_order(grads: list[Vector]) -> Vector:
    """The mean, summed in list (replica) order: the same bits on every worker."""
    total = grads[0].copy()
    for grad in grads[1:]:
        total += grad
    total /= len(grads)
    return total


def apply_update(state: ShardState, grad: Vector, *, learning_rate: float, momentum: float) -> None:
    """One momentum SGD step, in place; the state then holds one more completed step."""
    state.v = momentum * state.v + grad
    state.w = state.w - learning_rate * state.v
    state.step += 1
