"""torch's AdamW on the slices of parameters this rank owns (ZeRO's partitioned optimizer).

A ZeRO engine owns flat pieces of its parameters (a slice of every bucket at stage 1, FSDP
shards at stages 2/3, everything at stage 0). :class:`ShardedAdamW` runs PyTorch's own
AdamW on those pieces instead of re-implementing the update:

* each contiguous *run* of an owned slice with one weight-decay setting is a **view** of the
  engine's storage (the fp32 master for 16-bit training, else the parameter buffer itself),
  updated in place by torch's functional AdamW (``torch.optim.adamw.adamw``, the function
  ``torch.optim.AdamW.step`` calls with its parameter groups' settings): the ``torch.optim.AdamW``
  object itself is not built, because its methods import ``torch._dynamo`` on first call (about
  1 CPU-s for every worker that starts; ``tests/test_imports.py``) and hold nothing the engine
  does not hold already;
* the Adam moments are views of the engine's flat ``exp_avg``/``exp_avg_sq`` buffers, so
  checkpoints and the planner see one flat buffer per moment;
* the optimizer is stepped one *group* at a time (a bucket of the flat layout, or a chunk of
  FSDP shards of about a bucket's size);
* weight decay goes to matrices only (the engine's ``decay_fn``); AdamW's decoupled decay
  ``p *= 1 - lr * wd`` then the Adam update, as ``torch.optim.AdamW``;
* fp32 parameters: torch's *fused* AdamW (one kernel per group reads gradient, parameter and
  moments once and writes them once; CUDA and CPU) wherever this torch has it, else its default
  implementation. The gradient factor of the step (clipping coefficient / loss scale) is
  folded into the fused kernel as its ``grad_scale`` (a device scalar filled in place: no
  extra pass over the gradients, no host synchronisation); without the fused kernel the
  gradient is multiplied in place;
* 16-bit parameters (a run with an fp32 master): :func:`tnlg.optim.mixed_adamw.adamw_16bit_`,
  one pass per run that reads the 16-bit gradient, updates the master and moments and writes the
  16-bit parameter, the gradient factor folded in (torch's fused kernel would need the gradient
  upcast first and the master copied back after: 1.5x the memory traffic, simulated at
  GPT-2-XL). Same arithmetic as ``torch.optim.AdamW``, on the same flat buffers (checkpoints and
  the planner see no difference); such a run's step count is a Python int.

No communication. Every parameter view keeps its own step count (torch's layout: a run
without a gradient is skipped and not counted); :meth:`set_step` sets them all (after loading
a checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.optim.adamw import adamw

from .mixed_adamw import adamw_16bit_

__all__ = ["Run", "ShardedAdamW"]


@dataclass
class Run:
    """One contiguous owned range with one weight-decay setting: views of the same length."""

    target: torch.Tensor          # what AdamW updates: the fp32 master, or the parameter itself
    grad: Optional[torch.Tensor]  # its gradient (16-bit or fp32 for a master); None between steps
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: bool
    param: Optional[torch.Tensor] = None   # the 16-bit parameter a master's update is written into


class ShardedAdamW:
    """AdamW over groups of :class:`Run` (see the module docstring)."""

    def __init__(self, groups: Sequence[Sequence[Run]], *, betas, eps: float, weight_decay: float):
        self.betas, self.eps, self.weight_decay = (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)
        # runs with a master: the one-pass 16-bit update, each with its step count
        self.mixed = [r for g in groups for r in g if r.param is not None]
        self.mixed_steps = [0] * len(self.mixed)
        self.groups = [[r for r in g if r.param is None] for g in groups]
        self.groups = [g for g in self.groups if g]
        runs = [r for g in self.groups for r in g]
        self.fused = bool(runs) and all(_fused_kernel_for(r.target) for r in runs)
        device = runs[0].target.device if runs else torch.device("cpu")
        # each run's step count, a tensor as torch's AdamW keeps it (on the device for the fused kernel)
        self.steps = [[torch.zeros((), dtype=torch.float32, device=device if self.fused else "cpu") for _ in g]
                      for g in self.groups]
        self._grad_scale = torch.ones((), dtype=torch.float32, device=device)  # 1 / grad_factor, fused path

    @torch.no_grad()
    def step(self, lr: float, grad_factor: float = 1.0) -> None:
        """One AdamW update of every owned run with gradient ``grad_factor * grad`` (the clipping
        coefficient over the loss scale). Runs with a master: one :func:`adamw_16bit_` each; the
        others: torch's AdamW, one call per group and weight-decay setting (without its fused kernel
        an fp32 gradient is multiplied by ``grad_factor`` in place). A run without a gradient (an
        unused parameter) is skipped."""
        for i, r in enumerate(self.mixed):
            if r.grad is not None:
                self.mixed_steps[i] += 1
                adamw_16bit_(r.param, r.target, r.exp_avg, r.exp_avg_sq, r.grad, lr,
                             self.weight_decay if r.decay else 0.0, *self.betas, self.eps, self.mixed_steps[i],
                             grad_factor)
        scale = None
        if grad_factor != 1.0 and self.fused:
            scale = self._grad_scale.fill_(1.0 / grad_factor)  # the kernel divides by it
        for runs, steps in zip(self.groups, self.steps):
            for decay in (True, False):  # torch.optim.AdamW's two parameter groups: with and without decay
                chosen = [(r, s) for r, s in zip(runs, steps) if r.decay == decay and r.grad is not None]
                if not chosen:
                    continue
                grads = []
                for r, _ in chosen:
                    assert r.grad is not None
                    g = r.grad if r.grad.dtype == r.target.dtype else r.grad.to(r.target.dtype)
                    if grad_factor != 1.0 and not self.fused:
                        g.mul_(grad_factor)
                    grads.append(g)
                adamw([r.target for r, _ in chosen], grads, [r.exp_avg for r, _ in chosen],
                      [r.exp_avg_sq for r, _ in chosen], [], [s for _, s in chosen],
                      fused=True if self.fused else None, grad_scale=scale, amsgrad=False, beta1=self.betas[0],
                      beta2=self.betas[1], lr=lr, weight_decay=self.weight_decay if decay else 0.0, eps=self.eps,
                      maximize=False)

    def set_step(self, step: int) -> None:
        """Adam's step count (bias correction) of every run, e.g. after loading a checkpoint."""
        self.mixed_steps = [int(step)] * len(self.mixed)
        for steps in self.steps:
            for s in steps:
                s.fill_(float(step))


def _fused_kernel_for(t: torch.Tensor) -> bool:
    """Whether torch has a fused AdamW kernel for this tensor's device and dtype (the check
    ``torch.optim.AdamW(fused=True)`` makes, which raises where there is none)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the list: its default implementation
        return False
    return t.device.type in _get_fused_kernels_supported_devices() and torch.is_floating_point(t)
