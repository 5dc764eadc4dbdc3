"""What each transformer block is built from: a :class:`BlockSpec` per layer, chosen from the config and the
parallel layout in one place (:func:`block_spec`), with slots (megatron-core's ``ModuleSpec`` /
``TransformerLayerSubmodules``): the attention core (SDPA over the local sequence, or the ring over the
context-parallel group; each applies the layer's sliding window itself), the MLP (the dense one, or a
mixture of experts on the layers ``--num-experts`` / ``--moe-layer-freq`` name), and the norms (LayerNorm or RMSNorm, :func:`make_norm`).

A slot is a constructor. The MLP slot's signature is :class:`MLPBuilder`: ``(cfg, ps, layer_idx, device,
init_key)`` -> a module whose ``forward(x, ctx, synced_bias=None)`` maps ``[s, b, h]`` (sequence-parallel
``[s_r, b, h]``) to the same layout, may add named auxiliary losses to ``ctx.aux``
(:class:`~tnlg.model.forward.ForwardContext`), and whose row-parallel output bias, when it has one, is
``c_proj.bias`` (the block passes it through its coalesced ``f`` under sequence parallelism). The attention
core's is :class:`CoreBuilder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.nn as nn

from ..config import GPTConfig
from ..parallel.context import context_parallel_attention
from ..parallel.random import TPRandom
from ..parallel.state import ParallelState

__all__ = ["BlockSpec", "MLPBuilder", "CoreBuilder", "AttentionCore", "block_spec", "dense_mlp", "moe_mlp", "attention_core"]


class MLPBuilder(Protocol):
    def __call__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, device: Any,
                 init_key: str) -> nn.Module: ...


class AttentionCore(Protocol):
    """What an attention core does for its layer: the mask it takes (:meth:`mask`, its window applied), the
    keys and values as its kernel reads them (:meth:`keys_values`: ``(k, v, reads the groups itself)``), and
    the attention itself (``__call__``: ``[b, heads_r, s, d]`` out)."""

    def mask(self, attention_mask: Optional[torch.Tensor], s: int, kv_len: int, cache: Any,
             device: Any) -> Optional[torch.Tensor]: ...

    def keys_values(self, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    dropout: float) -> tuple[torch.Tensor, torch.Tensor, bool]: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 causal: bool, dropout: float, gqa: bool = False, tp_rng_state: Any = None) -> torch.Tensor: ...


class CoreBuilder(Protocol):
    def __call__(self, ps: ParallelState, tp_random: TPRandom, kv_index: Optional[tuple[int, ...]],
                 native_gqa: bool, window: Optional[int]) -> AttentionCore: ...


def dense_mlp(cfg: GPTConfig, ps: ParallelState, layer_idx: int, device: Any, init_key: str) -> nn.Module:
    """The dense MLP slot: :class:`~tnlg.model.block.ParallelMLP` (GELU or SwiGLU, column- then row-parallel)."""
    from .block import ParallelMLP  # (the block module builds blocks from specs: it imports this one)
    return ParallelMLP(cfg, ps, device=device, init_key=init_key)


def moe_mlp(cfg: GPTConfig, ps: ParallelState, layer_idx: int, device: Any, init_key: str) -> nn.Module:
    """The mixture-of-experts slot (``--num-experts``, on the layers ``--moe-layer-freq`` names):
    :class:`~tnlg.model.moe.MoELayer`."""
    from .block import ParallelMLP  # (as dense_mlp: the shared expert is a dense MLP of its own width)
    from .moe import MoELayer
    return MoELayer(cfg, ps, layer_idx, device=device, init_key=init_key, shared_mlp=ParallelMLP)


def attention_core(ps: ParallelState, tp_random: TPRandom, kv_index: Optional[tuple[int, ...]], native_gqa: bool,
                   window: Optional[int]) -> AttentionCore:
    """The attention core of the layout: with context parallelism the ring over the CP group
    (:class:`tnlg.parallel.context.RingAttention`), else SDPA over the local sequence
    (:class:`~tnlg.model.attention.LocalAttention`); each applies ``window`` itself."""
    from .attention import LocalAttention
    ring = context_parallel_attention(ps, kv_index, window)
    return ring if ring is not None else LocalAttention(tp_random, kv_index, native_gqa, window)


@dataclass(frozen=True)
class BlockSpec:
    """One block's slots (module docstring): ``core`` builds its attention core, ``mlp`` its MLP;
    ``window`` is the layer's sliding window (``None``: full attention)."""

    core: CoreBuilder
    mlp: MLPBuilder
    window: Optional[int] = None


def block_spec(cfg: GPTConfig, ps: ParallelState, layer_idx: int) -> BlockSpec:
    """Layer ``layer_idx``'s spec: the one place the config and the layout choose a block's parts."""
    mlp = moe_mlp if cfg.is_moe_layer(layer_idx) else dense_mlp
    return BlockSpec(core=attention_core, mlp=mlp, window=cfg.layer_window(layer_idx))
