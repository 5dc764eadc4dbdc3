"""The decoder's self-attention over this rank's heads, its KV cache, and the attention core in a slot.

:class:`ParallelAttention` projects this rank's heads (column-parallel QKV, row-parallel output), rotates
queries and keys (rope), writes and reads the KV cache, and hands ``q``, ``k``, ``v`` to its **core**,
an object chosen when the layer is built (megatron-core's ``SelfAttentionSubmodules.core_attention``
slot; torchtitan's ``apply_cp_to_attention_module``): :class:`LocalAttention` (SDPA over the local
sequence, with attention dropout drawn from this TP rank's generator when the config has dropout), or
with context parallelism :class:`tnlg.parallel.context.RingAttention` (the ring over the CP group).
The forward itself has no branch on the parallel layout: the activation layout is the
:class:`~tnlg.model.forward.ForwardContext`'s.
"""

from __future__ import annotations

from typing import Optional, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import GPTConfig
from ..parallel.layers import ColumnParallelLinear, KVGroupParallelLinear, RowParallelLinear, SharedInput
from ..parallel.mappings import copy_to_tp_coalesced
from ..parallel.random import TPRandom
from ..parallel.rotary import rotate_qk
from ..parallel.state import ParallelState
from .forward import ForwardContext
from .init_methods import init_methods, join_key
from ..parallel import masks as _masks
from .kv_cache import KVCache, local_kv_heads
from ..parallel.masks import Mask, QueryChunks, document_mask, mask_elements, window_mask
from .norms import AcrossHeadsRMSNorm, head_norm, norm_parameters
from .slots import BlockSpec

__all__ = ["KVCache", "local_kv_heads", "LocalAttention", "ParallelAttention", "window_mask", "document_mask"]


