"""What the engine and the checkpoint code call on a data-parallel backend.

:class:`tnlg.optim.engine.Engine` owns the call protocol of a training iteration
(micro-step counting, loss scaling, the step count, the hyper-parameters a checkpoint
records); a backend owns the parameters, gradients and optimizer states and their
communication over the DP group. Three backends implement :class:`DataParallelBackend`:

=========================================================  ========  ======================
backend                                                    ``impl``  ZeRO stages
=========================================================  ========  ======================
:class:`tnlg.optim.zero.FlatZero` (our flat buffers)       flat      0, 1
:class:`tnlg.optim.fsdp.FSDPZero` (PyTorch FSDP2)          fsdp      2, 3
:class:`tnlg.optim.deepspeed_engine.DeepSpeedBackend`      deepspeed 1, 2, 3 (DeepSpeed's own)
=========================================================  ========  ======================

Checkpoints exchange states in *pieces*: the part of each parameter's flattened TP shard
that a rank owns (``owned_pieces``), as views they write from and load into, so nothing is
gathered. A backend that cannot expose views (DeepSpeed) returns ``None`` there and hands
over whole per-parameter states instead (``optimizer_state_by_param``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Protocol, runtime_checkable

import torch
import torch.nn as nn

from .clip import clip_coefficient

__all__ = ["DataParallelBackend", "StepResult", "clipped_step"]


class StepResult(NamedTuple):
    """What a backend's optimizer step reports."""

    grad_norm: float     # global gradient norm before clipping, unscaled
    skipped: bool        # inf/NaN gradients: no update was made
    clip_coeff: float    # min(1, clip_grad / (grad_norm + 1e-6))
    loss: Optional[float] = None  # the loss handed to step(), read with the norm; not finite: no update


def clipped_step(norm: float, loss_value: Optional[float], loss_scale: float, clip_grad: float,
                 update: Callable[[float], None]) -> StepResult:
    """A step once its norm and loss are read: the norm unscaled by ``loss_scale``, the step skipped when it or the
    loss is inf/NaN, else ``update(coefficient / loss_scale)`` (the AdamW step of each part, the clipping
    coefficient folded into its unscaling)."""
    if loss_scale != 1.0:
        norm = norm / loss_scale
    skipped = (loss_value is not None and not math.isfinite(loss_value)) or not math.isfinite(norm)
    coeff = clip_coefficient(norm, clip_grad)
    if not skipped:
        update(coeff / loss_scale)
    return StepResult(norm, skipped, coeff, loss_value)


@runtime_checkable
class DataParallelBackend(Protocol):
    """The parameters, gradients and optimizer states of this rank's TP shard, over the DP group."""

    impl: str                     # "flat", "fsdp" or "deepspeed"
    names: list[str]              # trainable parameter names, in the backend's order
    dtype: torch.dtype            # the parameters' dtype (16-bit: an fp32 master is stepped)
    pieces_sharded_over_dp: bool  # True when every DP rank owns a different part of the states

    @property
    def model(self) -> nn.Module:
        """The module the loop calls (the GPT, sharded in place or wrapped; same parameter names)."""

    # ----------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, factor: float, is_last: bool) -> None:
        """Backward of ``loss * factor`` (``factor`` = loss scale / accumulation steps); reduce
        gradients over DP only when ``is_last``."""

    def step(self, lr: float, clip_grad: float, loss_scale: float,
             loss: Optional[torch.Tensor] = None) -> StepResult:
        """Finish the gradient reduction, take the global norm, clip, run AdamW on what this rank
        owns and bring the parameters up to date. ``loss`` (a device scalar) is read in the same host
        synchronisation as the norm; if it is not finite, no update is made."""

    def zero_grad(self) -> None:
        """Zero (or drop) the gradients before the next iteration."""

    def set_step(self, step: int) -> None:
        """Adam's step count (bias correction), e.g. after loading a checkpoint."""

    # ----------------------------------------------------------------- state exchange
    def param_shapes(self) -> dict[str, tuple]:
        """``{name: shape}`` of this TP shard (full over DP); no communication."""

    def owned_pieces(self) -> Optional[list[dict]]:
        """Views of what this rank owns, one dict per parameter piece (``name``, ``lo``,
        ``length``, ``param``, ``exp_avg``, ``exp_avg_sq``, ``master``); ``None`` when the
        backend cannot expose views (then :meth:`optimizer_state_by_param` is used)."""

    def optimizer_state_by_param(self) -> dict[str, dict]:
        """``{name: {"exp_avg", "exp_avg_sq"}}`` fp32, shaped like this TP shard; collective over DP
        when the states are partitioned."""

    def load_optimizer_state_by_param(self, states: dict) -> None:
        """Keep this rank's part of full per-parameter states (checked by the engine); no communication."""

    def param_tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of this TP shard, full over DP, one at a time (collective where
        parameters are sharded: every DP rank must iterate with the same names)."""

    def load_param(self, name: str, value: torch.Tensor) -> None:
        """Copy a full (over DP) value of this TP shard of parameter ``name``; no communication."""

    def gather_params(self) -> None:
        """Bring every rank's parameters up to date from the owned slices (flat stage 1: all-gather)."""

    def refresh_master(self) -> None:
        """fp32 master of the owned slices <- the (16-bit) parameters."""

    def memory_report(self) -> dict:
        """Bytes this rank holds: ``param_bytes``, ``grad_bytes``, ``optim_bytes`` (+ element counts)."""

    def close(self) -> None:
        """Release hooks and buffers that outlive the object otherwise (DeepSpeed's engine)."""


@runtime_checkable
class PipelineBackend(DataParallelBackend, Protocol):
    """A backend a pipeline schedule drives (tnlg's flat ZeRO and FSDP2, not DeepSpeed's): the gradient
    reduction switched on for the last backward only, and each gradient the optimizer steps as a view."""

    def set_sync(self, is_last: bool) -> None:
        """Reduce gradients over DP in the next backward only when ``is_last``."""

    def grad_view(self, name: str) -> torch.Tensor:
        """The gradient of parameter ``name`` the optimizer steps, as a view."""
