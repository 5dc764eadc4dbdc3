"""AdamW for 16-bit parameters in one pass: 16-bit gradient in, fp32 master and moments, 16-bit parameter out.

``torch.optim.AdamW``'s fused kernel takes gradients in the master's dtype, so a 16-bit
training step with it upcasts each gradient run to fp32 first (read 2 bytes, write 4) and copies
the updated master back into the 16-bit parameter in a separate pass (read 4, write 2). The
operator here does the whole update of one contiguous run in one pass per element: read the
16-bit (or fp32) gradient, read and write the fp32 master and both moments, write the 16-bit
parameter, the minimum of ``2 + 3 * 4 * 2 + 2 = 28`` bytes for a 16-bit gradient. The step's
gradient factor (clipping coefficient over the loss scale: fp16's unscale) multiplies the
gradient inside the same pass.

It is one operator, ``torch.ops.tnlg.adamw_16bit_`` (:func:`adamw_16bit_`, a
``torch.library`` custom operator that mutates ``param``, ``master``, ``exp_avg`` and
``exp_avg_sq``), so a dispatch mode (:class:`tnlg.plan.tracker.StepTracker`) sees one operator
whose bytes are its arguments, and fake tensors (``FakeTensorMode``) run its fake
implementation (nothing to compute, nothing allocated). Its implementations share one function
of the arithmetic, :func:`adamw_update`:

* CUDA: ``torch.compile(adamw_update, dynamic=True)``: Inductor fuses the pointwise chain into
  one kernel for every run length (``tests/test_mixed_adamw.py`` reads the kernel Inductor
  generates for the CPU: one kernel, 30 bytes per element by Inductor's count, which charges the
  written-only 16-bit parameter as read too; the code loads 14 bytes and stores 14). If the
  compiler fails, the eager composite runs, with a warning saying why;
* CPU: torch's own fused CPU AdamW (``torch._fused_adamw_``, the kernel behind
  ``torch.optim.AdamW(fused=True)``) in chunks of ``2^20`` elements: each chunk's gradient is
  copied into one fp32 buffer of 4 MiB (the kernel takes the gradient in the master's dtype), the
  kernel updates master and moments in one vectorised pass with the gradient factor as its
  ``grad_scale``, and the chunk of the master is rounded into the 16-bit parameter while it is
  still in cache. Measured on the 2-core AMD EPYC (avx512_bf16) on 2026-12-02 for a 23M-element
  bf16 run: 11.7 ms against 70 ms for the eager composite in ``2^16`` chunks (10 pointwise
  passes) and 38 ms for a whole-run upcast, fused step and copy back. Inductor's single kernel
  would be the minimum of bytes, but a compile per process costs seconds on the CPU, which every
  short CPU run and test would pay;
* elsewhere, and wherever the fused CPU kernel is missing or fails: the eager composite, in
  chunks of ``2^16`` elements, so that its fp32 temporaries stay a quarter of a megabyte.

The arithmetic is ``torch.optim.AdamW``'s (its single-tensor implementation, decoupled weight
decay, bias correction from the step count): ``tests/test_mixed_adamw.py`` checks it against
``torch.optim.AdamW`` on fp32 copies. No communication.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch

__all__ = ["adamw_16bit_", "adamw_update", "CHUNK", "CPU_CHUNK"]

CHUNK = 1 << 16  # elements per eager pass (the fallback)
CPU_CHUNK = 1 << 20  # elements per fused CPU pass (one 4 MiB fp32 gradient buffer)


def adamw_update(param: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 grad: torch.Tensor, decay: float, step_size: float, bias_correction2_sqrt: float, beta1: float,
                 beta2: float, eps: float, grad_factor: float) -> None:
    """One AdamW update of a run, written into ``master``, ``exp_avg``, ``exp_avg_sq`` and ``param``
    (``torch.optim.AdamW``'s single-tensor arithmetic; ``decay = 1 - lr * weight_decay``,
    ``step_size = lr / (1 - beta1^t)``, ``bias_correction2_sqrt = sqrt(1 - beta2^t)``)."""
    g = grad.float() * grad_factor
    m = exp_avg.lerp(g, 1 - beta1)
    v = torch.addcmul(exp_avg_sq * beta2, g, g, value=1 - beta2)
    denom = v.sqrt() / bias_correction2_sqrt + eps
    w = torch.addcdiv(master * decay, m, denom, value=-step_size)
    master.copy_(w)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    param.copy_(w)


def _eager(param, master, exp_avg, exp_avg_sq, grad, *scalars) -> None:
    n = master.numel()
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        adamw_update(param[lo:hi], master[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], grad[lo:hi], *scalars)


def _warn_eager(what: str, err: BaseException, cost: str) -> None:
    """Say once that the eager composite replaces a fused path, and why (the error's first line)."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    warnings.warn(f"{what} ({type(err).__name__}: {first}); the 16-bit optimizer step runs its eager composite "
                  f"(same arithmetic, {cost}).")


