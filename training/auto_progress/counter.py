"""The training step, told from the optimizer steps a process takes.

The rule: an optimizer that steps again closes the step. A step is counted when an
optimizer steps that already stepped since the last counted step (or when it is the first
step of all); an optimizer that steps for the first time since then belongs to the same
step. So a training step in which several optimizers step once each (a GAN's generator and
discriminator, two parameter groups in two optimizers, an optimizer that wraps another,
such as ZeroRedundancyOptimizer) counts once, whatever their order.

An optimizer replaced by a new one (a new phase, a re-created optimizer) leaves a step
uncounted at most: the new one joins the step it came in, and counts from its next step
on; when the old one was freed, the new one's first step counts at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


class StepCounter:
    """Counts training steps from optimizer steps; see the module's docstring."""

    def __init__(self) -> None:
        #: Training steps counted so far.
        self.steps = 0
        # The optimizers that stepped since the last counted step, held weakly: a freed one
        # reads None, and must not keep a replaced optimizer's state alive.
        self._stepped: list[Callable[[], object | None]] = []

    def optimizer_stepped(self, optimizer: object) -> int:
        """`optimizer` finished a step: the training steps counted now."""
        if not self._stepped or any(ref() is None or ref() is optimizer for ref in self._stepped):
            self.steps += 1
            self._stepped = [_ref(optimizer)]
        else:
            self._stepped.append(_ref(optimizer))
        return self.steps


def _ref(obj: object) -> Callable[[], object | None]:
    try:
        return weakref.ref(obj)
    except TypeError:  # no weak references (__slots__): held until the step closes
        return lambda: obj
