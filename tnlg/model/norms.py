"""The normalisations of the decoder: LayerNorm and RMSNorm in fp32, keeping 16-bit inputs for backward.

Both are replicated over TP. :class:`AcrossHeadsRMSNorm` is the RMSNorm of a projection whose heads are split
over TP (the query and key norms of OLMo 2 and OLMoE), its statistics summed over the TP group. Sequence-parallel (the input is this rank's positions), their parameters
enter through ``f`` (:func:`tnlg.parallel.mappings.copy_to_tp_coalesced`: one coalesced all-reduce of
their gradients in backward), or the caller passes them already through one (``synced=``, a block's
coalesced ``f``, :class:`tnlg.model.block.Block`).
"""

from __future__ import annotations

from typing import Optional, Sequence, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import GPTConfig
from ..parallel.initialization import SelfInitializing, init_ones, init_zeros
from ..parallel.mappings import copy_to_tp, copy_to_tp_coalesced, reduce_from_tp
from ..parallel.sharding import mark_replicated
from ..parallel.state import ParallelState

__all__ = ["LayerNorm", "RMSNorm", "AcrossHeadsRMSNorm", "make_norm", "head_norm", "norm_parameters"]


def _layer_norm_in_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the LayerNorm kernel takes the 16-bit tensors as they are (CUDA: statistics and the
    weight gradient accumulate in fp32 inside the kernel, no fp32 copy in or out); elsewhere they are
    upcast first (the CPU results the tests pin down)."""
    return x.device.type == "cuda" and weight.dtype == x.dtype


class _LayerNorm16(torch.autograd.Function):
    """LayerNorm of a 16-bit input computed in fp32, keeping the input for backward in its own
    dtype (2 bytes per element, Korthikanti et al.'s count) instead of an fp32 copy (4). On CUDA
    with 16-bit weights the kernel reads and writes 16 bits and accumulates in fp32 itself: the
    output is 16-bit (what the next matmul casts to anyway) and no fp32 copies are made."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        shape = (x.shape[-1],)
        if _layer_norm_in_kernel(x, weight):
            out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        else:
            out, mean, rstd = torch.native_layer_norm(x.float(), shape, weight.float(), bias.float(), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        if _layer_norm_in_kernel(x, weight):
            return (*torch.ops.aten.native_layer_norm_backward(grad.to(x.dtype), x, (x.shape[-1],), mean, rstd,
                                                               weight, bias, mask), None)
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), (x.shape[-1],), mean, rstd, weight.float(), bias.float(), mask)
        return (None if gx is None else gx.to(x.dtype), None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(bias.dtype), None)


class LayerNorm(nn.LayerNorm, SelfInitializing):
    """LayerNorm computed in fp32 (also under bf16 autocast, and for 16-bit inputs, whose
    16-bit copy is what backward keeps); replicated over TP. Weight ones, bias zeros.

    ``sequence_parallel=True`` (``x`` is this rank's sequence shard): the weight and bias go
    through ``f`` (one coalesced all-reduce of their gradients in backward), unless the caller
    passes them already through ``f`` as ``synced=(weight, bias)``."""

    def __init__(self, dim: int, eps: float, device=None, ps: Optional[ParallelState] = None, init_key: str = ""):
        super().__init__(dim, eps=eps, device=device)
        self.ps = ps
        for p in (self.weight, self.bias):
            mark_replicated(p)
        self.set_init(dict(weight=init_ones, bias=init_zeros), 0, init_key)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False, synced=None) -> torch.Tensor:
        w: torch.Tensor = self.weight
        b: torch.Tensor = self.bias
        if synced is not None:
            w, b = synced
        elif sequence_parallel and self.ps is not None:
            w, b = copy_to_tp_coalesced((w, b), self.ps)
        # under autocast the fp32 output feeds autocast's casts; without it (inference on a model
        # trained with 16-bit parameters) the output takes the parameters' dtype, as the next
        # layer's weights have it
        out_dtype = None if _autocast_on(x.device.type) or w.dtype == torch.float32 else w.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            if x.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled():
                y = _LayerNorm16.apply(x, w, b, self.eps)
            else:
                y = F.layer_norm(x.float(), self.normalized_shape, w.float(), b.float(), self.eps)
        return y if out_dtype is None else y.to(out_dtype)


class _RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, keeping for backward the input in its own dtype
    (2 bytes per element for 16-bit activations, Korthikanti et al.'s count for a norm's input) and the
    fp32 ``rstd`` per token, not fp32 copies. Backward: ``dw = sum(g xhat)``,
    ``dx = rstd (g w - xhat mean(g w xhat))`` with ``xhat = x rstd``."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return xf * rstd * weight.float()

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat, g = x.float() * rstd, grad.float()
        gw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
        gxhat = g * weight.float()
        gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw.to(weight.dtype), None


