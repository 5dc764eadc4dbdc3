"""Tensor-parallel layers (Megatron paper, section 3): column, row and vocab parallel.

Every parameter is marked with how it maps to the full, unsplit tensor
(:mod:`tnlg.parallel.sharding`), so initialisation, checkpoints and resharding share
one definition; ``describe(...)`` gives a layer's :class:`~tnlg.parallel.sharding.ShardSpec`
per parameter without building it.

Each layer initialises itself TP-invariantly (:mod:`tnlg.parallel.initialization`): the
weight from ``init_method`` (default ``N(0, 0.02^2)``, GPT-2's), drawn in full from a
generator seeded by ``(seed, init_key + ".weight")`` and sliced; biases are zeros. A model
passes each layer's name as ``init_key``, so the layer used alone and inside the model
agree.

Splits may be uneven (attention heads that TP does not divide): the sizes come
from :func:`tnlg.config.partition_sizes`.

Sequence parallelism (``sequence_parallel=True``, Korthikanti et al. 2022): the
column-parallel input and the row-parallel output are split along the sequence over
TP instead of replicated. Sequence-parallel tensors are sequence-first, ``[s, b, h]``
(Megatron's layout, :mod:`tnlg.parallel.mappings`); ``forward`` takes
``sequence_sizes`` (every rank's positions; default: an even split) and
``sequence_parallel=`` to override the layer's setting for one call (the model turns
it off for incremental decoding).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mappings import (copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence_parallel,
                       scatter_to_tp, sequence_all_gather, sequence_reduce_scatter)
from .initialization import InitMethod, SelfInitializing, init_normal, init_zeros
from .sharding import ShardSpec
from .state import ParallelState

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "column_parallel_linear",
           "SharedInput", "local_linear", "GatedColumnParallelLinear", "KVGroupParallelLinear", "swiglu",
           "sum_over_holders"]

DEFAULT_INIT = init_normal(0.02)


def _split_sizes(n: int, sizes: Optional[Sequence[int]], tp: int, what: str) -> tuple[int, ...]:
    """Every rank's share of ``n`` (``what`` names it): ``sizes`` checked, or an even split."""
    if not sizes:  # None or empty: an even split
        if n % tp:
            raise ValueError(f"{what}={n} does not divide by tensor-parallel size {tp}; pass partition_sizes.")
        return (n // tp,) * tp
    sizes = tuple(sizes)
    if sum(sizes) != n or len(sizes) != tp:
        raise ValueError(f"partition_sizes {sizes} must have {tp} entries summing to {what}={n}.")
    return sizes


def _build(module: SelfInitializing, specs: Mapping[str, Optional[ShardSpec]], ps: ParallelState, init_method: InitMethod,
           seed: int, init_key: str, device, dtype) -> None:
    """Create ``module``'s parameters from their specs (``None``: absent, e.g. no bias), marked, and
    initialise them: ``init_method`` for the weight, zeros for the bias."""
    for name, spec in specs.items():
        setattr(module, name, None if spec is None else spec.parameter(ps.tp_rank, device, dtype))
    inits = {"weight": init_method, "bias": init_zeros}
    module.set_init({n: inits[n] for n, spec in specs.items() if spec is not None}, seed, init_key)


def _even_sequence(x: torch.Tensor, tp: int) -> tuple[int, ...]:
    return (x.shape[0],) * tp


class _LinearWithSequenceGather(torch.autograd.Function):
    """``all_gather_seq(x) @ W^T + b`` keeping only the sequence shard ``x`` for backward (Korthikanti
    et al. 2022, section 4.2.2: the gathered input is not stored; backward gathers it again).

    Forward: one all-gather of ``x`` along the sequence. Backward: the all-gather again (launched
    first, overlapping the input-gradient matmul) and a reduce-scatter of the input gradient along
    the sequence (overlapping the weight-gradient matmul). Runs in the dtype of its inputs (the
    caller casts for autocast)."""

    @staticmethod
    def forward(ctx, x, weight, bias, ps, sizes):
        ctx.ps, ctx.sizes, ctx.has_bias = ps, sizes, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(sequence_all_gather(x, ps, sizes), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ps, sizes = ctx.ps, ctx.sizes
        gathering = sequence_all_gather(x, ps, sizes, async_op=True)
        grad_full = grad.matmul(weight)                                     # [s, b, in]
        total = gathering.wait()
        scattering = sequence_reduce_scatter(grad_full, ps, sizes, async_op=True, inplace=True)
        del grad_full
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return scattering.wait(), grad_w, grad_b, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           ps: ParallelState, sequence_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``X W_i^T + b_i`` for this rank's rows ``W_i`` of a column-parallel weight.

    ``sequence_sizes is None``: ``x`` is the full input, replicated over TP; forward ``f``
    (identity), backward all-reduce of the input gradient. Otherwise ``x`` is this rank's sequence
    shard (``sequence_sizes[r]`` positions, sequence-first ``[s_r, b, in]``; the output is
    ``[s, b, out_r]``): forward all-gather along the sequence,
    backward all-gather again + reduce-scatter of the input gradient (only the shard is stored).
    Under autocast the input is cast first, so the collectives move the autocast dtype."""
    autocast = torch.is_autocast_enabled(x.device.type)
    if ps.tp_size > 1 and autocast:
        # cast before f: its backward all-reduce then moves autocast-dtype (bf16) gradients, half the bytes
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if sequence_sizes is None or ps.tp_size == 1:
        return F.linear(copy_to_tp(x, ps), weight, bias)
    if autocast:  # run the fused function in the autocast dtype, as autocast would run F.linear
        dt = torch.get_autocast_dtype(x.device.type)
        weight = weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _LinearWithSequenceGather.apply(x, weight, bias, ps, tuple(sequence_sizes))


class SharedInput:
    """The input of a tensor-parallel region that several column-parallel layers read (grouped-query attention's
    queries and keys/values), passed through the region's communication ONCE, so each layer is still called
    (a wrapper on any of them, an adapter, is honoured) and the region costs one column layer's collectives.

    :meth:`of` gives it: without sequence parallelism ``tensor`` is ``f(x)`` (identity forward; backward one
    all-reduce of the summed input gradients); sequence-parallel, ``tensor`` is the all-gathered sequence
    ``[s, b, in]`` (one all-gather forward; backward one reduce-scatter of the summed input gradients, after
    the layers' weight gradients, which read the input gathered again ONCE for all of them: only this rank's
    shard is kept between forward and backward, Korthikanti et al. 2022, section 4.2.2). Under autocast the
    input is cast first, so the collectives move the autocast dtype. A layer given ``shared_input`` applies
    its local matmul only (:func:`local_linear`)."""

    def __init__(self, shard: torch.Tensor, ps: ParallelState, sizes: Optional[tuple[int, ...]]):
        self.ps, self.sizes = ps, sizes
        self._shard: Optional[torch.Tensor] = shard.detach() if sizes is not None else None
        self._gathered: Optional[torch.Tensor] = None  # (backward: the input gathered again, shared by the layers)
        self.tensor = shard

    @classmethod
    def of(cls, x: torch.Tensor, ps: ParallelState, sequence_sizes: Optional[Sequence[int]] = None) -> "SharedInput":
        if ps.tp_size > 1 and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # (cast before the collective: half the bytes)
        sizes = tuple(sequence_sizes) if sequence_sizes is not None and ps.tp_size > 1 else None
        shared = cls(x, ps, sizes)
        shared.tensor = copy_to_tp(x, ps) if sizes is None else _GatherShared.apply(x, shared)
        return shared

    def gathered_again(self) -> torch.Tensor:
        """Backward: the whole sequence of the input, gathered once for every layer that reads it."""
        if self._gathered is None:
            self._gathered = sequence_all_gather(cast(torch.Tensor, self._shard), self.ps, cast(tuple, self.sizes))
        return self._gathered

    def release(self) -> None:
        self._shard = self._gathered = None


class _GatherShared(torch.autograd.Function):
    """Sequence-parallel :class:`SharedInput`: all-gather forward; backward the reduce-scatter of the layers'
    summed input gradients (after every layer's backward has read the input gathered again)."""

    @staticmethod
    def forward(ctx, x, shared):
        ctx.shared = shared
        return sequence_all_gather(x, shared.ps, shared.sizes)

    @staticmethod
    def backward(ctx, grad):
        shared, ctx.shared = ctx.shared, None
        shared.release()
        return sequence_reduce_scatter(grad, shared.ps, shared.sizes), None


class _LinearOnGathered(torch.autograd.Function):
    """``x W^T + b`` of a sequence-parallel :class:`SharedInput`'s gathered ``x``, keeping only the weight for
    backward: the weight gradient reads the input gathered again (:meth:`SharedInput.gathered_again`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, shared):
        ctx.shared, ctx.has_bias = shared, bias is not None
        ctx.save_for_backward(weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        total = ctx.shared.gathered_again()
        grad = grad.contiguous()  # (a view of the heads' layout: one copy here, not one per matmul below)
        g2 = grad.view(-1, grad.shape[-1])
        grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad.matmul(weight), grad_w, grad_b, None


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], shared: SharedInput) -> torch.Tensor:
    """A column-parallel layer's local matmul on a :class:`SharedInput`'s ``tensor`` ``x`` (no communication of
    its own); sequence-parallel, without keeping the gathered input for backward."""
    if shared.sizes is None:
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):  # run the function in the autocast dtype, as F.linear would
        dt = torch.get_autocast_dtype(x.device.type)
        weight, bias = weight.to(dt), None if bias is None else bias.to(dt)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _LinearOnGathered.apply(x, weight, bias, shared)


class _ParallelLinear(SelfInitializing, nn.Module):
    """What column and row layers share: the features, every rank's share of the split one
    (``split_dim`` of the weight: 0 = output features, 1 = input features) and the parameters,
    built from ``describe`` and initialised."""

    split_dim: int
    weight: torch.Tensor  # (set by _build from the layer's description)
    bias: Optional[torch.Tensor]

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool,
                 partition_sizes: Optional[Sequence[int]], sequence_parallel: bool, device, dtype,
                 init_method: InitMethod, seed: int, init_key: str):
        super().__init__()
        self.ps = ps
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        split, what = (out_features, "out_features") if self.split_dim == 0 else (in_features, "in_features")
        self.partition_sizes = _split_sizes(split, partition_sizes, ps.tp_size, what)
        _build(self, self.describe(in_features, out_features, self.partition_sizes, bias), ps, init_method, seed,
               init_key, device, dtype)

    @staticmethod
    def describe(in_features: int, out_features: int, partition_sizes: Sequence[int],
                 bias: bool = True) -> dict[str, Optional[ShardSpec]]:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by rows (output features) over TP: ``Y_i = X A_i^T + b_i``.

    Forward: ``f`` (identity) on the input, local matmul; with ``gather_output``
    an all-gather of the outputs along the last dim. Backward: all-reduce of the
    input gradient over TP (from ``f``); the gather's backward is a local slice.

    With ``sequence_parallel``: the input is this rank's sequence shard ``[s_r, b, in]``
    (sequence-first) and the output covers the full sequence ``[s, b, out_r]``. Forward: all-gather of
    the input along the sequence (instead of ``f``). Backward: the all-gather again
    (only the shard is stored) and a reduce-scatter of the input gradient along the
    sequence (instead of the all-reduce).
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = True,
                 gather_output: bool = False, partition_sizes: Optional[Sequence[int]] = None,
                 sequence_parallel: bool = False, device=None, dtype=None, init_method: InitMethod = DEFAULT_INIT,
                 seed: int = 0, init_key: str = ""):
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True returns the full output on every rank, "
                             "which a sequence-parallel layer does not; gather the logits explicitly instead.")
        super().__init__(in_features, out_features, ps, bias, partition_sizes, sequence_parallel, device, dtype,
                         init_method, seed, init_key)
        self.gather_output = gather_output
        self.output_size_per_partition = self.partition_sizes[ps.tp_rank]

    @staticmethod
    def describe(in_features: int, out_features: int, partition_sizes: Sequence[int],
                 bias: bool = True) -> dict[str, Optional[ShardSpec]]:
        """How the weight (rows: output features) and the bias split over ``len(partition_sizes)`` ranks."""
        sizes = tuple(partition_sizes)
        return dict(weight=ShardSpec((out_features, in_features), 0, sizes),
                    bias=ShardSpec((out_features,), 0, sizes) if bias else None)

    def forward(self, x: torch.Tensor, sequence_parallel: Optional[bool] = None,
                sequence_sizes: Optional[Sequence[int]] = None, *,
                shared_input: Optional[SharedInput] = None) -> torch.Tensor:
        """``sequence_parallel``: override the layer's setting for this call; ``sequence_sizes``: every
        rank's positions when sequence-parallel (default: ``x``'s length on every rank); ``shared_input``:
        ``x`` is that :class:`SharedInput`'s tensor, already through the region's communication (the local
        matmul only)."""
        if shared_input is not None:
            return local_linear(x, self.weight, self.bias, shared_input)
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        if sp and self.ps.tp_size > 1:
            sizes = tuple(sequence_sizes) if sequence_sizes is not None else _even_sequence(x, self.ps.tp_size)
            if self.gather_output:
                raise ValueError("ColumnParallelLinear: gather_output=True cannot be sequence-parallel.")
            return column_parallel_linear(x, self.weight, self.bias, self.ps, sizes)
        y = column_parallel_linear(x, self.weight, self.bias, self.ps)
        return gather_from_tp(y, self.ps, self.partition_sizes) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (this rank {self.output_size_per_partition}), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by columns (input features): ``Y = sum_i X_i A_i^T + b``.

    Forward: (scatter of the input along the last dim unless ``input_is_parallel``),
    local matmul, ``g`` = all-reduce over TP, then the replicated bias. Backward:
    identity through ``g``; all-gather of the input gradient if it was scattered.

    With ``sequence_parallel``: the input is sequence-first ``[s, b, in_r]`` and the output this
    rank's sequence shard ``[s_r, b, out]``.
    Forward: reduce-scatter of the partial sums along the sequence (instead of ``g``),
    then the bias on the shard. Backward: all-gather of the output gradient along the
    sequence, and an all-reduce over TP of the bias's gradient (each rank summed only its
    own positions; ``f`` applied to the bias, or coalesced by the caller).
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, bias: bool = True,
                 input_is_parallel: bool = True, partition_sizes: Optional[Sequence[int]] = None,
                 sequence_parallel: bool = False, device=None, dtype=None, init_method: InitMethod = DEFAULT_INIT,
                 seed: int = 0, init_key: str = ""):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (the input "
                             "of a sequence-parallel row layer is the output of a column-parallel one).")
        self.input_is_parallel = input_is_parallel
        super().__init__(in_features, out_features, ps, bias, partition_sizes, sequence_parallel, device, dtype,
                         init_method, seed, init_key)
        self.input_size_per_partition = self.partition_sizes[ps.tp_rank]

    @staticmethod
    def describe(in_features: int, out_features: int, partition_sizes: Sequence[int],
                 bias: bool = True) -> dict[str, Optional[ShardSpec]]:
        """How the weight (columns: input features) splits over ``len(partition_sizes)`` ranks; the
        bias is replicated."""
        return dict(weight=ShardSpec((out_features, in_features), 1, tuple(partition_sizes)),
                    bias=ShardSpec((out_features,)) if bias else None)

    def forward(self, x: torch.Tensor, sequence_parallel: Optional[bool] = None,
                sequence_sizes: Optional[Sequence[int]] = None,
                synced_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sequence_parallel``: override the layer's setting for this call; ``sequence_sizes``: every
        rank's positions of the output when sequence-parallel (default: an even split of ``x``'s length);
        ``synced_bias``: sequence-parallel only, ``self.bias`` already passed through ``f``."""
        sp = (self.sequence_parallel if sequence_parallel is None else sequence_parallel) and self.ps.tp_size > 1
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.ps, self.partition_sizes)
        if not sp:
            y = reduce_from_tp(F.linear(x, self.weight), self.ps)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.ps, sequence_sizes, inplace=True)
        if self.bias is None:
            return y
        # the bias meets this rank's positions only: f sums its gradient over TP (``synced_bias``: the
        # caller already passed it through f, e.g. one coalesced f for a whole block)
        return y + (copy_to_tp(self.bias, self.ps) if synced_bias is None else synced_bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (this rank {self.input_size_per_partition}), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(SelfInitializing, nn.Module):
    """Embedding table split by vocabulary rows over TP; the vocabulary is padded to ``padded_size``.

    Forward: each rank looks up the ids in its row range (others give zeros), then
    ``g`` = all-reduce over TP. Backward: identity through ``g``; each rank's
    weight gradient touches only its rows. Padded rows are zeros and never looked
    up by valid ids.
    """

    weight: torch.Tensor  # (set by _build from the layer's description)

    def __init__(self, num_embeddings: int, embedding_dim: int, ps: ParallelState, padded_size: int,
                 device=None, dtype=None, init_method: InitMethod = DEFAULT_INIT, seed: int = 0, init_key: str = ""):
        super().__init__()
        if padded_size < num_embeddings or padded_size % ps.tp_size:
            raise ValueError(f"padded vocabulary {padded_size} must be >= {num_embeddings} and divisible "
                             f"by tensor-parallel size {ps.tp_size}.")
        self.ps = ps
        self.num_embeddings, self.embedding_dim, self.padded_size = num_embeddings, embedding_dim, padded_size
        self.per_partition = padded_size // ps.tp_size
        self.vocab_start = ps.tp_rank * self.per_partition
        self.vocab_end = self.vocab_start + self.per_partition
        _build(self, self.describe(num_embeddings, embedding_dim, padded_size, ps.tp_size), ps, init_method, seed,
               init_key, device, dtype)

    @staticmethod
    def describe(num_embeddings: int, embedding_dim: int, padded_size: int,
                 tp_size: int) -> dict[str, ShardSpec]:
        """How the table splits: equal row blocks of the padded vocabulary (the rows past
        ``num_embeddings`` are padding, zeros)."""
        return dict(weight=ShardSpec((num_embeddings, embedding_dim), 0, (padded_size // tp_size,) * tp_size))

    def local_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial embeddings (zeros for ids outside its rows); their sum over TP is the
        embedding. No communication (the sequence-parallel model reduce-scatters them)."""
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(self.local_lookup(ids), self.ps)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (padded {self.padded_size}; this rank rows "
                f"[{self.vocab_start}, {self.vocab_end})), dim={self.embedding_dim}")


class GatedColumnParallelLinear(ColumnParallelLinear):
    """SwiGLU's gate and up projections as ONE column-parallel matmul: ``silu(X G_i^T) * (X U_i^T)``.

    The weight's full shape is ``[2, out, in]`` (``[0]`` the gate, ``[1]`` the up projection), split along
    dim 1 over TP, so each rank's shard ``[2, out_r, in]`` is its gate rows followed by its up rows, paired
    (Megatron-core's per-rank ``linear_fc1`` layout ``[gate_r; up_r]``); the bias ``[2, out]`` likewise.
    The matmul runs on the shard viewed as ``[2 out_r, in]``. Communication: a column-parallel layer's
    (``f``: backward all-reduce of the input gradient; sequence-parallel: all-gather / reduce-scatter).
    """

    @staticmethod
    def describe(in_features: int, out_features: int, partition_sizes: Sequence[int],
                 bias: bool = True) -> dict[str, Optional[ShardSpec]]:
        sizes = tuple(partition_sizes)
        return dict(weight=ShardSpec((2, out_features, in_features), 1, sizes),
                    bias=ShardSpec((2, out_features), 1, sizes) if bias else None)

    def forward(self, x: torch.Tensor, sequence_parallel: Optional[bool] = None,
                sequence_sizes: Optional[Sequence[int]] = None, *,
                shared_input: Optional[SharedInput] = None) -> torch.Tensor:
        return swiglu(self.pre_activation(x, sequence_parallel, sequence_sizes, shared_input=shared_input))

    def pre_activation(self, x: torch.Tensor, sequence_parallel: Optional[bool] = None,
                       sequence_sizes: Optional[Sequence[int]] = None, *,
                       shared_input: Optional[SharedInput] = None) -> torch.Tensor:
        """The fused matmul's output ``[..., 2 out_r]`` (this rank's gate rows, then its up rows) before
        :func:`swiglu`: what a wrapper that adds to the projections (an adapter) adds to."""
        bias = None if self.bias is None else self.bias.flatten()
        if shared_input is not None:
            return local_linear(x, self.weight.flatten(0, 1), bias, shared_input)
        sp = (self.sequence_parallel if sequence_parallel is None else sequence_parallel) and self.ps.tp_size > 1
        sizes = None
        if sp:
            sizes = tuple(sequence_sizes) if sequence_sizes is not None else _even_sequence(x, self.ps.tp_size)
        return column_parallel_linear(x, self.weight.flatten(0, 1), bias, self.ps, sizes)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of the fused output ``y = [gate | up]`` (last dim), whose backward writes both
    halves' gradients straight into one ``[..., 2 f]`` tensor, the fused matmul's output gradient: no
    ``cat`` of the two halves' gradients (autograd's ``chunk`` backward), and one kernel fewer. Keeps what
    autograd would (``y`` and ``silu(gate)``: ``3 f`` per token); the same kernels and so the same numbers."""

    @staticmethod
    def forward(ctx, y):
        f = y.shape[-1] // 2
        s = F.silu(y[..., :f])
        ctx.save_for_backward(y, s)
        return s * y[..., f:]

    @staticmethod
    def backward(ctx, grad):
        y, s = ctx.saved_tensors
        f = s.shape[-1]
        grad_y = torch.empty_like(y, memory_format=torch.contiguous_format)
        torch.mul(grad, s, out=grad_y[..., f:])                                              # d up
        torch.ops.aten.silu_backward.grad_input(grad * y[..., f:], y[..., :f], grad_input=grad_y[..., :f])  # d gate
        return grad_y


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of the fused gate/up output ``y`` ``[..., 2 f]`` (gate first): ``silu(gate) * up``,
    ``[..., f]``, in ``y``'s dtype (under autocast as well: silu and the product are not autocast ops). Under
    ``torch.compile`` the formula itself (Dynamo does not trace ``out=`` into strided views; the compiler
    fuses the kernels)."""
    if torch.compiler.is_compiling():
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    with torch.autocast(device_type=y.device.type, enabled=False):
        return _SwiGLU.apply(y)


class _SumOverHolders(torch.autograd.Function):
    """Identity in forward; in backward every key/value group's gradient summed over the TP ranks that hold
    it: each rank places its groups' rows in a zero ``[G, ...]`` buffer, one all-reduce over the TP group
    sums them (a rank adds zeros for the groups it does not hold), and each keeps its own rows back. It
    runs only on layouts where some group is shared (TP > G, or heads that straddle groups); the buffer is
    the full key/value weight, ``2 G d h`` elements per layer (the activations' all-reduce is ``b s h``).
    (Subgroups of exactly the holders would move less, but overlapping subgroups created by their members
    alone, ``use_local_synchronization``, hang on gloo, and world-collective ones need every process to
    know every layer's layout.)"""

    @staticmethod
    def forward(ctx, weight, groups, start, ps):
        ctx.groups, ctx.start, ctx.ps = groups, start, ps
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros((ctx.groups, *grad.shape[1:]))
        full[ctx.start:ctx.start + grad.shape[0]] = grad
        torch.distributed.all_reduce(full, group=ctx.ps.tp_group)
        return full[ctx.start:ctx.start + grad.shape[0]].clone(), None, None, None


def sum_over_holders(t: torch.Tensor, groups: int, start: int, ps: ParallelState) -> torch.Tensor:
    """``t`` (this rank's groups ``start ..`` of ``groups`` along dim 0), whose gradient is summed over the TP
    ranks that hold each group (:class:`_SumOverHolders`): for a slice replicated on several ranks that each
    use it for their own heads (key/value groups, and anything laid out by them, e.g. an adapter's rows)."""
    return _SumOverHolders.apply(t, groups, start, ps)


class KVGroupParallelLinear(SelfInitializing, nn.Module):
    """The key and value projections of grouped-query attention, split over TP by *groups*, at any TP.

    Full weight ``[G, 2, d, in]`` (group ``g``'s key rows ``[g, 0]``, then its value rows ``[g, 1]``), bias
    ``[G, 2, d]``. TP rank ``r`` holds the groups its query heads use, ``group_ranges[r]``
    (:func:`tnlg.config.group_ranges`): with TP > G a group is held by several ranks, a *shared* slice
    replicated on them (the :class:`~tnlg.parallel.sharding.ShardSpec` records every rank's offset); where
    neither divides, a rank holds the two groups its heads span. The gradient of a shared group is summed
    over its holders (:class:`_SumOverHolders`: one all-reduce over TP of a ``[G, 2, d, h]`` buffer in
    backward, only on layouts that share a group); initialisation draws the full weight and slices it,
    so every holder starts from the same rows. The attention calls it beside the queries' layer on
    one :class:`SharedInput` (one ``f``; no communication of its own in forward).
    """

    weight: torch.Tensor  # (set by _build from the layer's description)
    bias: Optional[torch.Tensor]

    def __init__(self, in_features: int, groups: int, head_dim: int, ps: ParallelState,
                 group_ranges: Sequence[range], bias: bool = True, device=None, dtype=None,
                 init_method: InitMethod = DEFAULT_INIT, seed: int = 0, init_key: str = ""):
        super().__init__()
        self.ps, self.in_features, self.groups, self.head_dim = ps, in_features, groups, head_dim
        self.group_range = group_ranges[ps.tp_rank]
        _build(self, self.describe(in_features, groups, head_dim, group_ranges, bias), ps, init_method, seed,
               init_key, device, dtype)
        # some group held by several ranks: every TP rank takes part in the gradient sum (the same on all)
        self.shared = ps.tp_size > 1 and any(a.stop > b.start for a, b in zip(group_ranges, group_ranges[1:]))

    @staticmethod
    def describe(in_features: int, groups: int, head_dim: int, group_ranges: Sequence[range],
                 bias: bool = True) -> dict[str, Optional[ShardSpec]]:
        """Every rank's groups along dim 0; offsets recorded where slices overlap."""
        sizes, offsets = tuple(len(r) for r in group_ranges), tuple(r.start for r in group_ranges)
        overlap = any(a.stop > b.start for a, b in zip(group_ranges, group_ranges[1:]))
        offs = offsets if overlap else ()
        return dict(weight=ShardSpec((groups, 2, head_dim, in_features), 0, sizes, offs),
                    bias=ShardSpec((groups, 2, head_dim), 0, sizes, offs) if bias else None)

    def forward(self, x: torch.Tensor, shared_input: Optional[SharedInput] = None) -> torch.Tensor:
        """The keys and values ``[*, n_r * 2 d]`` of ``x`` (rows as :meth:`weights`): after ``f`` (backward:
        an all-reduce of the input gradient), or with ``shared_input`` (``x`` its tensor) the local matmul only."""
        weight, bias = self.weights()
        if shared_input is not None:
            return local_linear(x, weight, bias, shared_input)
        return column_parallel_linear(x, weight, bias, self.ps)

    def weights(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """This rank's ``[n_r * 2 d, in]`` weight and ``[n_r * 2 d]`` bias (rows: group, then k / v, then
        ``d``), through :class:`_SumOverHolders` where a group is shared."""
        w, b = self.weight, self.bias
        if self.shared and torch.is_grad_enabled():
            start = self.group_range.start
            w = _SumOverHolders.apply(w, self.groups, start, self.ps)
            b = None if b is None else _SumOverHolders.apply(b, self.groups, start, self.ps)
        return w.flatten(0, 2), None if b is None else b.flatten()

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, groups={self.groups} (this rank {list(self.group_range)}), "
                f"head_dim={self.head_dim}, shared={self.shared}")
