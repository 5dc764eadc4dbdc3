"""Megatron's learning-rate schedule: linear warmup, then cosine / linear / constant decay.

Semantics follow Megatron-LM's ``OptimizerParamScheduler.get_lr`` exactly, with
``num_steps`` = the number of optimizer steps already *taken* (successful ones:
Megatron does not advance the scheduler on an fp16 overflow-skipped step):

* warmup: for ``0 <= n <= warmup_iters`` (when ``warmup_iters > 0``):
  ``lr = init_lr + (max_lr - init_lr) * n / warmup_iters``;
* ``constant`` style: ``max_lr`` after warmup;
* ``n > decay_iters``: ``min_lr``;
* otherwise ``ratio = (n - warmup_iters) / (decay_iters - warmup_iters)`` and
  ``lr = min_lr + coeff * (max_lr - min_lr)`` with ``coeff = 1 - ratio`` (linear),
  ``0.5 * (cos(pi * ratio) + 1)`` (cosine); ``inverse-square-root`` gives
  ``max(min_lr, max_lr * sqrt(max(warmup, 1) / max(n, 1)))``.

So the optimizer step of (1-based) iteration ``i`` uses ``lr(i - 1)`` when no
step was skipped before it: with warmup, Megatron's first update has lr
``init_lr`` (0 by default), and the peak is used by step ``warmup_iters + 1``.
The training loop keeps the count and calls :meth:`LRSchedule.lr` with it: the engine's step
count, plus, after a converted checkpoint resumed with fresh Adam moments, the steps its source
run had taken (``meta.json``'s ``schedule.num_steps``; Megatron too keeps its scheduler's step
apart from Adam's), so the schedule continues where the source run stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import LR_DECAY_STYLES
from ..errors import UserError

__all__ = ["LRSchedule", "DECAY_STYLES"]

DECAY_STYLES = LR_DECAY_STYLES + ("inverse-square-root",)


@dataclass(frozen=True)
class LRSchedule:
    """``--lr`` (``max_lr``), ``--min-lr``, ``--lr-warmup-iters``, ``--lr-decay-iters``,
    ``--lr-decay-style``, and Megatron's ``--lr-warmup-init`` (``init_lr``).

    ``decay_iters`` defaults (in the training loop, as Megatron) to ``--train-iters``.
    Invalid combinations raise :class:`~tnlg.errors.UserError` on construction.
    """

    max_lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    decay_style: str = "cosine"
    init_lr: float = 0.0

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise UserError(f"--lr-decay-style {self.decay_style!r} is not supported; "
                            f"choose one of {', '.join(DECAY_STYLES)}.")
        if not (self.max_lr >= 0 and math.isfinite(self.max_lr)):
            raise UserError(f"--lr must be a finite number >= 0, got {self.max_lr!r}.")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise UserError(f"--min-lr must be between 0 and --lr ({self.max_lr}), got {self.min_lr!r}.")
        if not 0.0 <= self.init_lr <= self.max_lr:
            raise UserError(f"the warmup start lr must be between 0 and --lr ({self.max_lr}), "
                            f"got {self.init_lr!r}.")
        for name, value in (("--lr-warmup-iters", self.warmup_iters), ("--lr-decay-iters", self.decay_iters)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"{name} must be an integer >= 0, got {value!r}.")
        if self.decay_iters < 1:
            raise UserError(f"--lr-decay-iters must be at least 1, got {self.decay_iters}.")
        if self.warmup_iters >= self.decay_iters:
            raise UserError(
                f"--lr-warmup-iters ({self.warmup_iters}) must be smaller than --lr-decay-iters "
                f"({self.decay_iters}): the decay phase starts after warmup. Lower the warmup or "
                f"raise --lr-decay-iters (it defaults to --train-iters).")

    def lr(self, num_steps: int) -> float:
        """The learning rate after ``num_steps`` successful optimizer steps (Megatron's ``get_lr``)."""
        n = num_steps
        if n < 0:
            raise ValueError(f"num_steps must be >= 0, got {n}.")
        if self.warmup_iters > 0 and n <= self.warmup_iters:
            return self.init_lr + (self.max_lr - self.init_lr) * float(n) / float(self.warmup_iters)
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_iters:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(self.warmup_iters, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - self.warmup_iters) / float(self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    __call__ = lr

    def state_dict(self) -> dict:
        return dict(max_lr=self.max_lr, min_lr=self.min_lr, warmup_iters=self.warmup_iters,
                    decay_iters=self.decay_iters, decay_style=self.decay_style, init_lr=self.init_lr)
