"""The slots a transformer block is built from (megatron-core's ``ModuleSpec`` / ``TransformerLayerSubmodules``):
:class:`BlockSpec` holds one layer's attention-core and MLP constructors and its window; the protocols say what
each slot's module does. :mod:`tnlg.model.spec` chooses a spec per layer from the config and the layout.

The MLP slot (:class:`MLPBuilder`): ``(cfg, ps, layer_idx, device, init_key)`` -> a module whose
``forward(x, ctx, synced_bias=None)`` maps ``[s, b, h]`` (sequence-parallel ``[s_r, b, h]``) to the same
layout, may add named auxiliary losses to ``ctx.aux`` (:class:`~tnlg.model.forward.ForwardContext`), and whose
row-parallel output bias, when it has one, is ``c_proj.bias`` (the block passes it through its coalesced ``f``
under sequence parallelism). The attention-core slot (:class:`CoreBuilder`) builds an :class:`AttentionCore`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.nn as nn

from ..config import GPTConfig
from ..parallel.random import TPRandom
from ..parallel.state import ParallelState
from .forward import ForwardContext
from ..parallel.masks import Mask

__all__ = ["BlockSpec", "MLPBuilder", "CoreBuilder", "AttentionCore"]


class MLPBuilder(Protocol):
    def __call__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, device: Any,
                 init_key: str) -> nn.Module: ...


class AttentionCore(Protocol):
    """What an attention core does for its layer: the mask it takes (:meth:`mask`, its window applied, from the
    forward's :class:`~tnlg.model.forward.ForwardContext`: its ``attention_mask`` and ``kv_cache``), the
    keys and values as its kernel reads them (:meth:`keys_values`: ``(k, v, reads the groups itself)``), and
    the attention itself (``__call__``: ``[b, heads_r, s, d]`` out)."""

    def mask(self, ctx: ForwardContext, s: int, kv_len: int, device: Any) -> Optional[Mask]: ...

    def keys_values(self, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[Mask],
                    dropout: float) -> tuple[torch.Tensor, torch.Tensor, bool]: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[Mask],
                 causal: bool, dropout: float, gqa: bool = False, tp_rng_state: Any = None) -> torch.Tensor: ...


class CoreBuilder(Protocol):
    def __call__(self, ps: ParallelState, tp_random: TPRandom, kv_index: Optional[tuple[int, ...]],
                 native_gqa: bool, window: Optional[int]) -> AttentionCore: ...


@dataclass(frozen=True)
class BlockSpec:
    """One block's slots (module docstring): ``core`` builds its attention core, ``mlp`` its MLP;
    ``window`` is the layer's sliding window (``None``: full attention)."""

    core: CoreBuilder
    mlp: MLPBuilder
    window: Optional[int] = None
