"""The decoder's transformer block: pre-norm attention and MLP with residual dropout, and its recomputation.

Per block and pass, TP communication is two all-reduces of an ``[s, b, h]`` tensor (one after attention,
one after the MLP) in forward and two in backward (the ``f`` operators at the input of each half);
sequence-parallel, two all-gathers and two reduce-scatters instead (the package docstring,
:mod:`tnlg.model`). The layout of ``x`` is the :class:`~tnlg.model.forward.ForwardContext`'s.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import GPTConfig, partition_sizes
from ..parallel.layers import ColumnParallelLinear, GatedColumnParallelLinear, RowParallelLinear
from ..parallel.mappings import copy_to_tp_coalesced
from ..parallel.random import TPRandom
from ..parallel.state import ParallelState
from .attention import ParallelAttention
from .forward import ForwardContext
from .init_methods import init_methods, join_key
from .norms import make_norm, norm_parameters
from .slots import BlockSpec

__all__ = ["ParallelMLP", "Block"]


class ParallelMLP(nn.Module):
    """``h -> ffn -> h``: column-parallel then row-parallel, with GELU (tanh form, or exact with
    ``config.openai_gelu=False``), or with ``config.swiglu`` SwiGLU, ``silu(x W_gate) * (x W_up)``, whose
    gate and up projections are one column-parallel matmul (:class:`~tnlg.parallel.layers.GatedColumnParallelLinear`).

    Forward: ``f`` (identity) then ``g`` (all-reduce of ``[s, b, h]``); backward: one all-reduce.
    Sequence-parallel (the context's ``sp``): all-gather before ``c_fc``, reduce-scatter after ``c_proj``
    (backward: all-gather, all-gather again, reduce-scatter).
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, device=None, init_key: str = "",
                 ffn_hidden_size: Optional[int] = None):
        """``ffn_hidden_size``: another width than the config's (a mixture of experts' shared expert)."""
        super().__init__()
        ffn = ffn_hidden_size or cfg.ffn_hidden_size
        assert ffn is not None  # (GPTConfig sets the default width)
        sizes = cfg.ffn_per_rank(ps.tp_size) if ffn_hidden_size is None else partition_sizes(ffn, ps.tp_size)
        sp, (init, scaled_init) = cfg.sequence_parallel, init_methods(cfg)
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        self.swiglu = cfg.swiglu
        fc = GatedColumnParallelLinear if cfg.swiglu else ColumnParallelLinear
        self.c_fc = fc(cfg.hidden_size, ffn, ps, bias=cfg.mlp_biases, partition_sizes=sizes,
                       sequence_parallel=sp, device=device, init_method=init, seed=cfg.seed,
                       init_key=join_key(init_key, "c_fc"))
        self.c_proj = RowParallelLinear(ffn, cfg.hidden_size, ps, bias=cfg.mlp_biases,
                                        partition_sizes=sizes, sequence_parallel=sp, device=device,
                                        init_method=scaled_init, seed=cfg.seed, init_key=join_key(init_key, "c_proj"))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, synced_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.c_fc(x, sequence_parallel=ctx.sequence_parallel, sequence_sizes=ctx.sp)
        if not self.swiglu:  # (SwiGLU's activation is inside its gated layer)
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.c_proj(h, sequence_parallel=ctx.sequence_parallel, sequence_sizes=ctx.sp, synced_bias=synced_bias)


def _dropout(drop: nn.Dropout, x: torch.Tensor, tp_random: TPRandom, sequence_split: bool) -> torch.Tensor:
    """Dropout on the residual stream: the shared default generator when every TP rank holds the
    same tokens; this rank's generator (:meth:`TPRandom.dropout`) when it holds its own positions."""
    if not sequence_split or not drop.training or drop.p == 0.0:
        return drop(x)
    return tp_random.dropout(x, drop.p)


class Block(nn.Module):
    """Pre-norm transformer block (LayerNorm or RMSNorm); optional activation checkpointing (recompute in backward).
    Built from its layer's :class:`~tnlg.model.slots.BlockSpec` (the attention core and the MLP are slots).

    ``x`` is sequence-first ``[s, b, h]``, sequence-parallel this rank's positions ``[s_r, b, h]`` (the
    :class:`~tnlg.model.forward.ForwardContext`'s ``sp`` says which)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, tp_random: TPRandom, device=None,
                 init_key: str = "", *, spec: BlockSpec):
        super().__init__()
        self.ln_1 = make_norm(cfg, ps, join_key(init_key, "ln_1"), device)
        self.attn = ParallelAttention(cfg, ps, layer_idx, tp_random, device=device, init_key=join_key(init_key, "attn"),
                                      spec=spec)
        self.ln_2 = make_norm(cfg, ps, join_key(init_key, "ln_2"), device)
        self.mlp = spec.mlp(cfg, ps, layer_idx, device, join_key(init_key, "mlp"))
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.tp_random = tp_random
        self.recompute = cfg.effective_recompute_granularity == "full"

    def _synced_replicated(self):
        """Sequence-parallel: the norms' parameters and the row-parallel biases (the replicated parameters
        that meet this rank's positions only) through one coalesced ``f``: ``(ln_1's, ln_2's, attention
        bias, MLP bias)``, ``None`` for a bias the model does not have."""
        n1, n2 = norm_parameters(self.ln_1), norm_parameters(self.ln_2)
        biases = [self.attn.c_proj.bias, getattr(getattr(self.mlp, "c_proj", None), "bias", None)]
        synced = copy_to_tp_coalesced([*n1, *n2, *(b for b in biases if b is not None)], self.attn.c_proj.ps)
        ln1, ln2, rest = synced[:len(n1)], synced[len(n1):len(n1) + len(n2)], list(synced[len(n1) + len(n2):])
        attn_bias, mlp_bias = (rest.pop(0) if b is not None else None for b in biases)
        return ln1, ln2, attn_bias, mlp_bias

    def _forward(self, x: torch.Tensor, ctx: ForwardContext, tp_rng_state=None) -> torch.Tensor:
        on = ctx.sequence_parallel
        ln1, ln2, attn_bias, mlp_bias = self._synced_replicated() if on else (None,) * 4
        # a recomputation in backward replays the forward's TP-rank dropout streams
        with self.tp_random.replay(tp_rng_state):
            h = self.attn(self.ln_1(x, on, ln1), ctx, attn_bias)
            x = x + _dropout(self.dropout, h, self.tp_random, on)
            h = self.mlp(self.ln_2(x, on, ln2), ctx, mlp_bias)
            return x + _dropout(self.dropout, h, self.tp_random, on)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``ctx``: the forward's shared values (:meth:`tnlg.model.decoder.DecoderBase.run` builds it)."""
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, ctx, self.tp_random.snapshot(), use_reentrant=False)
        return self._forward(x, ctx)
