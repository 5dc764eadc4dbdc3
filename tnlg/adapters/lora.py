"""Low-rank adapters (LoRA, Hu et al. 2021) on tnlg's tensor-parallel linear layers, exact under TP and SP.

A :class:`LoraLinear` replaces a layer in its parent (the layer is called, never read around, so the wrapper
sees every use) and adds ``(alpha / r) * B A dropout(x)`` to its output (``use_rslora``: ``alpha / sqrt(r)``),
PEFT's formula. The base layer is frozen. A layer that fuses several of PEFT's modules holds one adapter per
*part*, as PEFT has them: the fused multi-head QKV ``c_attn`` (rows ``[head][q, k, v][d]``) the parts
``q_proj``, ``k_proj``, ``v_proj`` (or GPT-2's one ``c_attn``), grouped-query attention's ``c_kv`` (rows
``[group][k, v][d]``) ``k_proj`` and ``v_proj``, SwiGLU's gated ``c_fc`` (per rank ``[gate_r; up_r]``)
``gate_proj`` and ``up_proj``; a part left out adds nothing to its rows.

How each factor splits over TP (every parameter marked with its :class:`~tnlg.parallel.sharding.ShardSpec`,
so clipping, checkpoints and resharding read them as any other):

* **column-parallel base** (``Y_i = X W_i^T``): ``A`` ``[r, in]`` replicated, ``B`` ``[out, r]`` split with
  the base's output rows (a fused layer's parts each by their own rows, laid out as the layer's). ``h = A x``
  enters the TP region through Megatron's ``f`` (identity forward, all-reduce of ``dL/dh`` ``[*, r]``
  backward), so ``A``'s gradient is whole on every rank and ``x``'s adapter gradient is added once.
  Sequence-parallel, ``h`` is computed on this rank's positions and all-gathered (``[s, b, r]``; backward a
  reduce-scatter), and ``A`` enters through ``f`` (its gradient summed over TP: each rank saw its own
  positions). On a :class:`~tnlg.parallel.layers.SharedInput` (grouped-query attention) ``x`` is already
  inside the region: ``A`` enters through ``f`` and ``x``'s partial gradient joins the shared input's own
  reduction. ``B`` rows of key/value groups that several ranks hold are summed over their holders, as the
  base's (:func:`~tnlg.parallel.layers.sum_over_holders`).
* **row-parallel base** (``Y = sum_i X_i W_i^T``): ``A`` ``[r, in]`` split with the base's input columns,
  ``B`` ``[out, r]`` replicated; the partial ``A_i x_i`` ``[*, r]`` is summed by one all-reduce over TP
  (``g``), sequence-parallel reduce-scattered to this rank's positions (``B`` then through ``f``).

The extra communication is ``[tokens, r]`` per adapted layer and pass, and ``A`` / ``B`` gradients of
replicated factors ``[r, h]`` / ``[h, r]``: small beside the base's ``[tokens, h]``.

Initialisation is TP-invariant (:mod:`tnlg.parallel.initialization`): each factor drawn in full from a
generator seeded by ``(seed, its name)`` and sliced. ``A`` is PEFT's Kaiming-uniform (``a = sqrt(5)``:
``U(-1/sqrt(in), 1/sqrt(in))``), ``B`` zeros (``random_b``: ``U(-1/sqrt(r), 1/sqrt(r))``, nn.Linear's,
as PEFT's ``init_lora_weights=False``: a test sees the adapter act from the first step). Dropout on the input
of ``A``: the shared generator where every TP rank holds the same ``x``, this rank's
(:class:`~tnlg.parallel.random.TPRandom`) where it holds its own positions or features, so at TP > 1 the masks
differ from TP 1's (as the residual dropout's under SP), the expectation does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.initialization import SelfInitializing
from ..parallel.layers import (ColumnParallelLinear, GatedColumnParallelLinear, KVGroupParallelLinear,
                               RowParallelLinear, SharedInput, sum_over_holders, swiglu)
from ..parallel.mappings import (copy_to_tp, gather_from_sequence_parallel, reduce_from_tp,
                                 reduce_scatter_to_sequence_parallel)
from ..parallel.sharding import ShardSpec
from ..parallel.state import ParallelState

__all__ = ["LoraSettings", "LoraLinear", "apply_lora", "adapter_parameters", "ADAPTED_LAYERS", "PART_COUNTS"]

ADAPTED_LAYERS = (ColumnParallelLinear, RowParallelLinear, KVGroupParallelLinear)
"""The layer kinds an adapter wraps (the gated ``c_fc`` is a column-parallel layer)."""


@dataclass(frozen=True)
class LoraSettings:
    """An adapter's hyper-parameters, PEFT's ``LoraConfig`` names: ``rank`` (``r``), ``alpha``
    (``lora_alpha``, PEFT's default 8), ``dropout`` (``lora_dropout``), ``use_rslora``; ``random_b``: ``B``
    drawn at random instead of zeros (tests); ``seed``: the generator seed of the factors' initial values."""

    rank: int
    alpha: float = 8.0
    dropout: float = 0.0
    use_rslora: bool = False
    random_b: bool = False
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}.")

    @property
    def scaling(self) -> float:
        """The factor on ``B A x``: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _kaiming_a(shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """PEFT's ``A``: ``kaiming_uniform_(a=sqrt(5))`` over the fan-in ``shape[1]``: ``U(-1/sqrt(in), 1/sqrt(in))``."""
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def _zeros(shape: tuple, generator: torch.Generator) -> torch.Tensor:
    return torch.zeros(shape)


