"""The data-parallel engine the training loop uses: ZeRO 0-3 composed with tensor parallelism.

One iteration with ``grad_accum_steps = k``::

    engine.zero_grad()
    for micro_batch in micro_batches:            # k of them
        loss = engine.model(tokens, labels=labels)  # mean loss of this micro batch
        engine.backward(loss)                     # the engine divides by k (and loss-scales)
    info = engine.step(lr)                        # {"grad_norm": ..., "skipped": ..., ...}

* ``backward`` counts micro steps: only the k-th communicates (bucketed,
  asynchronous reduction overlapped with backward); the first k-1 only
  accumulate. It scales the loss by ``loss_scale / k`` itself, so the caller
  passes the plain mean loss of the micro batch and global batch =
  micro batch x DP x k gives the same gradient as one big batch.
* ``step`` waits for the gradient reduction, unscales, computes the global
  gradient norm (:mod:`tnlg.optim.clip`), skips the update when the norm is
  inf/NaN (and lowers the loss scale if one is used), else clips by
  ``min(1, clip_grad / (norm + 1e-6))``, runs AdamW and brings the parameters
  up to date (stage 1: all-gather). The next ``backward`` requires ``zero_grad()``.

Stages: 0 and 1 are :class:`tnlg.optim.zero.FlatZero` (our flat buffers);
2 and 3 are :class:`tnlg.optim.fsdp.FSDPZero` (FSDP2). With one DP rank there
is nothing to shard: every stage then runs the flat stage-0 path (same
numbers, no communication). Precision: parameters stay in the dtype they are
built with (fp32 for ``--bf16``/``--fp16`` autocast); for bf16/fp16 parameters
the optimizer keeps an fp32 master copy of the slice it owns.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..errors import UserError
from ..parallel.state import ParallelState
from .clip import clip_coefficient, global_norm, squared_sums
from .scaler import DynamicLossScaler
from .zero import FlatZero, default_decay

__all__ = ["Engine", "build_engine", "check_optimizer_args", "common_step", "STATE_FORMAT"]

STATE_FORMAT = "tnlg.optim/1"


class Engine:
    """Wraps a ZeRO backend; see the module docstring for the call protocol."""

    def __init__(self, backend, ps: ParallelState, zero_stage: int, lr: float, clip_grad: float,
                 grad_accum_steps: int, loss_scaler: Optional[DynamicLossScaler]):
        self.backend = backend
        self.ps = ps
        self.zero_stage = zero_stage
        self.lr = lr
        self.clip_grad = clip_grad
        self.grad_accum_steps = grad_accum_steps
        self.loss_scaler = loss_scaler
        self.num_steps = 0          # successful optimizer steps (Adam's step count)
        self._micro = 0
        self._needs_zero = False

    # ----------------------------------------------------------------- properties
    @property
    def model(self) -> nn.Module:
        """The module to call (FSDP-sharded in place for stages 2/3; same parameter names)."""
        return self.backend.model

    @property
    def impl(self) -> str:
        return self.backend.impl

    @property
    def param_names(self) -> list[str]:
        return list(self.backend.names)

    @property
    def is_last_micro_step(self) -> bool:
        """True when the next ``backward`` is the one that communicates."""
        return self._micro == self.grad_accum_steps - 1

    # ----------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro batch's mean loss, divided by ``grad_accum_steps`` and loss-scaled here.

        The ``grad_accum_steps``-th call since ``zero_grad`` reduces gradients over
        DP, overlapped with backward; earlier calls do no communication.
        """
        if self._needs_zero:
            raise RuntimeError("engine.backward() after engine.step() without engine.zero_grad(): the "
                               "previous step's gradients would be added to this one's.")
        if self._micro >= self.grad_accum_steps:
            raise RuntimeError(f"engine.backward() called {self._micro + 1} times before step(), but "
                               f"grad_accum_steps={self.grad_accum_steps}.")
        self.backend.set_sync(self.is_last_micro_step)
        factor = 1.0 / self.grad_accum_steps
        if self.loss_scaler is not None:
            factor *= self.loss_scaler.scale
        (loss if factor == 1.0 else loss * factor).backward()
        self._micro += 1

    def step(self, lr: Optional[float] = None) -> dict:
        """Finish the gradient reduction, clip, update; returns ``grad_norm`` (before clipping, unscaled),
        ``skipped`` (inf/NaN gradients: no update), ``clip_coeff``, ``loss_scale`` and ``lr``.

        Collectives: waits for the bucket reductions; 2 tiny all-reduces (norm);
        stage 1 all-gathers the parameters.
        """
        if self._micro != self.grad_accum_steps:
            raise RuntimeError(f"engine.step() after {self._micro} backward call(s); expected "
                               f"grad_accum_steps={self.grad_accum_steps}.")
        lr = self.lr if lr is None else float(lr)
        b = self.backend
        b.finish_grad_sync()
        sh, rep = squared_sums(b.grad_pieces())
        norm = global_norm(sh, rep, self.ps, over_dp=b.grads_sharded_over_dp)
        scale = 1.0
        if self.loss_scaler is not None:
            scale = self.loss_scaler.scale
            norm = norm / scale
        found_inf = not math.isfinite(norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        coeff = clip_coefficient(norm, self.clip_grad)
        if not found_inf:
            factor = coeff / scale
            if factor != 1.0:
                b.scale_grads_(factor)
            self.num_steps += 1
            b.adam_step(lr, self.num_steps)
        self._micro = 0
        self._needs_zero = True
        return dict(grad_norm=norm, skipped=found_inf, clip_coeff=coeff, lr=lr,
                    loss_scale=None if self.loss_scaler is None else scale)

    def zero_grad(self) -> None:
        """Zero the gradients (flat buffers are zeroed in place; FSDP grads set to None)."""
        self.backend.zero_grad()
        self._micro = 0
        self._needs_zero = False

    # ----------------------------------------------------------------- state
    def optimizer_state_by_param(self) -> dict[str, dict]:
        """``{name: {"exp_avg", "exp_avg_sq" (fp32, shaped like this rank's TP shard), "step"}}``.

        Independent of DP size and ZeRO stage. Collective over DP (stage >= 1
        all-gathers); every DP rank must call it and every one gets the result.
        Merging TP shards (``tnlg.shards.gather_full`` on each tensor) is the
        checkpoint's job: the states have the parameter's shape and split.
        """
        out = self.backend.optimizer_state_by_param()
        for d in out.values():
            d["step"] = self.num_steps
        return out

    def load_optimizer_state_by_param(self, states: dict) -> None:
        """Inverse of :meth:`optimizer_state_by_param` at any DP size / stage: keeps this rank's part.

        No communication. Load the model's parameters first (the fp32 master, if
        any, is refreshed from them). All parameters must carry the same ``step``.
        """
        step = common_step(states)
        self.backend.load_optimizer_state_by_param(states)
        self.num_steps = step

    def state_dict(self) -> dict:
        """Layout-independent optimizer state (collective over DP): per-parameter states, step count,
        loss-scaler state and the hyper-parameters, for ``torch.save``/DCP."""
        b = self.backend
        return dict(format=STATE_FORMAT, num_steps=self.num_steps, zero_stage=self.zero_stage,
                    betas=(b.beta1, b.beta2), eps=b.eps, weight_decay=b.weight_decay,
                    params=self.optimizer_state_by_param(),
                    loss_scaler=None if self.loss_scaler is None else self.loss_scaler.state_dict())

    def load_state_dict(self, sd: dict) -> None:
        """Load a :meth:`state_dict` saved at any DP size and ZeRO stage (same TP shard shapes)."""
        if sd.get("format") != STATE_FORMAT:
            raise UserError(f"optimizer state has format {sd.get('format')!r}, expected {STATE_FORMAT!r}.")
        self.load_optimizer_state_by_param(sd["params"])
        self.num_steps = int(sd["num_steps"])
        if self.loss_scaler is not None and sd.get("loss_scaler"):
            self.loss_scaler.load_state_dict(sd["loss_scaler"])

    def model_state_by_param(self) -> dict[str, torch.Tensor]:
        """This TP rank's parameters, full over DP (stage 3 all-gathers: collective over DP)."""
        return self.backend.model_state_by_param()

    def load_model_state_by_param(self, tensors: dict) -> None:
        """Copy parameters (this TP shard's shapes) into the model, whatever the stage; no communication."""
        self.backend.load_model_state_by_param(tensors)

    def memory_report(self) -> dict:
        """Per-rank bytes: ``param_bytes``, ``grad_bytes``, ``optim_bytes`` (+ element counts)."""
        return self.backend.memory_report()


def build_engine(model: nn.Module, ps: ParallelState, zero_stage: int = 1, lr: float = 1e-4,
                 weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8, clip_grad: float = 1.0,
                 grad_accum_steps: int = 1, bucket_size_mb: float = 25.0,
                 loss_scaler: Optional[DynamicLossScaler] = None,
                 decay_fn: Callable[[str, torch.Tensor], bool] = default_decay,
                 collectives: str = "auto") -> Engine:
    """Wrap ``model`` (this rank's TP shard, already on ``ps.device``) for data-parallel training.

    ``zero_stage`` 0: all-reduce, full AdamW everywhere; 1: optimizer states
    partitioned (flat buffers); 2: + gradients sharded; 3: + parameters sharded
    (2 and 3 via FSDP2). ``clip_grad <= 0`` disables clipping. ``bucket_size_mb``
    sizes the gradient buckets of stages 0/1. ``decay_fn(name, param)`` picks the
    parameters that get weight decay (default: ``ndim >= 2``). ``collectives``
    (stages 0/1): ``auto``, ``native`` or ``p2p``, see :mod:`tnlg.optim.zero`. Every rank of the
    world must call this (collectives are set up).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
    check_optimizer_args(lr, weight_decay, betas, eps, clip_grad, grad_accum_steps, bucket_size_mb)
    kw = dict(betas=betas, eps=eps, weight_decay=weight_decay, decay_fn=decay_fn)
    if zero_stage >= 2 and ps.dp_size > 1:
        from .fsdp import FSDPZero
        backend = FSDPZero(model, ps, zero_stage, **kw)
    else:
        stage = zero_stage if zero_stage <= 1 else 0  # one DP rank: nothing to shard
        backend = FlatZero(model, ps, stage, bucket_size_mb=bucket_size_mb, collectives=collectives, **kw)
    return Engine(backend, ps, zero_stage, float(lr), float(clip_grad), grad_accum_steps, loss_scaler)


def check_optimizer_args(lr, weight_decay, betas, eps, clip_grad, grad_accum_steps, bucket_size_mb) -> None:
    """The optimizer settings every engine accepts; a clear :class:`UserError` for a bad one."""
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise UserError(f"gradient accumulation steps must be a positive integer, got {grad_accum_steps!r} "
                        f"(global batch / (micro batch x data-parallel size)).")
    for name, value in (("--lr", lr), ("--weight-decay", weight_decay), ("--adam-eps", eps)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise UserError(f"{name} must be a finite number >= 0, got {value!r}.")
    if not eps > 0:
        raise UserError(f"--adam-eps must be > 0, got {eps!r}.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise UserError(f"Adam betas must be two numbers in [0, 1), got {betas!r}.")
    if not (isinstance(clip_grad, (int, float)) and math.isfinite(clip_grad)):
        raise UserError(f"--clip-grad must be a finite number (0 disables clipping), got {clip_grad!r}.")
    if not bucket_size_mb > 0:
        raise UserError(f"the gradient bucket size must be > 0 MiB, got {bucket_size_mb!r}.")


def common_step(states: dict) -> int:
    """The one Adam step count all per-parameter states carry; a clear :class:`UserError` otherwise."""
    no_step = [n for n, d in states.items() if not isinstance(d, dict) or "step" not in d]
    if no_step:
        raise UserError(f"optimizer state of parameter {no_step[0]!r} has no 'step' count (Adam's bias "
                        f"correction needs it); pass the dict that optimizer_state_by_param() returned.")
    steps = {int(d["step"]) for d in states.values()} if states else {0}
    if len(steps) > 1:
        raise UserError(f"optimizer state has different step counts per parameter ({sorted(steps)[:4]}); "
                        f"this engine keeps one step count for all parameters.")
    return steps.pop()
