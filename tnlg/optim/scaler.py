"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018; Megatron's ``DynamicGradScaler``).

The loss is multiplied by ``scale`` before backward so small fp16 gradients do
not underflow; the optimizer divides it out again. After each step:

* an inf/NaN anywhere in the gradients (checked globally, over TP and DP) means
  the step is **skipped** and the growth counter resets; after ``hysteresis``
  such overflows (consecutive or not, since the last growth) the scale is
  multiplied by ``backoff_factor`` (0.5), never below ``min_scale``;
* after ``growth_interval`` consecutive good steps the scale is multiplied by
  ``growth_factor`` (2) and the hysteresis budget is refilled.

Defaults are Megatron's (``--initial-loss-scale 2**32``, ``--min-loss-scale 1``,
``--loss-scale-window 1000``, ``--hysteresis 2``). ``hysteresis=1`` halves on
every overflow (PyTorch's ``GradScaler``).
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError

__all__ = ["DynamicLossScaler", "found_inf_or_nan"]


def found_inf_or_nan(tensors) -> bool:
    """True when any element of any tensor is inf or NaN (a local check, no communication)."""
    for t in tensors:
        if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
            return True
    return False


class DynamicLossScaler:
    """Loss scale with growth every ``growth_interval`` good steps and backoff on overflow.

    Use: ``(loss * scaler.scale).backward()``; unscale gradients by ``1 / scaler.scale``;
    ``found_inf`` = non-finite global gradient norm; ``scaler.update(found_inf)``;
    skip the optimizer update when ``found_inf``. The engine does all of this.
    """

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not (initial_scale > 0 and math.isfinite(initial_scale)):
            raise UserError(f"--initial-loss-scale must be a positive finite number, got {initial_scale!r}.")
        if not 0 < min_scale <= initial_scale:
            raise UserError(f"--min-loss-scale must be in (0, initial scale {initial_scale}], got {min_scale!r}.")
        if not growth_factor > 1:
            raise UserError(f"the loss-scale growth factor must be > 1, got {growth_factor!r}.")
        if not 0 < backoff_factor < 1:
            raise UserError(f"the loss-scale backoff factor must be in (0, 1), got {backoff_factor!r}.")
        for name, value in (("--loss-scale-window", growth_interval), ("--hysteresis", hysteresis)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}.")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Advance the state after one step; ``found_inf`` must agree on every rank."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return dict(scale=self.scale, growth_tracker=self._growth_tracker,
                    hysteresis_tracker=self._hysteresis_tracker)

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])
