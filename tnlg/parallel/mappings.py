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

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): between the TP
regions activations are split along the sequence over the TP group, rank ``r``
holding ``sizes[r]`` consecutive positions (:func:`sequence_sizes`; uneven when TP
does not divide the length). Sequence-parallel tensors are sequence-first,
``[seq, batch, hidden]`` (Megatron's layout; ``dim`` defaults to 0): a rank's
positions are then one contiguous block of memory, so the collectives work on the
tensors themselves instead of on transposed copies. Three more operators move
between the split and the full sequence:

=========================================  ============================  ============================
operator (Megatron's name)                 forward                       backward
=========================================  ============================  ============================
``gather_from_sequence_parallel``          all-gather along the seq dim  reduce-scatter along seq
(``gather_from_sequence_parallel_region``,
the paper's ``g``-bar before a column region)
``reduce_scatter_to_sequence_parallel``    reduce-scatter along seq      all-gather along seq
(``reduce_scatter_to_sequence_parallel_``
``region``, ``g`` after a row region)
``scatter_to_sequence_parallel``           keep this rank's positions    all-gather along seq
=========================================  ============================  ============================

An all-reduce is a reduce-scatter followed by an all-gather, so a sequence-parallel
block moves the same bytes as a plain TP block while LayerNorm, dropout and the
residual adds run on ``1/t`` of the sequence.

Slices along the last dimension may be uneven (``sizes`` gives every rank's
width), which the uneven attention-head partition needs. With ``tp_size == 1``
every operator is the identity and no collective runs.

Also here: :func:`all_gather_flat` / :func:`reduce_scatter_flat`, the flat
collectives ZeRO uses, picking ``all_gather_single``/``reduce_scatter_single``
where the installed torch has them and the ``*_tensor`` names otherwise.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, cast

import torch
import torch.distributed as dist

from ..config import partition_sizes
from .state import ParallelState

__all__ = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
           "all_gather_flat", "reduce_scatter_flat", "all_reduce", "all_gather_uneven",
           "SEQ_DIM", "sequence_sizes", "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel",
           "scatter_to_sequence_parallel", "sequence_all_gather", "sequence_reduce_scatter",
           "copy_to_tp_coalesced", "gather_sequence_replicated"]

SEQ_DIM = 0  # sequence-parallel activations are [seq, batch, hidden]


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


class _SplitLastDim(torch.autograd.Function):
    """Between the full last dim and this rank's slice of it (``sizes`` when uneven).

    ``gather=False`` (``scatter_to_tp``): forward keeps this rank's slice, backward all-gathers
    the gradient. ``gather=True`` (``gather_from_tp``): forward all-gathers, backward keeps the
    slice of the gradient."""

    @staticmethod
    def forward(ctx, x, ps, sizes, gather):
        ctx.ps, ctx.sizes, ctx.gather = ps, sizes, gather
        return (_gather_last_dim if gather else _slice_last_dim)(x, ps, sizes)

    @staticmethod
    def backward(ctx, grad):
        return (_slice_last_dim if ctx.gather else _gather_last_dim)(grad, ctx.ps, ctx.sizes), None, None, None


def copy_to_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``f``: identity forward; all-reduce of the gradient over TP in backward."""
    return x if ps.tp_size == 1 else _CopyToTP.apply(x, ps)


def reduce_from_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``g``: all-reduce (sum) over TP in forward; identity backward."""
    return x if ps.tp_size == 1 else _ReduceFromTP.apply(x, ps)


def scatter_to_tp(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim (no forward communication); all-gather in backward."""
    return x if ps.tp_size == 1 else _SplitLastDim.apply(x, ps, None if sizes is None else tuple(sizes), False)


def gather_from_tp(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """All-gather slices of the last dim in forward (``sizes`` when uneven); slice in backward."""
    return x if ps.tp_size == 1 else _SplitLastDim.apply(x, ps, None if sizes is None else tuple(sizes), True)


# --------------------------------------------------------------------------- sequence parallelism
def sequence_sizes(seq_len: int, tp: int) -> tuple[int, ...]:
    """Positions each TP rank holds of a ``seq_len`` sequence: as even as possible, larger parts first
    (:func:`tnlg.config.partition_sizes`, the one split rule); rank ``r`` holds the contiguous positions
    ``[sum(sizes[:r]), sum(sizes[:r + 1]))``. Needs ``seq_len >= tp``."""
    if not 1 <= tp <= seq_len:
        raise ValueError(f"a sequence of {seq_len} positions cannot be split over {tp} tensor-parallel ranks: "
                         f"sequence parallelism gives every rank at least one position (needs seq_len >= tp).")
    return tuple(partition_sizes(seq_len, tp))


def _check_sizes(ps: ParallelState, sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(int(n) for n in sizes)
    if len(sizes) != ps.tp_size or min(sizes) < 1:
        raise ValueError(f"sequence sizes {sizes} must give each of the {ps.tp_size} tensor-parallel ranks "
                         f"at least one position (the sequence must be at least as long as the TP size).")
    return sizes


def _use_p2p(group) -> bool:
    """gloo: the all-gather as one broadcast per owner and the reduce-scatter as direct sends of every
    chunk to its owner (gloo's own all_gather / reduce_scatter, and its reduce, measured 2-4x slower
    for the same bytes, torch 2.13 on 2 CPUs); other backends (NCCL): the native collectives."""
    return dist.get_backend(group) == "gloo"


class _Pending:
    """A collective in flight: ``wait()`` waits for it and returns its result."""

    def __init__(self, works: list, result):
        self.works, self.result = works, result

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        return self.result()


def sequence_all_gather(x: torch.Tensor, ps: ParallelState, sizes: Sequence[int], dim: int = SEQ_DIM,
                        async_op: bool = False):
    """Concatenate every rank's sequence shard along ``dim`` (no autograd). Rank ``r``'s ``x`` has
    ``sizes[r]`` entries along ``dim``. One all-gather over TP (gloo: one broadcast per rank) of
    ``max(sizes)`` positions per rank (uneven shards are zero-padded for the collective). With
    ``async_op`` returns a handle whose ``wait()`` gives the result."""
    sizes = _check_sizes(ps, sizes)
    t, r, n = ps.tp_size, ps.tp_rank, max(sizes)
    front = x.movedim(dim, 0)
    if front.shape[0] != sizes[r]:
        raise ValueError(f"this rank's sequence shard has {front.shape[0]} positions along dim {dim}, "
                         f"expected {sizes[r]} (sizes {sizes}).")
    buf = front.new_empty((t * n,) + tuple(front.shape[1:]))
    buf[r * n:r * n + sizes[r]].copy_(front)
    if sizes[r] < n:
        buf[r * n + sizes[r]:(r + 1) * n].zero_()
    if _use_p2p(ps.tp_group):
        works = [dist.broadcast(buf[k * n:(k + 1) * n], src=dist.get_global_rank(cast(dist.ProcessGroup, ps.tp_group), k),
                                group=ps.tp_group, async_op=True) for k in range(t)]
    else:
        works = [all_gather_flat(buf, buf[r * n:(r + 1) * n].clone(), ps.tp_group, async_op=True)]

    def result() -> torch.Tensor:
        full = buf if min(sizes) == n else torch.cat([buf[k * n:k * n + m] for k, m in enumerate(sizes)])
        return full.movedim(0, dim)

    pending = _Pending(works, result)
    return pending if async_op else pending.wait()


def sequence_reduce_scatter(x: torch.Tensor, ps: ParallelState, sizes: Sequence[int], dim: int = SEQ_DIM,
                            async_op: bool = False, inplace: bool = False):
    """Sum ``x`` (full sequence along ``dim``) over TP and keep this rank's ``sizes[r]`` positions (no
    autograd). One reduce-scatter over TP (gloo: each rank sends every other rank its chunk and adds
    the ``t - 1`` chunks it receives) of ``max(sizes)`` positions per rank. ``x`` is not modified
    unless ``inplace`` (a temporary the caller no longer needs: the copy is saved). With ``async_op``
    returns a handle whose ``wait()`` gives the result."""
    sizes = _check_sizes(ps, sizes)
    t, r, n = ps.tp_size, ps.tp_rank, max(sizes)
    front = x.movedim(dim, 0)
    if front.shape[0] != sum(sizes):
        raise ValueError(f"the full sequence has {front.shape[0]} positions along dim {dim}, expected "
                         f"{sum(sizes)} (sizes {sizes}).")
    if min(sizes) == n:
        buf = front.contiguous()
        if buf.data_ptr() == x.data_ptr() and not inplace:
            buf = buf.clone()  # the collective works in place: not on the caller's tensor
    else:  # zero-pad every rank's chunk to n positions
        buf = front.new_zeros((t * n,) + tuple(front.shape[1:]))
        start = 0
        for k, m in enumerate(sizes):
            buf[k * n:k * n + m].copy_(front[start:start + m])
            start += m
    if _use_p2p(ps.tp_group):
        peers = [k for k in range(t) if k != r]
        recv = [buf.new_empty((n,) + tuple(buf.shape[1:])) for _ in peers]
        ops = []
        for k, into in zip(peers, recv):
            peer = dist.get_global_rank(cast(dist.ProcessGroup, ps.tp_group), k)
            ops.append(dist.P2POp(dist.isend, buf[k * n:(k + 1) * n], peer, group=ps.tp_group))
            ops.append(dist.P2POp(dist.irecv, into, peer, group=ps.tp_group))
        works = dist.batch_isend_irecv(ops)

        def result() -> torch.Tensor:
            out = torch.add(buf[r * n:r * n + sizes[r]], recv[0][:sizes[r]])  # a new tensor: buf is freed
            for more in recv[1:]:
                out.add_(more[:sizes[r]])
            return out.movedim(0, dim)
        pending = _Pending(works, result)
    else:
        shard = buf.new_empty((n,) + tuple(buf.shape[1:]))
        works = [reduce_scatter_flat(shard, buf, ps.tp_group, async_op=True)]
        pending = _Pending(works, lambda: shard[:sizes[r]].movedim(0, dim))
    return pending if async_op else pending.wait()


def _slice_sequence(x: torch.Tensor, ps: ParallelState, sizes: Sequence[int], dim: int) -> torch.Tensor:
    sizes = _check_sizes(ps, sizes)
    if x.shape[dim] != sum(sizes):
        raise ValueError(f"the full sequence has {x.shape[dim]} positions along dim {dim}, expected "
                         f"{sum(sizes)} (sizes {sizes}).")
    start = sum(sizes[:ps.tp_rank])
    return x.narrow(dim, start, sizes[ps.tp_rank])


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, sizes, dim):
        ctx.ps, ctx.sizes, ctx.dim = ps, sizes, dim
        return sequence_all_gather(x, ps, sizes, dim)

    @staticmethod
    def backward(ctx, grad):
        return sequence_reduce_scatter(grad, ctx.ps, ctx.sizes, ctx.dim), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, replicated, ps, sizes, dim, inplace):
        ctx.ps, ctx.sizes, ctx.dim = ps, sizes, dim
        ctx.x_dtype = x.dtype
        ctx.rep_shape = None if replicated is None else replicated.shape
        ctx.rep_dtype = None if replicated is None else replicated.dtype
        out = sequence_reduce_scatter(x, ps, sizes, dim, inplace=inplace)
        if replicated is not None:
            if replicated.dim() != x.dim() or replicated.shape[dim] != x.shape[dim]:
                raise ValueError(f"replicated tensor of shape {tuple(replicated.shape)} must span the sequence "
                                 f"(dim {dim}) of the input {tuple(x.shape)}.")
            return out + _slice_sequence(replicated, ps, sizes, dim)
        if out.untyped_storage().nbytes() > 1.5 * out.numel() * out.element_size():
            out = out.clone()  # a view of a whole-sequence buffer would keep all of it alive
        return out

    @staticmethod
    def backward(ctx, grad):
        # gathered in the input's dtype (bf16 under autocast: half the bytes of an fp32 residual gradient)
        full = sequence_all_gather(grad.to(ctx.x_dtype).contiguous(), ctx.ps, ctx.sizes, ctx.dim)
        g_rep = None
        if ctx.rep_shape is not None:  # every rank has the whole gradient: identical, nothing to all-reduce
            g_rep = full.sum_to_size(ctx.rep_shape).to(ctx.rep_dtype)
        return full, g_rep, None, None, None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, sizes, dim):
        ctx.ps, ctx.sizes, ctx.dim = ps, sizes, dim
        return _slice_sequence(x, ps, sizes, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return sequence_all_gather(grad.contiguous(), ctx.ps, ctx.sizes, ctx.dim), None, None, None


class _CopyToTPCoalesced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ps, *tensors):
        ctx.ps = ps
        ctx.meta = [(t.shape, t.dtype) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        dtype = functools.reduce(torch.promote_types, [m[1] for m in ctx.meta])  # all-reduced together
        device = next((g.device for g in grads if g is not None), None)
        flat = torch.cat([(g if g is not None else torch.zeros(shape, dtype=dtype, device=device)).reshape(-1)
                          .to(dtype) for g, (shape, _) in zip(grads, ctx.meta)])
        all_reduce(flat, ctx.ps.tp_group)
        out, start = [], 0
        for shape, dt in ctx.meta:
            n = math.prod(shape)
            out.append(flat[start:start + n].view(shape).to(dt))
            start += n
        return (None, *out)


def copy_to_tp_coalesced(tensors: Sequence[torch.Tensor], ps: ParallelState) -> tuple[torch.Tensor, ...]:
    """``f`` for several tensors at once: identity forward; in backward one all-reduce over TP of all
    their gradients together (concatenated), once every one of them has its gradient. For the
    replicated parameters a sequence-parallel block applies to its shard (LayerNorm weights and
    biases, row-parallel biases): one small all-reduce per block instead of one per tensor."""
    if ps.tp_size == 1:
        return tuple(tensors)
    return _CopyToTPCoalesced.apply(ps, *tensors)


def gather_from_sequence_parallel(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]] = None,
                                  dim: int = SEQ_DIM) -> torch.Tensor:
    """Sequence shard -> full sequence. Forward: all-gather along ``dim`` over TP; backward:
    reduce-scatter of the gradient along ``dim`` (each rank's full-sequence gradient is a partial sum).
    ``sizes``: every rank's positions (default: ``x``'s length on every rank)."""
    if ps.tp_size == 1:
        return x
    sizes = tuple(sizes) if sizes is not None else (x.shape[dim],) * ps.tp_size
    return _GatherFromSequence.apply(x, ps, sizes, dim)


class _GatherReplicatedSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ps, sizes, dim):
        ctx.ps, ctx.sizes, ctx.dim = ps, sizes, dim
        return sequence_all_gather(x.contiguous(), ps, sizes, dim)

    @staticmethod
    def backward(ctx, grad):
        return _slice_sequence(grad, ctx.ps, ctx.sizes, ctx.dim).contiguous(), None, None, None


def gather_sequence_replicated(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]] = None,
                               dim: int = SEQ_DIM) -> torch.Tensor:
    """Sequence shard -> full sequence, for a tensor every TP rank then uses alike (a router's logits): the
    gathered tensor's gradient is the same on every rank, so backward keeps this rank's positions of it (no
    communication), where :func:`gather_from_sequence_parallel` sums partial gradients. Forward: all-gather
    along ``dim`` over TP."""
    if ps.tp_size == 1:
        return x
    sizes = tuple(sizes) if sizes is not None else (x.shape[dim],) * ps.tp_size
    return _GatherReplicatedSequence.apply(x, ps, sizes, dim)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, ps: ParallelState,
                                        sizes: Optional[Sequence[int]] = None, dim: int = SEQ_DIM,
                                        replicated: Optional[torch.Tensor] = None,
                                        inplace: bool = False) -> torch.Tensor:
    """Partial sums over the full sequence -> this rank's shard of their sum. Forward:
    reduce-scatter along ``dim`` over TP; backward: all-gather of the gradient along ``dim``.

    ``replicated`` (optional; the same value on every TP rank, spanning the sequence along ``dim``
    and broadcastable to ``x`` along the others) has this rank's positions added once to the result
    (not summed ``t`` times) and gets the all-gathered gradient summed to its shape: the gradient
    over the whole sequence, identical on every rank, so a replicated parameter behind it (the
    position embedding) needs no further all-reduce. The all-gather runs in ``x``'s dtype. Default
    ``sizes``: :func:`sequence_sizes` of ``x``'s length. ``inplace``: ``x`` is a temporary nothing
    else uses (no autograd node saved it), so the collective may work in its memory."""
    if ps.tp_size == 1:
        return x if replicated is None else x + replicated
    sizes = tuple(sizes) if sizes is not None else sequence_sizes(x.shape[dim], ps.tp_size)
    return _ReduceScatterToSequence.apply(x, replicated, ps, sizes, dim, inplace)


def scatter_to_sequence_parallel(x: torch.Tensor, ps: ParallelState, sizes: Optional[Sequence[int]] = None,
                                 dim: int = SEQ_DIM) -> torch.Tensor:
    """Full sequence (the same on every TP rank) -> this rank's positions. Forward: a slice, no
    communication; backward: all-gather of the gradient along ``dim``."""
    if ps.tp_size == 1:
        return x
    sizes = tuple(sizes) if sizes is not None else sequence_sizes(x.shape[dim], ps.tp_size)
    return _ScatterToSequence.apply(x, ps, sizes, dim)
