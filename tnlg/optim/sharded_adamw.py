"""``torch.optim.AdamW`` on the slices of parameters this rank owns (ZeRO's partitioned optimizer).

A ZeRO engine owns flat pieces of its parameters (a slice of every bucket at stage 1, FSDP
shards at stages 2/3, everything at stage 0). :class:`ShardedAdamW` runs PyTorch's own
AdamW on those pieces instead of re-implementing the update:

* each contiguous *run* of an owned slice with one weight-decay setting becomes an
  ``nn.Parameter`` that is a **view** of the engine's storage (the fp32 master for 16-bit
  training, else the parameter buffer itself), so the update writes straight into it;
* the Adam moments are views of the engine's flat ``exp_avg``/``exp_avg_sq`` buffers, placed
  into the optimizer's state before the first step (torch initialises only empty state), so
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
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

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
        self.optimizers: list[torch.optim.AdamW] = []
        self.params: list[list[nn.Parameter]] = []
        for runs in self.groups:
            self._add_torch_adamw(runs)
        self.fused = bool(self.optimizers) and all(o.defaults.get("fused") for o in self.optimizers)
        device = self.groups[0][0].target.device if self.groups else torch.device("cpu")
        self._grad_scale = torch.ones((), dtype=torch.float32, device=device)  # 1 / grad_factor, fused path

    def _add_torch_adamw(self, runs: list[Run]) -> None:
        """``torch.optim.AdamW`` over parameters that are views of the runs' targets, the moments views
        of theirs (placed into its state before the first step)."""
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        params: list[nn.Parameter] = []
        for r in runs:
            p = nn.Parameter(r.target, requires_grad=False)  # a view: updates write through
            params.append(p)
            (decay if r.decay else no_decay).append(p)
        device = runs[0].target.device
        groups_kw: list[dict[str, Any]] = [dict(params=decay, weight_decay=self.weight_decay),
                                           dict(params=no_decay, weight_decay=0.0)]
        opt_kw: dict[str, Any] = dict(lr=0.0, betas=self.betas, eps=self.eps)
        try:
            opt = torch.optim.AdamW(groups_kw, fused=True, **opt_kw)
        except RuntimeError:  # no fused kernel for this device in this torch
            opt = torch.optim.AdamW(groups_kw, **opt_kw)
        fused = bool(opt.defaults.get("fused"))
        for p, r in zip(params, runs):
            step = torch.zeros((), dtype=torch.float32, device=device if fused else "cpu")
            opt.state[p] = dict(step=step, exp_avg=r.exp_avg, exp_avg_sq=r.exp_avg_sq)
        self.optimizers.append(opt)
        self.params.append(params)

    @torch.no_grad()
    def step(self, lr: float, grad_factor: float = 1.0) -> None:
        """One AdamW update of every owned run with gradient ``grad_factor * grad`` (the clipping
        coefficient over the loss scale). Runs with a master: one :func:`adamw_16bit_` each; the
        others: torch's AdamW (without its fused kernel an fp32 gradient is multiplied by
        ``grad_factor`` in place). A run without a gradient (an unused parameter) is skipped."""
        for i, r in enumerate(self.mixed):
            if r.grad is not None:
                self.mixed_steps[i] += 1
                adamw_16bit_(r.param, r.target, r.exp_avg, r.exp_avg_sq, r.grad, lr,
                             self.weight_decay if r.decay else 0.0, *self.betas, self.eps, self.mixed_steps[i],
                             grad_factor)
        scale = None
        if grad_factor != 1.0 and self.fused:
            scale = self._grad_scale.fill_(1.0 / grad_factor)  # the kernel divides by it
        for runs, params, opt in zip(self.groups, self.params, self.optimizers):
            for p, r in zip(params, runs):
                p.grad = r.grad if r.grad is None or r.grad.dtype == p.dtype else r.grad.to(p.dtype)
                if p.grad is not None and grad_factor != 1.0 and not self.fused:
                    p.grad.mul_(grad_factor)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.grad_scale = scale  # type: ignore[attr-defined]  # torch's fused AdamW reads it; its stubs omit it
            opt.step()
            for p in params:
                p.grad = None

    def set_step(self, step: int) -> None:
        """Adam's step count (bias correction) of every run, e.g. after loading a checkpoint."""
        self.mixed_steps = [int(step)] * len(self.mixed)
        for opt in self.optimizers:
            for st in opt.state.values():
                st["step"].fill_(float(step))