# how many parts each kind of layer has (a column-parallel layer: one, or the fused QKV's three)
PART_COUNTS = {RowParallelLinear: (1,), KVGroupParallelLinear: (2,), GatedColumnParallelLinear: (2,),
               ColumnParallelLinear: (1, 3)}


def _kind(layer: nn.Module) -> type:
    for kind in (GatedColumnParallelLinear, KVGroupParallelLinear, RowParallelLinear, ColumnParallelLinear):
        if isinstance(layer, kind):
            return kind
    raise TypeError(f"no LoRA adapter for a {type(layer).__name__}; adapters wrap "
                    + ", ".join(k.__name__ for k in ADAPTED_LAYERS))


class LoraLinear(SelfInitializing, nn.Module):
    """A frozen tensor-parallel layer ``base_layer`` plus one low-rank adapter per named part (module
    docstring). ``parts``: PEFT's module name of each part of the layer, in the layer's order (``None``: that
    part has no adapter); ``head_dim``: the width of a head (the fused QKV's parts interleave per head);
    ``init_key``: the layer's name in the model (the factors' identities: ``<init_key>.lora_A_<part>``).
    Parameters ``lora_A_<part>`` ``[r, in]`` and ``lora_B_<part>`` ``[rows, r]`` (this rank's shards).
    Other attribute reads go to the base layer (as PEFT's wrappers do)."""

    base_layer: Any
    ps: ParallelState
    tp_random: Any
    kind: type
    parts: tuple[Optional[str], ...]
    settings: LoraSettings
    rank: int
    scaling: float
    block: Optional[int]

    def __init__(self, base_layer: Any, parts: Sequence[Optional[str]], settings: LoraSettings,
                 init_key: str, head_dim: Optional[int] = None, tp_random=None):
        super().__init__()
        kind = _kind(base_layer)
        if len(parts) not in PART_COUNTS[kind]:
            raise ValueError(f"a {kind.__name__} has {PART_COUNTS[kind]} parts, got {list(parts)}")
        if kind is RowParallelLinear and not base_layer.input_is_parallel:
            raise ValueError("LoRA on a row-parallel layer needs input_is_parallel=True")
        if kind is ColumnParallelLinear and base_layer.gather_output:
            raise ValueError("LoRA on a column-parallel layer with gather_output=True is not supported")
        if len(parts) == 3 and head_dim is None:
            raise ValueError("the fused QKV's parts need head_dim")
        self.base_layer = base_layer
        for p in base_layer.parameters():
            p.requires_grad_(False)
        self.kind, self.parts, self.settings = kind, tuple(parts), settings
        self.ps = base_layer.ps
        self.tp_random = tp_random  # (not a module: the model's own generator of this rank)
        self.rank, self.scaling = settings.rank, settings.scaling
        self.block = None  # the rows of one part's block in the layer's interleaved layout
        specs = self._specs(base_layer, head_dim)
        device, dtype = base_layer.weight.device, base_layer.weight.dtype
        inits = {}
        for name, spec in specs.items():
            setattr(self, name, spec.parameter(self.ps.tp_rank, device, dtype))
            inits[name] = _kaiming_a if name.startswith("lora_A_") else \
                (self._random_b if settings.random_b else _zeros)
        self.set_init(inits, settings.seed, init_key)

    @staticmethod
    def _random_b(shape: tuple, generator: torch.Generator) -> torch.Tensor:
        bound = 1.0 / math.sqrt(shape[1])  # nn.Linear(r, out)'s default
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)

    def _specs(self, base: Any, head_dim: Optional[int]) -> dict[str, ShardSpec]:
        """Every factor's spec (module docstring), in part order; sets :attr:`block`."""
        r, kind = self.settings.rank, self.kind
        specs: dict[str, ShardSpec] = {}
        if kind is RowParallelLinear:
            (name,) = self.parts
            if name is not None:
                specs[f"lora_A_{name}"] = ShardSpec((r, base.in_features), 1, tuple(base.partition_sizes))
                specs[f"lora_B_{name}"] = ShardSpec((base.out_features, r))
            return specs
        if kind is KVGroupParallelLinear:
            w = ShardSpec.of(base.weight)  # [G, 2, d, in] split by groups
            d = base.head_dim
            sizes = tuple(n * d for n in w.sizes)
            offsets = tuple(o * d for o in w.offsets)
            b_spec = ShardSpec((base.groups * d, r), 0, sizes, offsets)
            in_features, self.block = base.in_features, d
        else:
            sizes = tuple(base.partition_sizes)
            # the gated layer's features are each part's ([2, out, in]); the fused QKV's, the three parts'
            n = 1 if kind is GatedColumnParallelLinear else len(self.parts)
            b_spec = ShardSpec((base.out_features // n, r), 0, tuple(s // n for s in sizes))
            in_features = base.in_features
            if kind is GatedColumnParallelLinear:
                self.block = sizes[self.ps.tp_rank]
            elif n == 3:
                self.block = head_dim
        for name in self.parts:
            if name is not None:
                specs[f"lora_A_{name}"] = ShardSpec((r, in_features))
                specs[f"lora_B_{name}"] = b_spec
        return specs

    # ----------------------------------------------------------------------------------------- access

    def __getattr__(self, attr: str) -> Any:
        try:
            return super().__getattr__(attr)
        except AttributeError:
            return getattr(super().__getattr__("base_layer"), attr)

    def factors(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(part, A, B)`` of every adapted part (this rank's shards)."""
        for name in self.parts:
            if name is not None:
                yield name, getattr(self, f"lora_A_{name}"), getattr(self, f"lora_B_{name}")

    # ----------------------------------------------------------------------------------------- forward

    def _dropped(self, x: torch.Tensor, own: bool) -> torch.Tensor:
        """``dropout(x)``: ``own``: ``x`` is this rank's own (positions or features), this rank's generator."""
        p = self.settings.dropout
        if p == 0.0 or not self.training:
            return x
        if own and self.ps.tp_size > 1 and self.tp_random is not None:
            return self.tp_random.dropout(x, p)
        return F.dropout(x, p, True)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.kind is RowParallelLinear:
            return self._row(x, *args, **kwargs)
        return self._column(x, *args, **kwargs)

    def _column(self, x: torch.Tensor, sequence_parallel: Optional[bool] = None,
                sequence_sizes: Optional[Sequence[int]] = None, *,
                shared_input: Optional[SharedInput] = None) -> torch.Tensor:
        base, ps = self.base_layer, self.ps
        if self.kind is KVGroupParallelLinear:
            y = base(x, shared_input=shared_input)
            sp = False
        else:
            gated = self.kind is GatedColumnParallelLinear
            call = base.pre_activation if gated else base
            y = call(x, sequence_parallel, sequence_sizes, shared_input=shared_input)
            sp = (base.sequence_parallel if sequence_parallel is None else sequence_parallel) and ps.tp_size > 1
        factors = list(self.factors())
        if factors:
            y = y + self._column_delta(x, factors, sp, sequence_sizes, shared_input)
        return swiglu(y) if self.kind is GatedColumnParallelLinear else y

    def _column_delta(self, x, factors, sp: bool, sequence_sizes, shared_input) -> torch.Tensor:
        ps, r = self.ps, self.rank
        a = torch.cat([f[1] for f in factors]) if len(factors) > 1 else factors[0][1]  # [P r, in]: one matmul
        if shared_input is not None:  # x is inside the region already (after f, or gathered)
            h = F.linear(self._dropped(x, False), copy_to_tp(a, ps))
        elif sp:  # this rank's positions: A x on them, gathered ([s, b, P r]); A's gradient summed over TP
            sizes = tuple(sequence_sizes) if sequence_sizes is not None else (x.shape[0],) * ps.tp_size
            h = gather_from_sequence_parallel(F.linear(self._dropped(x, True), copy_to_tp(a, ps)), ps, sizes)
        else:
            h = copy_to_tp(F.linear(self._dropped(x, False), a), ps)
        hs = h.split(r, dim=-1)
        outs = {name: F.linear(hp, self._b(b)) for (name, _, b), hp in zip(factors, hs)}
        if len(self.parts) == 1:
            delta = next(iter(outs.values()))
        else:
            ref = next(iter(outs.values()))
            pieces = [outs[n] if n is not None else torch.zeros_like(ref) for n in self.parts]
            block = self.block
            delta = torch.stack([p.unflatten(-1, (-1, block)) for p in pieces], dim=-2).flatten(-3)
        return delta * self.scaling

    def _b(self, b: torch.Tensor) -> torch.Tensor:
        """``B`` as the matmul takes it: rows of key/value groups held by several ranks summed over them."""
        base = self.base_layer
        if self.kind is KVGroupParallelLinear and base.shared and torch.is_grad_enabled():
            d = base.head_dim
            return sum_over_holders(b.unflatten(0, (-1, d)), base.groups, base.group_range.start, self.ps).flatten(0, 1)
        return b

    def _row(self, x: torch.Tensor, sequence_parallel: Optional[bool] = None,
             sequence_sizes: Optional[Sequence[int]] = None, synced_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        base, ps = self.base_layer, self.ps
        y = base(x, sequence_parallel, sequence_sizes, synced_bias)
        factors = list(self.factors())
        if not factors:
            return y
        ((_, a, b),) = factors
        sp = (base.sequence_parallel if sequence_parallel is None else sequence_parallel) and ps.tp_size > 1
        partial = F.linear(self._dropped(x, True), a)  # [*, r]: this rank's input columns' share
        if sp:  # summed and scattered to this rank's positions; B meets those only: its gradient summed over TP
            h = reduce_scatter_to_sequence_parallel(partial, ps, sequence_sizes)
            b = copy_to_tp(b, ps)
        else:
            h = reduce_from_tp(partial, ps)
        return y + F.linear(h, b) * self.scaling

    def extra_repr(self) -> str:
        named = [p for p in self.parts if p is not None]
        return f"parts={named}, r={self.rank}, scaling={self.scaling:g}, dropout={self.settings.dropout}"


def apply_lora(model: nn.Module, settings: LoraSettings, sites: Mapping[str, Sequence[Optional[str]]],
               head_dim: Optional[int] = None) -> list[str]:
    """Freeze every parameter of ``model`` and wrap each layer named in ``sites`` (its module path in the model
    -> its parts' PEFT names, :class:`LoraLinear`) in its parent; returns the wrapped names. The adapters'
    identities are their names in the model, so the same model at any TP starts from the same factors."""
    for p in model.parameters():
        p.requires_grad_(False)
    tp_random = getattr(model, "tp_random", None)
    wrapped = []
    for name, parts in sites.items():
        layer = model.get_submodule(name)
        if isinstance(layer, LoraLinear):
            raise ValueError(f"{name} already has an adapter")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoraLinear(layer, parts, settings, name, head_dim, tp_random))
        wrapped.append(name)
    return wrapped


def adapter_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter factor of ``model`` by its parameter name (this rank's shards)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A_" in n or ".lora_B_" in n}
