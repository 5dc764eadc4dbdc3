"""Global gradient norm across tensor- and data-parallel ranks, and Megatron's clipping rule.

The norm must equal the one a single process computes on the full model:

1. each rank sums the squares of the gradient elements it holds, split into
   ``tp_sharded`` parameters and TP-replicated ones;
2. where gradients are partitioned over DP (ZeRO stage >= 1: each DP rank
   holds a disjoint slice), both sums are all-reduced over the DP group;
   with stage 0 every DP rank holds the same full gradient and nothing runs;
3. the sharded sum is all-reduced over the TP group (each TP rank holds a
   different slice); the replicated sum is *not* (every TP rank holds the same
   values, so adding them would count them ``tp`` times, fairscale's bug).

``norm = sqrt(sharded + replicated)``, accumulated in fp64. Clipping multiplies
every gradient by ``min(1, max_norm / (norm + 1e-6))`` (Megatron, and
``torch.nn.utils.clip_grad_norm_``).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..parallel.state import ParallelState

__all__ = ["squared_sums", "global_norm", "clip_coefficient", "clip_grad_norm_"]


def squared_sums(pieces: Iterable[tuple[torch.Tensor, bool]]) -> tuple[float, float]:
    """Local ``(sum of squares of tp_sharded pieces, of replicated pieces)`` in fp64.

    ``pieces`` yields ``(tensor, tp_sharded)``; each tensor is summed once.
    """
    sums = [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
    for t, sharded in pieces:
        if t.numel():
            flat = t.detach().reshape(-1)
            sq = torch.dot(flat, flat) if flat.dtype == torch.float32 else flat.double().pow(2).sum()
            sums[0 if sharded else 1] += sq.double().cpu()
    return float(sums[0]), float(sums[1])


def global_norm(sharded_sq: float, replicated_sq: float, ps: ParallelState, over_dp: bool,
                device: Optional[torch.device] = None) -> float:
    """The full-model L2 norm from this rank's squared sums.

    Collectives: an all-reduce of 2 fp64 numbers over DP when ``over_dp``
    (gradients partitioned over DP), then of 1 over TP. Every rank gets the same value.
    """
    device = device or ps.device
    sums = torch.tensor([sharded_sq, replicated_sq], dtype=torch.float64, device=device)
    if over_dp and ps.dp_size > 1:
        dist.all_reduce(sums, group=ps.dp_group)
    if ps.tp_size > 1:
        sharded = sums[:1].clone()
        dist.all_reduce(sharded, group=ps.tp_group)
        sums[0] = sharded[0]
    total = float(sums.sum())
    return math.sqrt(total) if total >= 0 else float("nan")


def clip_coefficient(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``; 1 when clipping is off (``max_norm <= 0``) or the
    norm is not finite (the step is skipped then)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1.0e-6))


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, ps: ParallelState,
                    grads_sharded_over_dp: bool = False) -> float:
    """Clip the ``.grad`` of ``parameters`` in place by the global norm; return the norm before clipping.

    For plain tensors and for DTensors (FSDP: the local shard is used). Each
    parameter's ``tp_sharded`` attribute says whether it is split over TP
    (missing = replicated, which is only right when ``ps.tp_size == 1``).
    Collectives: see :func:`global_norm`.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [_local(p.grad) for p in params]
    sh, rep = squared_sums((g, bool(getattr(p, "tp_sharded", False))) for g, p in zip(grads, params))
    norm = global_norm(sh, rep, ps, over_dp=grads_sharded_over_dp)
    coeff = clip_coefficient(norm, max_norm)
    if coeff < 1.0:
        for g in grads:
            g.mul_(coeff)
    return norm


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no communication), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t