class RMSNorm(SelfInitializing, nn.Module):
    """RMSNorm (Zhang & Sennrich 2019; Llama): ``x / sqrt(mean(x^2) + eps) * weight``, no mean, no bias,
    computed in fp32 (also under autocast; :class:`_RMSNorm` keeps the input in its own dtype for
    backward). Replicated over TP; weight ones. Output dtype as :class:`LayerNorm`'s: fp32 under autocast
    or with fp32 weights, else the weights' dtype. ``sequence_parallel`` / ``synced``: as
    :class:`LayerNorm` (``synced=(weight,)``)."""

    def __init__(self, dim: int, eps: float, device=None, ps: Optional[ParallelState] = None, init_key: str = ""):
        super().__init__()
        self.ps, self.eps = ps, eps
        self.weight = mark_replicated(nn.Parameter(torch.empty(dim, device=device)))
        self.set_init(dict(weight=init_ones), 0, init_key)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False, synced=None) -> torch.Tensor:
        w: torch.Tensor = self.weight
        if synced is not None:
            (w,) = synced
        elif sequence_parallel and self.ps is not None:
            (w,) = copy_to_tp_coalesced((w,), self.ps)
        out_dtype = None if _autocast_on(x.device.type) or w.dtype == torch.float32 else w.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = _RMSNorm.apply(x, w, self.eps)
        return y if out_dtype is None else y.to(out_dtype)


class AcrossHeadsRMSNorm(SelfInitializing, nn.Module):
    """RMSNorm over a whole projection of ``units`` heads of width ``d`` at once (OLMo 2's and OLMoE's ``q_norm``
    / ``k_norm``, ``qk_layernorm_across_heads``): ``x / sqrt(mean(x^2) + eps) * weight``, the mean over all
    ``units x d`` values of a token, ``weight`` ``[units x d]``, computed in fp32.

    Under TP each rank holds some of the heads, ``local`` (global unit indices, consecutive): its share of the
    sum of squares is summed over the TP group (an all-reduce whose backward is an all-reduce too, ``g`` then
    ``f``: every rank's heads depend on the sum, so its gradient is the sum of theirs). A unit that several ranks
    hold (a key/value group shared by ranks under grouped-query attention at any TP) counts ``1 / holders`` on
    each (``holders``: per local unit). The weight is replicated (the whole on every rank, each using its units'
    rows): the caller passes it through ``f`` (``synced=``, as the per-head norms'), so its gradient, each
    rank's rows, is summed over TP."""

    def __init__(self, units: int, d: int, eps: float, ps: ParallelState, local: range,
                 holders: Optional[Sequence[int]] = None, device=None, init_key: str = ""):
        super().__init__()
        self.ps, self.eps, self.units, self.d, self.local = ps, eps, units, d, local
        self.share = None if holders is None or all(n == 1 for n in holders) else tuple(1.0 / n for n in holders)
        self.weight = mark_replicated(nn.Parameter(torch.empty(units * d, device=device)))
        self.set_init(dict(weight=init_ones), 0, init_key)

    def forward(self, x: torch.Tensor, synced=None) -> torch.Tensor:
        """``x`` ``[b, local units, s, d]`` (the attention core's layout) -> the same, fp32."""
        w: torch.Tensor = self.weight if synced is None else synced[0]
        with torch.autocast(device_type=x.device.type, enabled=False):
            xf = x.float()
            sq = xf.pow(2).sum(-1)  # [b, n, s]
            if self.share is not None:
                sq = sq * torch.tensor(self.share, dtype=sq.dtype, device=sq.device).view(1, -1, 1)
            total = sq.sum(1)  # [b, s]
            if self.ps.tp_size > 1:
                total = copy_to_tp(reduce_from_tp(total, self.ps), self.ps)
            rstd = torch.rsqrt(total / (self.units * self.d) + self.eps)
            rows = w.float().view(self.units, self.d)[self.local.start:self.local.stop]
            return xf * rstd[:, None, :, None] * rows[None, :, None, :]


def make_norm(cfg: GPTConfig, ps: ParallelState, init_key: str, device=None) -> nn.Module:
    """The configured normalisation of width ``hidden_size``: :class:`LayerNorm` or :class:`RMSNorm`."""
    cls = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return cls(cfg.hidden_size, cfg.layernorm_epsilon, device=device, ps=ps, init_key=init_key)


def head_norm(cfg: GPTConfig, ps: ParallelState, init_key: str, device=None) -> nn.Module:
    """The configured normalisation of width ``head_dim`` (``qk_layernorm``'s query and key norms)."""
    cls = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return cls(cfg.head_dim, cfg.layernorm_epsilon, device=device, ps=ps, init_key=init_key)


def norm_parameters(norm: nn.Module) -> list[torch.Tensor]:
    """A normalisation's parameters in the order its ``synced=`` takes them."""
    return [cast(torch.Tensor, p) for p in (norm.weight, getattr(norm, "bias", None)) if p is not None]


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