class LocalAttention:
    """The attention core over the whole local sequence: ``softmax(q k^T / sqrt(d) + mask) v`` by SDPA, or with
    attention dropout (training) by this TP rank's generator (heads differ per rank, so do the masks;
    :meth:`TPRandom.attention`). Grouped-query attention: each query head reads its group's keys and values
    (``kv_index``: the rank's KV group of each local head), copied to the query heads, or read in place by
    SDPA's ``enable_gqa`` where the index is SDPA's pattern (``native_gqa``; CUDA: flash or math only, so not
    with a mask, which would lose the memory-efficient kernel; the CPU's flash kernel takes masks)."""

    def __init__(self, tp_random: TPRandom, kv_index: Optional[tuple[int, ...]] = None, native_gqa: bool = False,
                 window: Optional[int] = None):
        self.tp_random, self.kv_index, self.native_gqa, self.window = tp_random, kv_index, native_gqa, window
        self._kv_index: dict = {}  # (per device: a meta-built model materialises parameters only)

    def mask(self, ctx: ForwardContext, s: int, kv_len: int, device) -> Optional[Mask]:
        """The mask for ``s`` queries over ``kv_len`` keys (``None``: causal, or none at all for one new token
        after a cache), from the forward's ``attention_mask`` (``[b, s, kv]`` / ``[s, kv]``, True = may attend;
        or the documents' ids ``[b, kv]``, integers) and this core's sliding window. Without a KV cache it is
        built once per forward and window (``ctx.shared``: every layer takes the same): whole
        (:meth:`whole`) up to :data:`tnlg.parallel.masks.MASK_BUDGET` elements, else kept as the ids and the window,
        a :class:`~tnlg.parallel.masks.QueryChunks` that :meth:`__call__` runs chunk by chunk (O(s) memory, not
        O(s^2); :mod:`tnlg.parallel.masks`). With a cache, :meth:`whole` as the cache's rows need."""
        if ctx.kv_cache is not None:
            return self.whole(ctx.attention_mask, s, kv_len, cast(KVCache, ctx.kv_cache), device)
        return ctx.shared(("mask", s, kv_len, self.window),
                          lambda: self._whole_or_chunks(ctx.attention_mask, s, kv_len, device))

    def _whole_or_chunks(self, attention_mask: Optional[torch.Tensor], s: int, kv_len: int, device) -> Optional[Mask]:
        """:meth:`whole`, or above the budget the mask of documents' ids and a window kept per query chunk."""
        ids = attention_mask if _document_ids(attention_mask) else None
        window = self.window if self.window is not None and kv_len > self.window else None
        described = ids is not None or (attention_mask is None and window is not None)
        if described and mask_elements(ids, s, kv_len) > _masks.MASK_BUDGET:
            return QueryChunks(ids, s, kv_len, window, _masks.MASK_BUDGET, device)
        return self.whole(attention_mask, s, kv_len, None, device)

    def whole(self, attention_mask: Optional[torch.Tensor], s: int, kv_len: int, cache: Optional[KVCache],
              device) -> Optional[torch.Tensor]:
        """The whole mask SDPA takes (``None``: causal, or none for one new token after a cache): the forward's
        ``attention_mask`` (documents' ids turned into their block-causal mask, :func:`document_mask`) with this
        core's sliding window, each row's own cache slots when the cache's rows differ in length, and
        causality after a cache; ``[b, 1, s, kv]`` where it is per row."""
        if _document_ids(attention_mask):
            attention_mask = document_mask(cast(torch.Tensor, attention_mask), s, kv_len)
        if cache is not None and not cache.uniform:  # rows at their own lengths: each sees its own slots only
            rows = cache.attention_mask(s, self.window)
            attention_mask = rows if attention_mask is None else attention_mask & rows
        elif self.window is not None and kv_len > self.window:  # (else the window changes nothing)
            window = window_mask(s, kv_len, self.window, device)
            attention_mask = window if attention_mask is None else attention_mask & window
        if attention_mask is None and kv_len != s and s > 1:  # causal with an offset (a chunk after a cache)
            attention_mask = torch.ones(s, kv_len, dtype=torch.bool, device=device).tril(kv_len - s)
        if attention_mask is not None and attention_mask.dim() == 3:
            attention_mask = attention_mask.unsqueeze(1)  # [b, s, kv] -> [b, 1, s, kv]
        return attention_mask

    def keys_values(self, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[Mask],
                    dropout: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``k``, ``v`` as the kernel takes them, and whether it reads the groups itself (``enable_gqa``)."""
        if self.kv_index is None:
            return k, v, False
        gqa = self.native_gqa and dropout == 0.0 and (attention_mask is None or k.device.type == "cpu")
        if gqa:
            return k, v, True
        index = self._kv_index.get(k.device)
        if index is None:
            index = self._kv_index[k.device] = torch.tensor(self.kv_index, dtype=torch.long, device=k.device)
        return k.index_select(1, index), v.index_select(1, index), False

    def __call__(self, q, k, v, attention_mask: Optional[Mask], causal: bool, dropout: float, gqa: bool = False,
                 tp_rng_state=None) -> torch.Tensor:
        """``tp_rng_state`` replays a recomputation's dropout masks; a :class:`~tnlg.parallel.masks.QueryChunks`
        mask runs chunk by chunk (:meth:`chunked`)."""
        if isinstance(attention_mask, QueryChunks):
            return self.chunked(q, k, v, attention_mask, dropout, gqa)
        return self._attend(q, k, v, attention_mask, causal, dropout, gqa, tp_rng_state)

    def _attend(self, q, k, v, attention_mask: Optional[torch.Tensor], causal: bool, dropout: float, gqa: bool,
                tp_rng_state) -> torch.Tensor:
        if dropout == 0.0:
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=causal,
                                                      enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=causal)
        with self.tp_random.replay(tp_rng_state):
            return self.tp_random.attention(q, k, v, attention_mask, dropout, causal)

    def chunked(self, q, k, v, chunks: QueryChunks, dropout: float, gqa: bool) -> torch.Tensor:
        """Attention chunk of queries by chunk of queries (:mod:`tnlg.parallel.masks`): each over the keys it can
        see, with its own mask built from the documents' ids; with gradients each chunk under
        ``torch.utils.checkpoint`` (backward rebuilds its mask and recomputes it, replaying its dropout draws),
        so no chunk's mask or probabilities are kept. Eager under ``torch.compile`` (its key ranges are
        read from the ids: one graph break)."""
        if torch.compiler.is_compiling():
            return torch.compiler.disable(self.chunked, reason="key ranges read from the documents' ids")(
                q, k, v, chunks, dropout, gqa)
        keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = []
        for span in chunks.spans():
            first, end, lo, hi = span
            state = self.tp_random.snapshot() if dropout else None
            args = (q[:, :, first:end], k[:, :, lo:hi], v[:, :, lo:hi], chunks, span, dropout, gqa, state)
            out.append(checkpoint(self._chunk, *args, use_reentrant=False, preserve_rng_state=False) if keep
                       else self._chunk(*args))
        return out[0] if len(out) == 1 else torch.cat(out, dim=2)

    def _chunk(self, q, k, v, chunks: QueryChunks, span: tuple[int, int, int, int], dropout: float, gqa: bool,
               tp_rng_state) -> torch.Tensor:
        return self._attend(q, k, v, chunks.rows(*span), False, dropout, gqa, tp_rng_state)


def _document_ids(attention_mask: Optional[torch.Tensor]) -> bool:
    """Whether a forward's ``attention_mask`` is the documents' ids (integers), not a mask (bool or additive)."""
    return attention_mask is not None and not attention_mask.dtype.is_floating_point and \
        attention_mask.dtype != torch.bool


class ParallelAttention(nn.Module):
    """Causal self-attention with this rank's heads (column-parallel QKV, row-parallel output).

    Full multi-head attention keeps the fused QKV weight ``c_attn`` laid out per head (rows
    ``[head][q, k, v][head_dim]``), so a contiguous split gives whole heads. Grouped-query attention
    (``cfg.kv_groups < heads``) has the queries ``c_q`` (split by heads as ever) and the keys and values
    ``c_kv`` (:class:`~tnlg.parallel.layers.KVGroupParallelLinear`: the KV groups this rank's heads use,
    shared groups replicated on their holders), both layers called on one
    :class:`~tnlg.parallel.layers.SharedInput` (one ``f``; sequence-parallel one all-gather, its shard kept);
    each query head then reads its group's keys and values. Rope (``position_embedding_type="rope"``)
    rotates queries and keys at the tokens' positions (the context's ``rotary``: the angles,
    :func:`tnlg.parallel.rotary.rotary_angles`; :func:`~tnlg.parallel.rotary.rotate_qk`) before the cache
    and the core. The heads are ``head_dim`` wide (``kv_channels``), so the queries and the output
    projection's input are ``heads x head_dim``, which need not be the hidden size. ``qk_layernorm``
    normalises each head's queries and keys over ``head_dim`` before rope (``q_norm``, ``k_norm``: one
    weight shared by every head, replicated over TP; each rank normalises its own heads, so the weights
    enter through ``f``: one coalesced all-reduce of their gradients over TP in backward);
    ``qk_layernorm_across_heads`` normalises the queries over all heads at once and the keys over all groups
    (:class:`~tnlg.model.norms.AcrossHeadsRMSNorm`, OLMoE's: one all-reduce of each token's sum of squares over
    TP in forward and in backward, per norm). A layer with a
    sliding window (:meth:`~tnlg.config.GPTConfig.layer_window`) adds :func:`window_mask` to its mask
    (with context parallelism the ring applies the window itself and skips the blocks outside it).

    Forward: ``f`` before QKV (identity), ``g`` after the output projection
    (all-reduce of ``[s, b, h]``). Backward: the reverse (one all-reduce in ``f``), plus, for key/value
    groups held by several ranks, one all-reduce of each shared group's weight gradient over its holders.
    Sequence-parallel (the context's ``sp``: every rank's positions): forward all-gather of the input
    along the sequence and reduce-scatter of the output; backward all-gather of the output
    gradient, all-gather of the input again and reduce-scatter of the input gradient. With ``recompute_granularity ==
    "selective"`` the attention core (softmax, dropout, ``A V``) runs again in backward.
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, tp_random: TPRandom, device=None,
                 init_key: str = "", *, spec: BlockSpec):
        super().__init__()
        heads = cfg.heads_per_rank(ps.tp_size)
        self.ps = ps
        self.local_heads, self.head_dim, self.layer_idx = heads[ps.tp_rank], cfg.head_dim, layer_idx
        self.window = spec.window
        self.dropout = cfg.attention_dropout
        # GPT-2's scale_attn_weights / scale_attn_by_inverse_layer_idx: a factor on the queries, so every core
        # (SDPA, the dropout stream, the ring and its backward) applies it with its own 1 / sqrt(d)
        self.score_scale = cfg.attention_score_scale(layer_idx)
        self.tp_random = tp_random
        self.recompute_core = cfg.effective_recompute_granularity == "selective"
        self.grouped = cfg.kv_groups != cfg.num_attention_heads
        self.local_kv = local_kv_heads(cfg, ps.tp_size, ps.tp_rank)
        sp, (init, scaled_init) = cfg.sequence_parallel, init_methods(cfg)
        d, h, bias = cfg.head_dim, cfg.hidden_size, cfg.qkv_bias
        if self.grouped:  # queries by heads, keys/values by the groups those heads use
            ranges = cfg.kv_groups_per_rank(ps.tp_size)
            self.c_q = ColumnParallelLinear(h, cfg.num_attention_heads * d, ps, bias=bias,
                                            partition_sizes=[d * n for n in heads], sequence_parallel=sp,
                                            device=device, init_method=init, seed=cfg.seed,
                                            init_key=join_key(init_key, "c_q"))
            self.c_kv = KVGroupParallelLinear(h, cfg.kv_groups, d, ps, ranges, bias=bias, device=device,
                                              init_method=init, seed=cfg.seed, init_key=join_key(init_key, "c_kv"))
            first = sum(heads[:ps.tp_rank])  # each local head's group, as an index into the rank's groups
            per_group = cfg.num_attention_heads // cfg.kv_groups
            index = [(first + i) // per_group - ranges[ps.tp_rank].start for i in range(self.local_heads)]
            self.kv_index = tuple(index)  # (a tuple, not a buffer: a meta-built model materialises parameters only)
            # SDPA's enable_gqa maps query head i to key/value head i // (heads_r / kv_r): where this rank's
            # index is that pattern, keys and values enter the core as kv_r heads, not copied to heads_r
            ratio = self.local_heads // self.local_kv
            self.native_gqa = self.kv_index == tuple(i // ratio for i in range(self.local_heads)) and \
                ratio * self.local_kv == self.local_heads
        else:  # every rank's rows of the fused QKV weight (whole heads)
            self.c_attn = ColumnParallelLinear(h, 3 * cfg.attention_width, ps, bias=bias, partition_sizes=[3 * d * n for n in heads],
                                               sequence_parallel=sp, device=device, init_method=init,
                                               seed=cfg.seed, init_key=join_key(init_key, "c_attn"))
        self.c_proj = RowParallelLinear(cfg.attention_width, h, ps, bias=cfg.attn_out_bias, input_is_parallel=True,
                                        partition_sizes=[d * n for n in heads], sequence_parallel=sp, device=device,
                                        init_method=scaled_init, seed=cfg.seed, init_key=join_key(init_key, "c_proj"))
        # the attention core: the ring over the CP group with context parallelism, else SDPA over the local sequence
        self.q_norm: nn.Module
        self.k_norm: nn.Module
        if cfg.qk_layernorm_across_heads:  # one norm over all the heads' queries, one over the keys (OLMoE)
            first = sum(heads[:ps.tp_rank])
            q_units = range(first, first + self.local_heads)
            kv_ranges = cfg.kv_groups_per_rank(ps.tp_size) if self.grouped else None
            k_units = kv_ranges[ps.tp_rank] if kv_ranges is not None else q_units
            holders = None if kv_ranges is None else [sum(g in r for r in kv_ranges) for g in k_units]
            eps = cfg.layernorm_epsilon
            self.q_norm = AcrossHeadsRMSNorm(cfg.num_attention_heads, d, eps, ps, q_units, device=device,
                                             init_key=join_key(init_key, "q_norm"))
            self.k_norm = AcrossHeadsRMSNorm(cfg.kv_groups, d, eps, ps, k_units, holders, device=device,
                                             init_key=join_key(init_key, "k_norm"))
        elif cfg.qk_layernorm:  # one norm of head_dim each for every head's queries and keys
            self.q_norm = head_norm(cfg, ps, join_key(init_key, "q_norm"), device)
            self.k_norm = head_norm(cfg, ps, join_key(init_key, "k_norm"), device)
        kv_heads = self.kv_index if self.grouped else None
        self.core = spec.core(ps, tp_random, kv_heads, self.grouped and self.native_gqa, self.window)

    def _qkv(self, x: torch.Tensor, ctx: ForwardContext):
        """``q`` ``[b, heads_r, s, d]`` and ``k``, ``v`` ``[b, kv_heads_r, s, d]`` of this rank's heads."""
        if self.grouped:  # the queries and the rank's KV groups: both layers called on one f (or one all-gather)
            shared = SharedInput.of(x, self.ps, ctx.sp)
            q = self.c_q(shared.tensor, shared_input=shared)
            kv = self.c_kv(shared.tensor, shared_input=shared)
            lead = q.shape[:2]  # [s, b] (sequence-parallel: all positions, after the all-gather)
            q = q.view(*lead, self.local_heads, self.head_dim)
            k, v = kv.view(*lead, self.local_kv, 2, self.head_dim).unbind(dim=3)
        else:
            qkv = self.c_attn(x, sequence_parallel=ctx.sequence_parallel, sequence_sizes=ctx.sp)
            lead = qkv.shape[:2]
            q, k, v = qkv.view(*lead, self.local_heads, 3, self.head_dim).unbind(dim=3)
        return tuple(ctx.heads_first(t) for t in (q, k, v))

    def _normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``qk_layernorm``: every head's queries and keys normalised over ``head_dim`` (the weights through
        one coalesced ``f`` at TP > 1: each rank's gradient holds its own heads' share)."""
        params = [p for norm in (self.q_norm, self.k_norm) for p in norm_parameters(norm)]
        ps = self.ps
        if ps.tp_size > 1:
            params = list(copy_to_tp_coalesced(params, ps))
        half = len(params) // 2
        return (self.q_norm(q, synced=tuple(params[:half])).to(q.dtype),
                self.k_norm(k, synced=tuple(params[half:])).to(k.dtype))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, synced_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``synced_bias``: the output projection's bias already through the block's coalesced ``f``."""
        q, k, v = self._qkv(x, ctx)
        s = q.shape[2]
        if hasattr(self, "q_norm"):
            q, k = self._normed_qk(q, k)
        if ctx.rotary is not None:  # (cos, sin) of the tokens' positions
            q, k = rotate_qk(q, k, *ctx.rotary)
        if self.score_scale != 1.0:  # the scores q k^T scaled as the config says (GPT-2's fields)
            q = q * self.score_scale
        cache = cast(Optional[KVCache], ctx.kv_cache)
        if cache is not None:  # every row's new keys and values at its own length; every slot up to the longest
            k, v = cache.update(self.layer_idx, k, v)
        kv_len = k.shape[2]
        attention_mask = self.core.mask(ctx, s, kv_len, x.device)  # (the core's window; once per forward)
        dropout = self.dropout if self.training else 0.0
        k, v, gqa = self.core.keys_values(k, v, attention_mask, dropout)
        # one new token after a cache sees every cached key: neither a mask nor causality applies
        causal = attention_mask is None and kv_len == s
        # (a mask per query chunk recomputes each chunk itself: the same as selective recomputation, chunk by chunk)
        if self.recompute_core and self.training and torch.is_grad_enabled() and \
                not isinstance(attention_mask, QueryChunks):
            # selective recomputation: keep q, k, v; softmax/dropout/A.V run again in backward
            # (the core replays the dropout stream itself, so checkpoint need not stash RNG states)
            state = self.tp_random.snapshot() if dropout else None
            y = checkpoint(self.core, q, k, v, attention_mask, causal, dropout, gqa, state, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            y = self.core(q, k, v, attention_mask, causal, dropout, gqa)
        return self.c_proj(ctx.tokens_first(y), sequence_parallel=ctx.sequence_parallel, sequence_sizes=ctx.sp,
                           synced_bias=synced_bias)
