"""Autograd-aware collectives over the tensor-parallel group (Megatron paper, section 3).

Each operator is a pair (forward communication, backward communication):

============================  ===========================  ===========================
operator                      forward                      backward
============================  ===========================  ===========================
``copy_to_tp``  (paper's f)   identity                     all-reduce (sum) over TP
``reduce_from_tp`` (paper's g) all-reduce (sum) over TP     identity
``scatter_to_tp``             keep this rank's last-dim    all-gather along last dim
                              slice (no communication)
``gather_from_tp``            all-gather along last dim    keep this rank's slice
============================  ===========================  ===========================

Slices along the last dimension may be uneven (``sizes`` gives every rank's
width), which the uneven attention-head partition needs. With ``tp_size == 1``
every operator is the identity and no collective runs.

Also here: :func:`all_gather_flat` / :func:`reduce_scatter_flat`, the flat
collectives ZeRO uses, picking ``all_gather_single``/``reduce_scatter_single``
where the installed torch has them and the ``*_tensor`` names otherwise.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .state import ParallelState

__all__ = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
           "all_gather_flat", "reduce_scatter_flat", "all_reduce", "all_gather_uneven"]


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce that is a no-op without a group (one member)."""
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Gather equal-sized 1-D shards of every rank into ``output`` (rank order).

    Returns the work handle when ``async_op``."""
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(output, shard, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
    """Sum ``full`` over ranks and keep this rank's equal-sized slice in ``output``.

    Returns the work handle when ``async_op``."""
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output, full, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, full, group=group, async_op=async_op)


def _split_sizes(ps: ParallelState, width: int, sizes: Optional[Sequence[int]]) -> list[int]:
    if sizes is None:
        if width % ps.tp_size:
            raise ValueError(f"last dimension {width} does not divide by tp_size={ps.tp_size}; pass sizes=")
        return [width // ps.tp_size] * ps.tp_size
    return list(sizes)


def all_gather_uneven(x: torch.Tensor, sizes: Sequence[int], dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, where rank ``i`` holds ``sizes[i]`` entries.

    Collectives need equal sizes (gloo and NCCL), so shards are zero-padded to the
    largest size, gathered, and trimmed.
    """
    x = x.movedim(dim, 0)
    width = max(sizes)
    if x.shape[0] < width:
        x = torch.cat([x, x.new_zeros(width - x.shape[0], *x.shape[1:])])
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).movedim(0, dim)


def _gather_last_dim(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]]) -> torch.Tensor:
    if ps.tp_size == 1:
        return x
    return all_gather_uneven(x, _split_sizes(ps, x.shape[-1] * ps.tp_size, sizes), -1, ps.tp_group)


def _slice_last_dim(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]]) -> torch.Tensor:
    if ps.tp_size == 1:
        return x
    sizes = _split_sizes(ps, x.shape[-1], sizes)
    start = sum(sizes[: ps.tp_rank])
    return x[..., start:start + sizes[ps.tp_rank]].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps):
        ctx.ps = ps
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.ps.tp_group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps):
        return all_reduce(x.clone(), ps.tp_group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, sizes):
        ctx.ps, ctx.sizes = ps, sizes
        return _slice_last_dim(x, ps, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.ps, ctx.sizes), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, sizes):
        ctx.ps, ctx.sizes = ps, sizes
        return _gather_last_dim(x, ps, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _slice_last_dim(grad, ctx.ps, ctx.sizes), None, None


def copy_to_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``f``: identity forward; all-reduce of the gradient over TP in backward."""
    return x if ps.tp_size == 1 else _CopyToTP.apply(x, ps)


def reduce_from_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``g``: all-reduce (sum) over TP in forward; identity backward."""
    return x if ps.tp_size == 1 else _ReduceFromTP.apply(x, ps)


def scatter_to_tp(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim (no forward communication); all-gather in backward."""
    return x if ps.tp_size == 1 else _ScatterToTP.apply(x, ps, None if sizes is None else tuple(sizes))


def gather_from_tp(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """All-gather slices of the last dim in forward (``sizes`` when uneven); slice in backward."""
    return x if ps.tp_size == 1 else _GatherFromTP.apply(x, ps, None if sizes is None else tuple(sizes))
