"""What each transformer block is built from, chosen in one place (:func:`block_spec`): the layer's
:class:`~tnlg.model.slots.BlockSpec` from the config and the parallel layout, its slots filled: the attention core
(SDPA over the local sequence, or the ring over the context-parallel group; each applies the layer's sliding
window itself) and the MLP (the dense one, or a mixture of experts on the layers ``--num-experts`` /
``--moe-layer-freq`` name). The slots'
contracts are in :mod:`tnlg.model.slots`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from ..config import GPTConfig
from ..parallel.context import context_parallel_attention
from ..parallel.random import TPRandom
from ..parallel.state import ParallelState
from .attention import LocalAttention
from .block import ParallelMLP
from .moe import MoELayer
from .slots import AttentionCore, BlockSpec

__all__ = ["block_spec", "dense_mlp", "moe_mlp", "attention_core"]


def dense_mlp(cfg: GPTConfig, ps: ParallelState, layer_idx: int, device: Any, init_key: str) -> nn.Module:
    """The dense MLP slot: :class:`~tnlg.model.block.ParallelMLP` (GELU or SwiGLU, column- then row-parallel)."""
    return ParallelMLP(cfg, ps, device=device, init_key=init_key)


def moe_mlp(cfg: GPTConfig, ps: ParallelState, layer_idx: int, device: Any, init_key: str) -> nn.Module:
    """The mixture-of-experts slot (``--num-experts``, on the layers ``--moe-layer-freq`` names):
    :class:`~tnlg.model.moe.MoELayer`."""
    return MoELayer(cfg, ps, layer_idx, device=device, init_key=init_key, shared_mlp=ParallelMLP)


def attention_core(ps: ParallelState, tp_random: TPRandom, kv_index: Optional[tuple[int, ...]], native_gqa: bool,
                   window: Optional[int]) -> AttentionCore:
    """The attention core of the layout: with context parallelism the ring over the CP group
    (:class:`tnlg.parallel.context.RingAttention`), else SDPA over the local sequence
    (:class:`~tnlg.model.attention.LocalAttention`); each applies ``window`` itself."""
    ring = context_parallel_attention(ps, kv_index, window)
    return ring if ring is not None else LocalAttention(tp_random, kv_index, native_gqa, window)


def block_spec(cfg: GPTConfig, ps: ParallelState, layer_idx: int) -> BlockSpec:
    """Layer ``layer_idx``'s spec: the one place the config and the layout choose a block's parts."""
    mlp = moe_mlp if cfg.is_moe_layer(layer_idx) else dense_mlp
    return BlockSpec(core=attention_core, mlp=mlp, window=cfg.layer_window(layer_idx))