_compiled: Optional[Callable] = None


def _fused(*args) -> None:
    """The compiled update (one kernel per call); the eager composite if the compiler fails."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(adamw_update, dynamic=True, fullgraph=True)
    if _compiled is not _eager:
        try:
            return _compiled(*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure: the same arithmetic, eagerly
            _warn_eager("the fused 16-bit AdamW could not be compiled", err, "more memory traffic")
            _compiled = _eager
    _eager(*args)


@torch.library.custom_op("tnlg::adamw_16bit_", mutates_args=("param", "master", "exp_avg", "exp_avg_sq"))
def adamw_16bit_(param: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 grad: torch.Tensor, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
                 step: int, grad_factor: float) -> None:
    """AdamW step ``step`` (counted from 1) of one run: 1-D ``param`` (16-bit), fp32 ``master``,
    ``exp_avg``, ``exp_avg_sq`` and ``grad`` (any float dtype) of one length; the gradient used is
    ``grad_factor * grad``. Updates the four in place (module docstring)."""
    _eager(param, master, exp_avg, exp_avg_sq, grad, *_scalars(lr, weight_decay, beta1, beta2, eps, step,
                                                               grad_factor))


@adamw_16bit_.register_kernel("cuda")
def _adamw_16bit_cuda(param, master, exp_avg, exp_avg_sq, grad, lr, weight_decay, beta1, beta2, eps, step,
                      grad_factor) -> None:
    _fused(param, master, exp_avg, exp_avg_sq, grad, *_scalars(lr, weight_decay, beta1, beta2, eps, step,
                                                               grad_factor))


_cpu_fused_ok = hasattr(torch, "_fused_adamw_")


@adamw_16bit_.register_kernel("cpu")
def _adamw_16bit_cpu(param, master, exp_avg, exp_avg_sq, grad, lr, weight_decay, beta1, beta2, eps, step,
                     grad_factor) -> None:
    """The CPU kernel (module docstring): per chunk, the gradient into one fp32 buffer, torch's fused
    AdamW on master and moments (the step count and ``1 / grad_factor`` as the tensors it reads), the
    master's chunk rounded into ``param``. If torch's kernel refuses a chunk, that chunk and the rest
    run the eager composite (the chunks before it are updated once, not twice)."""
    global _cpu_fused_ok
    scalars = _scalars(lr, weight_decay, beta1, beta2, eps, step, grad_factor)  # also checks the step count
    n, lo = master.numel(), 0
    if _cpu_fused_ok:
        buf = torch.empty(min(n, CPU_CHUNK), dtype=torch.float32)
        steps = [torch.tensor(float(step))]
        scale = None if grad_factor == 1.0 else torch.tensor(1.0 / grad_factor)
        try:
            for lo in range(0, n, CPU_CHUNK):
                hi = min(n, lo + CPU_CHUNK)
                g = buf[:hi - lo]
                g.copy_(grad[lo:hi])
                torch._fused_adamw_([master[lo:hi]], [g], [exp_avg[lo:hi]], [exp_avg_sq[lo:hi]], [], steps, lr=lr,
                                    beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                                    maximize=False, grad_scale=scale)
                param[lo:hi].copy_(master[lo:hi])
            return
        except (RuntimeError, NotImplementedError) as err:  # this torch's CPU kernel refuses: the composite
            _warn_eager("torch's fused CPU AdamW failed", err, "slower")
            _cpu_fused_ok = False
    _eager(param[lo:], master[lo:], exp_avg[lo:], exp_avg_sq[lo:], grad[lo:], *scalars)


@adamw_16bit_.register_fake
def _adamw_16bit_fake(param, master, exp_avg, exp_avg_sq, grad, lr, weight_decay, beta1, beta2, eps, step,
                      grad_factor) -> None:
    return None


def _scalars(lr: float, weight_decay: float, beta1: float, beta2: float, eps: float, step: int,
             grad_factor: float) -> tuple:
    """:func:`adamw_update`'s scalar arguments from the hyper-parameters (as ``torch.optim.AdamW``)."""
    if step < 1:
        raise ValueError(f"AdamW's step count starts at 1, got {step}.")
    return (1 - lr * weight_decay, lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step), beta1, beta2, eps,
            grad_factor)
