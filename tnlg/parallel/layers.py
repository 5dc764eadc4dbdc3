"""Tensor-parallel layers (Megatron paper, section 3): column, row and vocab parallel.

Every split parameter carries four attributes that say how it maps to the full,
unsplit tensor, so initialisation, checkpoints and resharding share one
definition (:func:`shard_of`, :func:`full_shape`):

* ``tp_sharded``: ``True`` when split over the TP group (``False`` = replicated);
* ``partition_dim``: the split dimension;
* ``partition_sizes``: every rank's size along it (may be uneven, or padded);
* ``full_size``: the real (unpadded) size of that dimension.

Splits may be uneven (attention heads that TP does not divide): the sizes come
from :func:`tnlg.config.partition_sizes`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from .state import ParallelState

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "mark_replicated", "mark_sharded", "shard_of", "full_shape"]


def mark_replicated(param: nn.Parameter) -> nn.Parameter:
    param.tp_sharded = False
    return param


def mark_sharded(param: nn.Parameter, dim: int, sizes: Sequence[int], full_size: int) -> nn.Parameter:
    param.tp_sharded = True
    param.partition_dim = dim
    param.partition_sizes = tuple(sizes)
    param.full_size = full_size
    return param


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the full (unsplit, unpadded) tensor this parameter is a shard of."""
    shape = list(param.shape)
    if getattr(param, "tp_sharded", False):
        shape[param.partition_dim] = param.full_size
    return tuple(shape)


def shard_of(full: torch.Tensor, param: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This rank's shard of a full tensor: slice along ``partition_dim``, zero-padding if needed."""
    if not getattr(param, "tp_sharded", False):
        return full
    dim, sizes = param.partition_dim, param.partition_sizes
    start = sum(sizes[:tp_rank])
    stop = start + sizes[tp_rank]
    padded_total = sum(sizes)
    if full.shape[dim] < padded_total:  # padded rows (vocabulary): zeros beyond full_size
        pad_shape = list(full.shape)
        pad_shape[dim] = padded_total - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.narrow(dim, start, stop - start)


def _even_sizes(n: int, tp: int, what: str) -> list[int]:
    if n % tp:
        raise ValueError(f"{what}={n} does not divide by tensor-parallel size {tp}; pass partition_sizes.")
    return [n // tp] * tp


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by rows (output features) over TP: ``Y_i = X A_i^T + b_i``.

    Forward: ``f`` (identity) on the input, local matmul; with ``gather_output``
    an all-gather of the outputs along the last dim. Backward: all-reduce of the
    input gradient over TP (from ``f``); the gather's backward is a local slice.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = True,
                 gather_output: bool = False, partition_sizes: Optional[Sequence[int]] = None,
                 device=None, dtype=None):
        super().__init__()
        self.ps = ps
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.partition_sizes = tuple(partition_sizes or _even_sizes(out_features, ps.tp_size, "out_features"))
        if sum(self.partition_sizes) != out_features or len(self.partition_sizes) != ps.tp_size:
            raise ValueError(f"partition_sizes {self.partition_sizes} must have {ps.tp_size} entries "
                             f"summing to out_features={out_features}.")
        self.output_size_per_partition = self.partition_sizes[ps.tp_rank]
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.output_size_per_partition, in_features, **kw)),
                                   0, self.partition_sizes, out_features)
        self.bias = (mark_sharded(nn.Parameter(torch.zeros(self.output_size_per_partition, **kw)),
                                  0, self.partition_sizes, out_features) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size > 1 and torch.is_autocast_enabled(x.device.type):
            # cast before f: its backward all-reduce then moves autocast-dtype (bf16) gradients, half the bytes
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = F.linear(copy_to_tp(x, self.ps), self.weight, self.bias)
        return gather_from_tp(y, self.ps, self.partition_sizes) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (this rank {self.output_size_per_partition}), "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by columns (input features): ``Y = sum_i X_i A_i^T + b``.

    Forward: (scatter of the input along the last dim unless ``input_is_parallel``),
    local matmul, ``g`` = all-reduce over TP, then the replicated bias. Backward:
    identity through ``g``; all-gather of the input gradient if it was scattered.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = True,
                 input_is_parallel: bool = True, partition_sizes: Optional[Sequence[int]] = None,
                 device=None, dtype=None):
        super().__init__()
        self.ps = ps
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.partition_sizes = tuple(partition_sizes or _even_sizes(in_features, ps.tp_size, "in_features"))
        if sum(self.partition_sizes) != in_features or len(self.partition_sizes) != ps.tp_size:
            raise ValueError(f"partition_sizes {self.partition_sizes} must have {ps.tp_size} entries "
                             f"summing to in_features={in_features}.")
        self.input_size_per_partition = self.partition_sizes[ps.tp_rank]
        kw = dict(device=device, dtype=dtype)
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, self.input_size_per_partition, **kw)),
                                   1, self.partition_sizes, in_features)
        self.bias = mark_replicated(nn.Parameter(torch.zeros(out_features, **kw))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.ps, self.partition_sizes)
        y = reduce_from_tp(F.linear(x, self.weight), self.ps)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (this rank {self.input_size_per_partition}), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows over TP; the vocabulary is padded to ``padded_size``.

    Forward: each rank looks up the ids in its row range (others give zeros), then
    ``g`` = all-reduce over TP. Backward: identity through ``g``; each rank's
    weight gradient touches only its rows. Padded rows are zeros and never looked
    up by valid ids.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ps: ParallelState, padded_size: int,
                 device=None, dtype=None):
        super().__init__()
        if padded_size < num_embeddings or padded_size % ps.tp_size:
            raise ValueError(f"padded vocabulary {padded_size} must be >= {num_embeddings} and divisible "
                             f"by tensor-parallel size {ps.tp_size}.")
        self.ps = ps
        self.num_embeddings, self.embedding_dim, self.padded_size = num_embeddings, embedding_dim, padded_size
        self.per_partition = padded_size // ps.tp_size
        self.vocab_start = ps.tp_rank * self.per_partition
        self.vocab_end = self.vocab_start + self.per_partition
        self.weight = mark_sharded(
            nn.Parameter(torch.empty(self.per_partition, embedding_dim, device=device, dtype=dtype)),
            0, [self.per_partition] * ps.tp_size, num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.ps)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (padded {self.padded_size}; this rank rows "
                f"[{self.vocab_start}, {self.vocab_end})), dim={self.embedding_dim}")
