"""Expert parallelism's communication: tokens to the ranks that hold their experts and back, by all-to-all.

The experts of a mixture-of-experts layer are split over the EP ranks of the expert-parallel group (carved
from DP x CP, :func:`tnlg.parallel.state.init_expert_parallel`): EP rank ``r`` holds experts
``[r E / EP, (r + 1) E / EP)``. Every EP rank routes its own tokens (different samples), so a step of the
layer is megatron-core's all-to-all dispatcher (``MoEAlltoAllTokenDispatcher``):

1. the tokens, sorted by expert, and each expert's count (:func:`dispatch`): one all-to-all of the counts
   (``[E]`` per rank: rank ``r`` learns how many tokens every rank sends each of its experts), then one
   all-to-all of the tokens with uneven split sizes (gloo's and NCCL's ``all_to_all_single`` take them);
2. the received tokens arrive grouped by source rank, then expert; they are regrouped by local expert
   (:func:`regroup`), run through the local experts, and put back in the arrival order;
3. the reverse all-to-all (:func:`combine`) returns each token's outputs to the rank it came from.

Backward of an all-to-all is the all-to-all with the split sizes swapped (:class:`_AllToAll`).

**The gradient of an expert's parameters.** An expert's weights see the tokens of every EP rank, so their
local gradient is the sum of the EP ranks' loss gradients, where a dense parameter's is this rank's own.
The engine then averages over the expert-data-parallel ranks (DP x CP / EP of them). :func:`scale_grad`
divides the experts' gradient by EP on the way (identity forward), so what the engine averages is the mean
over DP x CP, as for a dense parameter (megatron-core scales expert gradients by ``1 / (DP x CP)`` and sums
over expert-DP: the same numbers).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "dispatch", "exchange_counts", "combine", "regroup", "scale_grad"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Rows ``x`` (``in_splits[r]`` of them for rank ``r``, in rank order) sent; ``out_splits[r]`` rows
    received from rank ``r``. Differentiable (backward: the reverse all-to-all); identity without a group."""
    if group is None:
        return x
    return _AllToAll.apply(x, tuple(int(n) for n in out_splits), tuple(int(n) for n in in_splits), group)


def dispatch(x: torch.Tensor, counts: torch.Tensor, ep: int, group: Optional[dist.ProcessGroup]):
    """Send the rows of ``x`` (sorted by global expert; ``counts``: ``[E]`` rows per expert) to the EP ranks
    that hold their experts. Returns ``(received rows, received counts [EP, E / EP])``: row block ``[s, e]``
    came from EP rank ``s`` for local expert ``e``. Collectives: one all-to-all of the counts, one of the rows."""
    if group is None:
        return x, counts.view(1, -1)
    local = counts.numel() // ep
    received = exchange_counts(counts, ep, group)
    in_splits = counts.view(ep, local).sum(1).tolist()
    out_splits = received.sum(1).tolist()
    return all_to_all(x, out_splits, in_splits, group), received


def exchange_counts(counts: torch.Tensor, ep: int, group: dist.ProcessGroup) -> torch.Tensor:
    """What every EP rank sends each of this rank's experts, ``[EP, E / EP]``, from each rank's ``counts [E]``
    (one all-to-all). The fake-tensor simulation, whose process group moves no data, replaces it with even
    routing's counts (:func:`tnlg.training.simulate.even_routing`)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, counts.numel() // ep)


def combine(y: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, ep: int,
            group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The reverse of :func:`dispatch`: the outputs of the received rows back to their ranks, in the order
    this rank sent them."""
    if group is None:
        return y
    local = counts.numel() // ep
    return all_to_all(y, counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist(), group)


def regroup(received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows that arrived grouped ``[source rank, local expert]`` (``received``: their counts
    ``[EP, E_local]``): the permutation that groups them by local expert (source ranks in order within an
    expert; megatron-core's ``sort_chunks_by_idxs``) and the count per local expert."""
    ep, local = received.shape
    counts = received.reshape(-1).tolist()
    starts = [0]
    for n in counts[:-1]:
        starts.append(starts[-1] + n)
    order = [torch.arange(starts[s * local + e], starts[s * local + e] + counts[s * local + e])
             for e in range(local) for s in range(ep)]
    perm = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    return perm.to(received.device), received.sum(0)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` unchanged; its gradient times ``factor`` (the expert weights' ``1 / EP``, module docstring)."""
    return x if factor == 1.0 else _ScaleGrad.apply(x, factor)
