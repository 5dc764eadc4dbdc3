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

A key/value group that several TP ranks hold (grouped-query attention at TP > G, :mod:`tnlg.parallel.layers`)
has the same summed gradient on each of them: its rows count once, on the lowest TP rank holding them
(:func:`tnlg.parallel.sharding.counted_rows`).

With pipeline stages (PP > 1) each stage's total is then summed over the pipeline group;
the last stage's copy of the tied word embedding is left out by the backend (the first
stage's is counted), so every parameter counts once.

``norm = sqrt(sharded + replicated)``. With sequence parallelism the replicated
parameters used on a sequence shard (LayerNorms, row-parallel biases, the position
embedding) would get only this rank's share of their gradient; the model sums them
over TP inside backward (:mod:`tnlg.model`: a coalesced ``f`` per block, the
embedding's all-gather), so here too they hold the same full gradient on every TP
rank and are counted once. Precision: each piece's sum of squares is
accumulated in its own precision promoted to at least fp32 (``torch._foreach_norm``,
a few fused kernels on a GPU), the pieces are added in fp64, and the all-reduces
run in fp64. Everything stays on the device until :func:`global_norm` reads the one
result (one host synchronisation per step, not one per parameter). Clipping multiplies
every gradient by ``min(1, max_norm / (norm + 1e-6))`` (Megatron, and
``torch.nn.utils.clip_grad_norm_``).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from torch._subclasses.fake_tensor import is_fake

from ..parallel.sharding import uncounted_elements
from ..parallel.state import ParallelState

__all__ = ["squared_sums", "global_norm", "global_norm_and", "norm_and", "global_sum_of_squares", "summed_sum_of_squares",
           "clip_coefficient", "clip_grad_norm_", "SIMULATED_NORM"]

# What global_norm reports for fake tensors (no values): a large finite norm, so that a simulated
# step takes the costliest path (clipping and the update both run).
SIMULATED_NORM = 1.0e6


def squared_sums(pieces: Iterable[tuple[torch.Tensor, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ``(sum of squares of tp_sharded pieces, of replicated pieces)`` as 0-dim fp64 tensors.

    ``pieces`` yields ``(tensor, tp_sharded)``; each tensor is summed once. Nothing is
    read back to the host: the sums stay on the pieces' device (pass them to
    :func:`global_norm`). Each piece is reduced in fp32 (fp64 pieces in fp64) reading it in
    its own dtype, the per-piece results are added in fp64.
    """
    groups: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    device = None
    for t, sharded in pieces:
        if t.numel():
            groups[0 if sharded else 1].append(t.detach().reshape(-1))
            device = device or t.device
    return _sum_of_squares(groups[0], device), _sum_of_squares(groups[1], device)


def _acc_dtype(device: Optional[torch.device]) -> torch.dtype:
    return torch.float32 if device is not None and device.type == "mps" else torch.float64  # MPS has no fp64


_CHUNK = 1 << 12  # elements per fp32 partial sum of a 16-bit piece (see _sum_of_squares)


def _sum_of_squares(flats: list[torch.Tensor], device: Optional[torch.device]) -> torch.Tensor:
    """``sum_i ||flats[i]||^2`` on the device, added up in fp64 (fp32 on MPS), no host synchronisation.

    fp32 (and fp64) pieces are reduced with ``torch.dot`` (BLAS's blocked accumulation: the norm
    agrees across TP sizes within 1e-6, where a running fp32 sum drifted by 1e-5 on CPU for
    pieces of 10^5 elements). A 16-bit piece is never copied to a wider dtype: it is read once
    by ``torch.linalg.vector_norm(..., dtype=float32)`` over rows of 4096 elements (each row
    accumulated in fp32 in registers; a GPU reads 2 bytes per element and writes one fp32 per
    row), and the row norms are combined with ``torch.dot``. A single running fp32 sum over a
    whole piece would drift by 3e-5 at 10^6 elements on CPU; by rows it stays within 1e-6."""
    acc = _acc_dtype(device)
    total = torch.zeros((), dtype=acc, device=device)
    for f in flats:
        sq = torch.dot(f, f) if f.dtype in (torch.float32, torch.float64) else _sq_16bit(f)
        if f.device != total.device:  # pieces on several devices (unusual): add them up on the first one
            sq = sq.to(total.device)
        total = total + sq.to(acc)
    return total


def _sq_16bit(f: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a 1-D 16-bit tensor as an fp32 scalar, by rows of ``_CHUNK`` (fp32 only)."""
    whole = f.numel() // _CHUNK * _CHUNK
    parts = []
    if whole:
        rows = torch.linalg.vector_norm(f[:whole].view(-1, _CHUNK), dim=1, dtype=torch.float32)
        parts.append(torch.dot(rows, rows))
    if whole < f.numel():
        parts.append(torch.linalg.vector_norm(f[whole:], dtype=torch.float32).square())
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _as_device_scalar(x: Union[float, torch.Tensor], device: torch.device) -> torch.Tensor:
    """``x`` as a 0-dim tensor on ``device``; a Python float is filled in place (no host-to-device copy)."""
    dtype = _acc_dtype(device)
    if isinstance(x, torch.Tensor):
        if x.device.type == device.type and (device.index is None or x.device.index == device.index):
            return x.to(dtype).reshape(())
        if x.device.type != "cpu":
            return x.to(device=device, dtype=dtype).reshape(())
        x = float(x)  # a CPU tensor: reading it is not a device synchronisation
    return torch.full((), float(x), dtype=dtype, device=device)


def global_norm(sharded_sq: Union[float, torch.Tensor], replicated_sq: Union[float, torch.Tensor],
                ps: ParallelState, over_dp: bool, device: Optional[torch.device] = None) -> float:
    """The full-model L2 norm from this rank's squared sums (floats or 0-dim tensors, e.g. from
    :func:`squared_sums`).

    Collectives: an all-reduce of 2 fp64 numbers over DP when ``over_dp``
    (gradients partitioned over DP), then of 1 over TP, then (PP > 1) of 1 over the pipeline
    group (each stage's parameters counted once). Every rank gets the same value.
    The only host synchronisation is reading the result at the end.
    """
    return global_norm_and(sharded_sq, replicated_sq, ps, over_dp, None, device)[0]


def global_sum_of_squares(sharded_sq: Union[float, torch.Tensor], replicated_sq: Union[float, torch.Tensor],
                          ps: ParallelState, over_dp: bool, device: Optional[torch.device] = None,
                          over_pp: bool = True) -> torch.Tensor:
    """The whole model's sum of squares (a 0-dim fp64 tensor on the device, not read) from this rank's squared
    sums: :func:`global_norm`'s collectives, without the square root and the host read. ``over_pp=False``: this
    pipeline stage's only (the caller adds more before summing over the stages)."""
    device = torch.device(device or ps.device)
    sums = torch.stack([_as_device_scalar(sharded_sq, device), _as_device_scalar(replicated_sq, device)])
    if over_dp and ps.dp_size > 1:
        dist.all_reduce(sums, group=ps.dp_group)
    if ps.tp_size > 1:
        sharded = sums[:1].clone()
        dist.all_reduce(sharded, group=ps.tp_group)
        sums[0] = sharded[0]
    total = sums.sum()
    if over_pp and ps.pp_size > 1:  # each pipeline stage holds different parameters
        dist.all_reduce(total, group=ps.pp_group)
    return total


def global_norm_and(sharded_sq: Union[float, torch.Tensor], replicated_sq: Union[float, torch.Tensor],
                    ps: ParallelState, over_dp: bool, also: Optional[torch.Tensor],
                    device: Optional[torch.device] = None) -> tuple[float, Optional[float]]:
    """:func:`global_norm`, and the value of the 0-dim (or one-element) tensor ``also`` read in the
    same host synchronisation (the step's loss: one device -> host read per iteration)."""
    return norm_and(global_sum_of_squares(sharded_sq, replicated_sq, ps, over_dp, device), also)


def norm_and(total: torch.Tensor, also: Optional[torch.Tensor]) -> tuple[float, Optional[float]]:
    """The norm of the whole model's sum of squares ``total`` (a 0-dim tensor on the device) and the value of the
    0-dim (or one-element) tensor ``also``, read in one host synchronisation (the step's one device -> host read)."""
    if is_fake(total):  # a fake-tensor simulation (tnlg.training.simulate) has no values to read
        return SIMULATED_NORM, None if also is None else 0.0
    if also is None:
        values = [total.item()]
    else:
        values = torch.stack([total, also.detach().reshape(()).to(total)]).tolist()
    norm = math.sqrt(values[0]) if values[0] >= 0 else float("nan")
    return norm, None if also is None else values[1]


def summed_sum_of_squares(pieces: Iterable[tuple[torch.Tensor, bool]], device: torch.device,
                          groups: Iterable[Optional[dist.ProcessGroup]]) -> torch.Tensor:
    """The sum of squares of gradient ``pieces`` (as :func:`squared_sums` takes them) all-reduced over each of
    ``groups`` (``None`` skipped): the experts' part of the norm, over the ranks that split them. A 0-dim tensor."""
    sh, rep = squared_sums(pieces)
    total = (_as_device_scalar(sh, device) + _as_device_scalar(rep, device)).reshape(1)
    for g in groups:
        if g is not None:
            dist.all_reduce(total, group=g)
    return total[0]


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
    pairs = [(p, p.grad) for p in parameters if p.grad is not None]
    params, grads = [p for p, _ in pairs], [_local(g) for _, g in pairs if g is not None]
    # a shared key/value group (rows several TP ranks hold) counts once, on the lowest rank holding it
    counted = [g.reshape(-1)[uncounted_elements(p, ps.tp_rank):] for g, p in zip(grads, params)]
    sh, rep = squared_sums((g, bool(getattr(p, "tp_sharded", False))) for g, p in zip(counted, params))
    norm = global_norm(sh, rep, ps, over_dp=grads_sharded_over_dp)
    coeff = clip_coefficient(norm, max_norm)
    if coeff < 1.0:
        for g in grads:
            g.mul_(coeff)
    return norm


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no communication), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t
