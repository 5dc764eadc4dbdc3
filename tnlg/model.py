"""The GPT-2 decoder, tensor-parallel (Megatron paper, section 3), nanoGPT-style names.

Per transformer block and per pass, TP communication is two all-reduces of a
``[batch, seq, hidden]`` tensor (one after attention, one after the MLP) in
forward and two in backward (the ``f`` operators at the input of each half).
The embedding adds one all-reduce, the LM head one in backward, and the
vocab-parallel cross-entropy three small ``[batch, seq]`` all-reduces.

Attention heads are split over TP ranks as evenly as possible (sizes differ by
at most one, :func:`tnlg.config.partition_sizes`), so 28 heads run at TP=8 or
16, which Megatron refuses. The fused QKV weight is laid out per head
(rows ``[head][q, k, v][head_dim]``), so a contiguous row split gives each rank
whole heads. The MLP width is split the same way; the vocabulary is padded to a
multiple of ``128 * tp`` (as Megatron) and the padded logits are masked. The LM head is the
word embedding (tied, GPT-2), or with ``config.untie_embeddings_and_output_weights`` its own
weight ``lm_head.weight`` split the same way (Megatron's untied ``output_layer``); the MLP's
GELU is the tanh form, or the exact one with ``config.openai_gelu=False`` (Megatron's default).

Initialisation is TP-invariant: every layer draws its parameters in full from a CPU
generator seeded by ``(config.seed, parameter name)`` and then slices them
(:mod:`tnlg.parallel.initialization`), so a shard is exactly the matching slice of the
TP=1 weight. Weights are ``N(0, init_method_std^2)``, the residual projections
(``c_proj``) ``N(0, init_method_std^2 / (2 L))`` (GPT-2 / Megatron scaled init);
biases zeros, LayerNorm weights ones.

Sequence parallelism (``config.sequence_parallel``, Korthikanti et al. 2022; docs/sequence_parallel.md):
between the TP regions the activations are this rank's positions of the sequence,
sequence-first ``[s_r, b, h]`` (Megatron's layout, so the collectives need no transposed
copies; :func:`tnlg.parallel.mappings.sequence_sizes`, uneven when TP does not divide
``s``), so LayerNorm, dropout and the residual adds run on ``1/t`` of the tokens. Without
it the activations are batch-first ``[b, s, h]``.
Per block and pass the two all-reduces become two all-gathers (before QKV and fc) and two
reduce-scatters (after the output projections) in forward, and the reverse in backward,
plus one more all-gather per column layer in backward (only the shard of its input is
stored). The embedding reduce-scatters instead of all-reducing, the LM head all-gathers
``ln_f``'s output. Replicated parameters applied to a sequence shard must end with the
gradient over the whole sequence on every TP rank: a block's LayerNorm weights and biases
and row-parallel biases enter through one coalesced ``f`` (one small all-reduce of their
six gradients together in backward; ``ln_f`` has its own), and the position embedding is
added inside the embedding's reduce-scatter, whose backward all-gather already gives it
the whole gradient. Incremental
decoding (``kv_cache``), ``last_only`` and sequences shorter than TP run without it, and
``model.sequence_parallel = False`` turns it off (the results are the same either way).

Recomputation (``config.recompute_granularity``): ``"full"`` checkpoints every block
(only its input is kept; the block runs again in backward), ``"selective"`` only the
attention core (softmax and dropout over ``a s^2``, Korthikanti et al. section 5).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from .config import GPTConfig, stage_parts
from .parallel.context import context_positions, ring_attention
from .parallel.initialization import InitMethod, SelfInitializing, init_normal, init_ones, init_zeros
from .parallel.layers import (ColumnParallelLinear, GatedColumnParallelLinear, KVGroupParallelLinear,
                              RowParallelLinear, VocabParallelEmbedding, column_parallel_linear,
                              column_parallel_linears)
from .parallel.rotary import rotary_angles, rotate_qk
from .parallel.mappings import copy_to_tp, copy_to_tp_coalesced, reduce_scatter_to_sequence_parallel, sequence_sizes
from .parallel.random import TPRandom
from .parallel.sharding import ShardSpec, mark_replicated
from .parallel.state import ParallelState
from .parallel.loss import loss_sum, normalised_loss
from .parallel.vocab import gather_logits

__all__ = ["DecoderBase", "GPT", "KVCache", "gather_logits"]  # gather_logits: defined in parallel.vocab


def _layer_norm_in_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the LayerNorm kernel takes the 16-bit tensors as they are (CUDA: statistics and the
    weight gradient accumulate in fp32 inside the kernel, no fp32 copy in or out); elsewhere they are
    upcast first (the CPU results the tests pin down)."""
    return x.device.type == "cuda" and weight.dtype == x.dtype


class _LayerNorm16(torch.autograd.Function):
    """LayerNorm of a 16-bit input computed in fp32, keeping the input for backward in its own
    dtype (2 bytes per element, Korthikanti et al.'s count) instead of an fp32 copy (4). On CUDA
    with 16-bit weights the kernel reads and writes 16 bits and accumulates in fp32 itself: the
    output is 16-bit (what the next matmul casts to anyway) and no fp32 copies are made."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        shape = (x.shape[-1],)
        if _layer_norm_in_kernel(x, weight):
            out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        else:
            out, mean, rstd = torch.native_layer_norm(x.float(), shape, weight.float(), bias.float(), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        if _layer_norm_in_kernel(x, weight):
            return (*torch.ops.aten.native_layer_norm_backward(grad.to(x.dtype), x, (x.shape[-1],), mean, rstd,
                                                               weight, bias, mask), None)
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), (x.shape[-1],), mean, rstd, weight.float(), bias.float(), mask)
        return (None if gx is None else gx.to(x.dtype), None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(bias.dtype), None)


class LayerNorm(nn.LayerNorm, SelfInitializing):
    """LayerNorm computed in fp32 (also under bf16 autocast, and for 16-bit inputs, whose
    16-bit copy is what backward keeps); replicated over TP. Weight ones, bias zeros.

    ``sequence_parallel=True`` (``x`` is this rank's sequence shard): the weight and bias go
    through ``f`` (one coalesced all-reduce of their gradients in backward), unless the caller
    passes them already through ``f`` as ``synced=(weight, bias)``."""

    def __init__(self, dim: int, eps: float, device=None, ps: Optional[ParallelState] = None, init_key: str = ""):
        super().__init__(dim, eps=eps, device=device)
        self.ps = ps
        for p in (self.weight, self.bias):
            mark_replicated(p)
        self.set_init(dict(weight=init_ones, bias=init_zeros), 0, init_key)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False, synced=None) -> torch.Tensor:
        w, b = self.weight, self.bias
        if synced is not None:
            w, b = synced
        elif sequence_parallel and self.ps is not None:
            w, b = copy_to_tp_coalesced((w, b), self.ps)
        # under autocast the fp32 output feeds autocast's casts; without it (inference on a model
        # trained with 16-bit parameters) the output takes the parameters' dtype, as the next
        # layer's weights have it
        out_dtype = None if _autocast_on(x.device.type) or w.dtype == torch.float32 else w.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            if x.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled():
                y = _LayerNorm16.apply(x, w, b, self.eps)
            else:
                y = F.layer_norm(x.float(), self.normalized_shape, w.float(), b.float(), self.eps)
        return y if out_dtype is None else y.to(out_dtype)


class _RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, keeping for backward the input in its own dtype
    (2 bytes per element for 16-bit activations, Korthikanti et al.'s count for a norm's input) and the
    fp32 ``rstd`` per token, not fp32 copies. Backward: ``dw = sum(g xhat)``,
    ``dx = rstd (g w - xhat mean(g w xhat))`` with ``xhat = x rstd``."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return xf * rstd * weight.float()

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat, g = x.float() * rstd, grad.float()
        gw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
        gxhat = g * weight.float()
        gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw.to(weight.dtype), None


class RMSNorm(SelfInitializing, nn.Module):
    """RMSNorm (Zhang & Sennrich 2019; Llama): ``x / sqrt(mean(x^2) + eps) * weight``, no mean, no bias,
    computed in fp32 (also under autocast; :class:`_RMSNorm` keeps the input in its own dtype for
    backward). Replicated over TP; weight ones. Output dtype as :class:`LayerNorm`'s: fp32 under autocast
    or with fp32 weights, else the weights' dtype. ``sequence_parallel`` / ``synced``: as
    :class:`LayerNorm` (``synced=(weight,)``)."""

    def __init__(self, dim: int, eps: float, device=None, ps: Optional[ParallelState] = None, init_key: str = ""):
        super().__init__()
        self.ps, self.eps = ps, eps
        self.weight = mark_replicated(nn.Parameter(torch.empty(dim, device=device)))
        self.set_init(dict(weight=init_ones), 0, init_key)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False, synced=None) -> torch.Tensor:
        w = self.weight
        if synced is not None:
            (w,) = synced
        elif sequence_parallel and self.ps is not None:
            (w,) = copy_to_tp_coalesced((w,), self.ps)
        out_dtype = None if _autocast_on(x.device.type) or w.dtype == torch.float32 else w.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = _RMSNorm.apply(x, w, self.eps)
        return y if out_dtype is None else y.to(out_dtype)


def make_norm(cfg: GPTConfig, ps: ParallelState, init_key: str, device=None) -> nn.Module:
    """The configured normalisation of width ``hidden_size``: :class:`LayerNorm` or :class:`RMSNorm`."""
    cls = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return cls(cfg.hidden_size, cfg.layernorm_epsilon, device=device, ps=ps, init_key=init_key)


def norm_parameters(norm: nn.Module) -> list[torch.Tensor]:
    """A normalisation's parameters in the order its ``synced=`` takes them."""
    return [p for p in (norm.weight, getattr(norm, "bias", None)) if p is not None]


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


class KVCache:
    """Keys and values of past positions for incremental decoding, this rank's key/value heads only
    (its query heads' without grouped-query attention; with it, the rank's KV groups: ``G`` heads in
    all, not ``H``).

    ``k[layer]``/``v[layer]`` are ``[batch, local_kv_heads, max_len, head_dim]`` (global layer index;
    ``None`` for the layers of other pipeline stages when ``model`` is a pipeline rank's
    :class:`~tnlg.parallel.pipeline.StageModel`); ``length`` is the number of positions already written.
    Keys are stored rotated (rope), as transformers stores them.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, dtype=None, device=None):
        cfg, ps = model.config, model.ps
        like = next(model.parameters())  # (the GPT's and a stage's parameters share one dtype and device)
        shape = (batch_size, local_kv_heads(cfg, ps.tp_size, ps.tp_rank), max_len, cfg.head_dim)
        ranges = getattr(model, "chunk_ranges", [range(cfg.num_layers)])
        mine = {i for r in ranges for i in r}

        def cache():
            return [torch.zeros(shape, dtype=dtype or like.dtype, device=device or like.device) if i in mine
                    else None for i in range(cfg.num_layers)]
        self.k, self.v = cache(), cache()
        self.max_len = max_len
        self.length = 0


def local_kv_heads(cfg: GPTConfig, tp: int, tp_rank: int) -> int:
    """Key/value heads TP rank ``tp_rank`` computes: its query heads', or its KV groups."""
    if cfg.kv_groups == cfg.num_attention_heads:
        return cfg.heads_per_rank(tp)[tp_rank]
    return len(cfg.kv_groups_per_rank(tp)[tp_rank])


class ParallelAttention(nn.Module):
    """Causal self-attention with this rank's heads (column-parallel QKV, row-parallel output).

    Full multi-head attention keeps the fused QKV weight ``c_attn`` laid out per head (rows
    ``[head][q, k, v][head_dim]``), so a contiguous split gives whole heads. Grouped-query attention
    (``cfg.kv_groups < heads``) has the queries ``c_q`` (split by heads as ever) and the keys and values
    ``c_kv`` (:class:`~tnlg.parallel.layers.KVGroupParallelLinear`: the KV groups this rank's heads use,
    shared groups replicated on their holders), applied after one ``f`` in two matmuls (sequence-parallel:
    one gathering matmul of the two weights concatenated; :func:`~tnlg.parallel.layers.column_parallel_linears`);
    each query head then reads its group's keys and values. Rope (``position_embedding_type="rope"``)
    rotates queries and keys at the tokens' positions (``rotary``: the angles,
    :func:`tnlg.parallel.rotary.rotary_angles`; :func:`~tnlg.parallel.rotary.rotate_qk`) before the cache
    and the core.

    Forward: ``f`` before QKV (identity), ``g`` after the output projection
    (all-reduce of ``[b, s, h]``). Backward: the reverse (one all-reduce in ``f``), plus, for key/value
    groups held by several ranks, one all-reduce of each shared group's weight gradient over its holders.
    Sequence-parallel (``sp`` = every rank's positions): forward all-gather of the input
    along the sequence and reduce-scatter of the output; backward all-gather of the output
    gradient, all-gather of the input again and reduce-scatter of the input gradient. With ``recompute_granularity ==
    "selective"`` the attention core (softmax, dropout, ``A V``) runs again in backward.
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, tp_random: TPRandom, device=None,
                 init_key: str = ""):
        super().__init__()
        heads = cfg.heads_per_rank(ps.tp_size)
        self.local_heads, self.head_dim, self.layer_idx = heads[ps.tp_rank], cfg.head_dim, layer_idx
        self.dropout = cfg.attention_dropout
        self.tp_random = tp_random
        self.recompute_core = cfg.effective_recompute_granularity == "selective"
        self.grouped = cfg.kv_groups != cfg.num_attention_heads
        self.local_kv = local_kv_heads(cfg, ps.tp_size, ps.tp_rank)
        self.cp_group = ps.cp_group if ps.cp_size > 1 else None  # context parallelism: attention by the ring
        sp, (init, scaled_init) = cfg.sequence_parallel, _init_methods(cfg)
        d, h, bias = cfg.head_dim, cfg.hidden_size, cfg.qkv_bias
        if self.grouped:  # queries by heads, keys/values by the groups those heads use
            ranges = cfg.kv_groups_per_rank(ps.tp_size)
            self.c_q = ColumnParallelLinear(h, cfg.num_attention_heads * d, ps, bias=bias,
                                            partition_sizes=[d * n for n in heads], sequence_parallel=sp,
                                            device=device, init_method=init, seed=cfg.seed,
                                            init_key=_join(init_key, "c_q"))
            self.c_kv = KVGroupParallelLinear(h, cfg.kv_groups, d, ps, ranges, bias=bias, device=device,
                                              init_method=init, seed=cfg.seed, init_key=_join(init_key, "c_kv"))
            first = sum(heads[:ps.tp_rank])  # each local head's group, as an index into the rank's groups
            per_group = cfg.num_attention_heads // cfg.kv_groups
            index = [(first + i) // per_group - ranges[ps.tp_rank].start for i in range(self.local_heads)]
            self.kv_index = tuple(index)  # (a tuple, not a buffer: a meta-built model materialises parameters only)
            self._kv_index: dict = {}
            # SDPA's enable_gqa maps query head i to key/value head i // (heads_r / kv_r): where this rank's
            # index is that pattern, keys and values enter the core as kv_r heads, not copied to heads_r
            ratio = self.local_heads // self.local_kv
            self.native_gqa = self.kv_index == tuple(i // ratio for i in range(self.local_heads)) and \
                ratio * self.local_kv == self.local_heads
        else:  # every rank's rows of the fused QKV weight (whole heads)
            self.c_attn = ColumnParallelLinear(h, 3 * h, ps, bias=bias, partition_sizes=[3 * d * n for n in heads],
                                               sequence_parallel=sp, device=device, init_method=init,
                                               seed=cfg.seed, init_key=_join(init_key, "c_attn"))
        self.c_proj = RowParallelLinear(h, h, ps, bias=cfg.add_bias_linear, input_is_parallel=True,
                                        partition_sizes=[d * n for n in heads], sequence_parallel=sp, device=device,
                                        init_method=scaled_init, seed=cfg.seed, init_key=_join(init_key, "c_proj"))

    def _qkv(self, x: torch.Tensor, sp: Optional[tuple[int, ...]]):
        """``q`` ``[b, heads_r, s, d]`` and ``k``, ``v`` ``[b, kv_heads_r, s, d]`` of this rank's heads."""
        order = (0, 2, 1, 3) if sp is None else (1, 2, 0, 3)  # -> [b, heads, s, hd]
        if self.grouped:  # the queries and the rank's KV groups from one f (no concatenated weight)
            q, kv = column_parallel_linears(x, [(self.c_q.weight, self.c_q.bias), self.c_kv.weights()],
                                            self.c_q.ps, sp)
            lead = q.shape[:2]  # [b, s] or, sequence-parallel, [s (all positions), b]
            q = q.view(*lead, self.local_heads, self.head_dim)
            k, v = kv.view(*lead, self.local_kv, 2, self.head_dim).unbind(dim=3)
        else:
            qkv = self.c_attn(x, sequence_parallel=sp is not None, sequence_sizes=sp)
            lead = qkv.shape[:2]
            q, k, v = qkv.view(*lead, self.local_heads, 3, self.head_dim).unbind(dim=3)
        return tuple(t.permute(*order) for t in (q, k, v))

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, sp: Optional[tuple[int, ...]] = None,
                synced_bias: Optional[torch.Tensor] = None, rotary=None) -> torch.Tensor:
        q, k, v = self._qkv(x, sp)
        b, s = q.shape[0], q.shape[2]
        if rotary is not None:  # (cos, sin) of the tokens' positions
            q, k = rotate_qk(q, k, *rotary)
        if kv_cache is not None:
            start = kv_cache.length
            kv_cache.k[self.layer_idx][:, :, start:start + s] = k
            kv_cache.v[self.layer_idx][:, :, start:start + s] = v
            k = kv_cache.k[self.layer_idx][:, :, :start + s]
            v = kv_cache.v[self.layer_idx][:, :, :start + s]
        kv_len = k.shape[2]
        if attention_mask is None and kv_len != s and s > 1:  # causal with an offset (a chunk after a cache)
            attention_mask = torch.ones(s, kv_len, dtype=torch.bool, device=x.device).tril(kv_len - s)
        if attention_mask is not None and attention_mask.dim() == 3:
            attention_mask = attention_mask.unsqueeze(1)  # [b, s, kv] -> [b, 1, s, kv]
        dropout = self.dropout if self.training else 0.0
        # the core reads the groups itself (CUDA: flash or math only, so not with a mask, which would lose
        # the memory-efficient kernel; the CPU's flash kernel takes masks)
        gqa = self.grouped and self.native_gqa and dropout == 0.0 and (attention_mask is None
                                                                       or x.device.type == "cpu")
        if self.grouped and self.cp_group is None and not gqa:  # each query head gets its group's keys, values
            index = self._kv_index.get(k.device)
            if index is None:
                index = self._kv_index[k.device] = torch.tensor(self.kv_index, dtype=torch.long, device=k.device)
            k, v = k.index_select(1, index), v.index_select(1, index)
        # one new token after a cache sees every cached key: neither a mask nor causality applies
        causal = attention_mask is None and kv_len == s
        if self.recompute_core and self.training and torch.is_grad_enabled():
            # selective recomputation: keep q, k, v; softmax/dropout/A.V run again in backward
            # (this module replays the dropout stream itself, so checkpoint need not stash RNG states)
            state = self.tp_random.snapshot() if dropout else None
            y = checkpoint(self._core, q, k, v, attention_mask, causal, dropout, state, gqa, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            y = self._core(q, k, v, attention_mask, causal, dropout, gqa=gqa)
        if sp is None:
            return self.c_proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim),
                               sequence_parallel=False)
        return self.c_proj(y.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim),
                           sequence_parallel=True, sequence_sizes=sp, synced_bias=synced_bias)

    def _core(self, q, k, v, attention_mask, causal: bool, dropout: float, tp_rng_state=None, gqa: bool = False):
        """``softmax(q k^T / sqrt(d) + mask) v`` with attention dropout; ``tp_rng_state`` replays a
        recomputation's dropout masks; ``gqa``: ``k``, ``v`` hold the rank's KV groups ``[b, kv_r, s, d]``
        (SDPA's ``enable_gqa``; CPU's flash kernel and CUDA's flash and math take it, no copy). With context parallelism: the ring over the CP group, ``attention_mask``
        the whole sequence's document ids ``[b, s]`` or ``None`` (:mod:`tnlg.parallel.context`)."""
        if self.cp_group is not None:
            # (GQA: the ring carries this rank's K/V groups; kv_index maps each query head to its group)
            return ring_attention(q, k, v, self.cp_group, doc_ids=attention_mask,
                                  kv_heads=self.kv_index if self.grouped else None)
        if dropout == 0.0:
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=causal,
                                                      enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=causal)
        with self.tp_random.replay(tp_rng_state):  # heads differ per rank: masks too
            return self.tp_random.attention(q, k, v, attention_mask, dropout, causal)


class ParallelMLP(nn.Module):
    """``h -> ffn -> h``: column-parallel then row-parallel, with GELU (tanh form, or exact with
    ``config.openai_gelu=False``), or with ``config.swiglu`` SwiGLU, ``silu(x W_gate) * (x W_up)``, whose
    gate and up projections are one column-parallel matmul (:class:`~tnlg.parallel.layers.GatedColumnParallelLinear`).

    Forward: ``f`` (identity) then ``g`` (all-reduce of ``[b, s, h]``); backward: one all-reduce.
    Sequence-parallel (``sp``): all-gather before ``c_fc``, reduce-scatter after ``c_proj``
    (backward: all-gather, all-gather again, reduce-scatter).
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, device=None, init_key: str = ""):
        super().__init__()
        sizes = cfg.ffn_per_rank(ps.tp_size)
        sp, (init, scaled_init) = cfg.sequence_parallel, _init_methods(cfg)
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        self.swiglu = cfg.swiglu
        fc = GatedColumnParallelLinear if cfg.swiglu else ColumnParallelLinear
        self.c_fc = fc(cfg.hidden_size, cfg.ffn_hidden_size, ps, bias=cfg.add_bias_linear, partition_sizes=sizes,
                       sequence_parallel=sp, device=device, init_method=init, seed=cfg.seed,
                       init_key=_join(init_key, "c_fc"))
        self.c_proj = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, ps, bias=cfg.add_bias_linear,
                                        partition_sizes=sizes, sequence_parallel=sp, device=device,
                                        init_method=scaled_init, seed=cfg.seed, init_key=_join(init_key, "c_proj"))

    def forward(self, x: torch.Tensor, sp: Optional[tuple[int, ...]] = None,
                synced_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        on = sp is not None
        h = self.c_fc(x, sequence_parallel=on, sequence_sizes=sp)
        if not self.swiglu:  # (SwiGLU's activation is inside its gated layer)
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.c_proj(h, sequence_parallel=on, sequence_sizes=sp, synced_bias=synced_bias)


def _dropout(drop: nn.Dropout, x: torch.Tensor, tp_random: TPRandom, sequence_split: bool) -> torch.Tensor:
    """Dropout on the residual stream: the shared default generator when every TP rank holds the
    same tokens; this rank's generator (:meth:`TPRandom.dropout`) when it holds its own positions."""
    if not sequence_split or not drop.training or drop.p == 0.0:
        return drop(x)
    return tp_random.dropout(x, drop.p)


class Block(nn.Module):
    """Pre-norm transformer block (LayerNorm or RMSNorm); optional activation checkpointing (recompute in backward).

    ``sp``: every TP rank's positions when ``x`` is this rank's sequence shard ``[s_r, b, h]``
    (sequence parallelism), else ``None`` (``x`` is ``[b, s, h]``)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, tp_random: TPRandom, device=None,
                 init_key: str = ""):
        super().__init__()
        self.ln_1 = make_norm(cfg, ps, _join(init_key, "ln_1"), device)
        self.attn = ParallelAttention(cfg, ps, layer_idx, tp_random, device=device, init_key=_join(init_key, "attn"))
        self.ln_2 = make_norm(cfg, ps, _join(init_key, "ln_2"), device)
        self.mlp = ParallelMLP(cfg, ps, device=device, init_key=_join(init_key, "mlp"))
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.tp_random = tp_random
        self.recompute = cfg.effective_recompute_granularity == "full"

    def _synced_replicated(self):
        """Sequence-parallel: the norms' parameters and the row-parallel biases (the replicated parameters
        that meet this rank's positions only) through one coalesced ``f``: ``(ln_1's, ln_2's, attention
        bias, MLP bias)``, ``None`` for a bias the model does not have."""
        n1, n2 = norm_parameters(self.ln_1), norm_parameters(self.ln_2)
        biases = [self.attn.c_proj.bias, self.mlp.c_proj.bias]
        synced = copy_to_tp_coalesced([*n1, *n2, *(b for b in biases if b is not None)], self.attn.c_proj.ps)
        ln1, ln2, rest = synced[:len(n1)], synced[len(n1):len(n1) + len(n2)], list(synced[len(n1) + len(n2):])
        attn_bias, mlp_bias = (rest.pop(0) if b is not None else None for b in biases)
        return ln1, ln2, attn_bias, mlp_bias

    def _forward(self, x, attention_mask, kv_cache, sp=None, rotary=None, tp_rng_state=None):
        on = sp is not None
        ln1, ln2, attn_bias, mlp_bias = self._synced_replicated() if on else (None,) * 4
        # a recomputation in backward replays the forward's TP-rank dropout streams
        with self.tp_random.replay(tp_rng_state):
            h = self.attn(self.ln_1(x, on, ln1), attention_mask, kv_cache, sp, attn_bias, rotary)
            x = x + _dropout(self.dropout, h, self.tp_random, on)
            h = self.mlp(self.ln_2(x, on, ln2), sp, mlp_bias)
            return x + _dropout(self.dropout, h, self.tp_random, on)

    def forward(self, x, attention_mask=None, kv_cache=None, sp: Optional[tuple[int, ...]] = None, rotary=None):
        """``rotary``: rope's ``(cos, sin)`` of the tokens' positions (:meth:`DecoderBase.rotary`), or ``None``."""
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attention_mask, kv_cache, sp, rotary, self.tp_random.snapshot(),
                              use_reentrant=False)
        return self._forward(x, attention_mask, kv_cache, sp, rotary)


class PositionEmbedding(SelfInitializing, nn.Module):
    """Learned position embeddings ``[seq_length, hidden]``, replicated over TP; no communication."""

    def __init__(self, num_positions: int, dim: int, init_method: InitMethod, seed: int = 0, init_key: str = "",
                 device=None):
        super().__init__()
        self.weight = ShardSpec((num_positions, dim)).parameter(0, device)
        self.set_init(dict(weight=init_method), seed, init_key)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)


class OutputLayer(SelfInitializing, nn.Module):
    """The untied LM head (Megatron's ``output_layer``, ``--untie-embeddings-and-output-weights``):
    a ``[V_pad / tp, h]`` weight split by vocabulary rows exactly as the word embedding (padded
    rows zeros), no bias. The GPT applies it as it applies the tied embedding; no communication
    of its own."""

    def __init__(self, vocab_size: int, dim: int, ps: ParallelState, padded_size: int, init_method: InitMethod,
                 seed: int = 0, init_key: str = "", device=None):
        super().__init__()
        self.ps = ps
        spec = VocabParallelEmbedding.describe(vocab_size, dim, padded_size, ps.tp_size)["weight"]
        self.weight = spec.parameter(ps.tp_rank, device)
        self.set_init(dict(weight=init_method), seed, init_key)


def _init_methods(cfg: GPTConfig) -> tuple[InitMethod, InitMethod]:
    """Weights ``N(0, std^2)``; residual projections ``N(0, std^2 / (2 L))`` (GPT-2 / Megatron scaled init)."""
    std = cfg.init_method_std
    return init_normal(std), init_normal(std / math.sqrt(2.0 * cfg.num_layers))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class DecoderBase(nn.Module):
    """What the whole GPT and one pipeline rank's part of it (:class:`tnlg.parallel.pipeline.StageModel`)
    share: every module built by name (:meth:`part`, under the GPT's parameter names, so each is
    initialised as the GPT's of that name), the embedding and the LM head applied to them
    (:meth:`embed`, :meth:`head`), the sequence split and the initial value of a parameter."""

    transformer: nn.ModuleDict

    def __init__(self, config: GPTConfig, ps: ParallelState):
        super().__init__()
        config.check_tensor_parallel(ps.tp_size)
        self.config, self.ps = config, ps
        self.padded_vocab_size = config.padded_vocab_size(ps.tp_size)
        self.tp_random = TPRandom(config.seed, ps.tp_rank, ps.device)
        self.sequence_parallel = config.sequence_parallel

    def part(self, name: str, device=None) -> nn.Module:
        """The module ``transformer.<name>`` (``wte``, ``wpe``, ``drop``, ``h.<layer>``, ``ln_f``) or
        ``lm_head`` (the untied LM head); ``device`` ``None``: the parallel state's (for a virtual
        state, the current default device, e.g. ``torch.device("meta")``)."""
        cfg, ps = self.config, self.ps
        device = device if device is not None else (None if ps.virtual else ps.device)
        init, seed, h = init_normal(cfg.init_method_std), cfg.seed, cfg.hidden_size
        key = name if name == "lm_head" else f"transformer.{name}"
        if name == "wte":
            return VocabParallelEmbedding(cfg.vocab_size, h, ps, self.padded_vocab_size, device=device,
                                          init_method=init, seed=seed, init_key=key)
        if name == "wpe" and cfg.position_embedding_type == "learned_absolute":
            return PositionEmbedding(cfg.seq_length, h, init, seed, key, device)
        if name == "drop":
            return nn.Dropout(cfg.hidden_dropout)
        if name.startswith("h."):
            return Block(cfg, ps, int(name[2:]), self.tp_random, device=device, init_key=key)
        if name == "ln_f":
            return make_norm(cfg, ps, key, device)
        if name == "lm_head":
            return OutputLayer(cfg.vocab_size, h, ps, self.padded_vocab_size, init, seed, key, device)
        raise ValueError(f"the GPT has no part {name!r}.")

    @property
    def output_weight(self) -> torch.Tensor:
        """This rank's vocabulary rows of the LM head: the word embedding's, or the untied output layer's."""
        head = self.lm_head if self.config.untie_embeddings_and_output_weights else self.transformer.wte
        return head.weight

    def initial_shard(self, name: str, param: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This TP rank's initial value of parameter ``name`` (fp32, CPU), from the layer that owns
        it: the matching slice of the seeded full weight (``param``: the parameter as built, when
        a wrapper has replaced it). The data-parallel engine uses it to
        materialise a meta-device model straight into its buffers, one parameter at a time."""
        owner, _, leaf = name.rpartition(".")
        return self.get_submodule(owner).initial_shard(leaf, param)

    def start_position(self, seq_len: int, kv_cache: Optional[KVCache]) -> int:
        """The position of the first of ``seq_len`` new tokens: the cache's length, or 0 without one;
        a ``ValueError`` when they would run past ``seq_length``."""
        offset = kv_cache.length if kv_cache is not None else 0
        if offset + seq_len > self.config.seq_length:
            raise ValueError(f"sequence of {offset + seq_len} tokens is longer than "
                             f"seq_length={self.config.seq_length}.")
        return offset

    def sequence_split(self, seq_len: int, incremental: bool = False) -> Optional[tuple[int, ...]]:
        """Every TP rank's positions of a ``seq_len`` sequence when this call runs sequence-parallel,
        else ``None``: off without TP, when turned off, for incremental decoding, and for sequences
        shorter than TP (a rank would hold no position)."""
        tp = self.ps.tp_size
        if not self.sequence_parallel or tp == 1 or incremental or seq_len < tp:
            return None
        return sequence_sizes(seq_len, tp)

    def embed(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor], sp: Optional[tuple[int, ...]],
              offset: int = 0) -> torch.Tensor:
        """Word plus (learned) position embeddings, then dropout: ``[b, s, h]``, or with ``sp`` (every rank's
        positions) this rank's positions ``[s_r, b, h]``. ``position_ids`` ``None``: ``offset .. offset+s-1``.
        Collectives: the word embedding's all-reduce over TP; with ``sp`` a reduce-scatter of the partial
        word embeddings instead, to which each rank adds its positions' (backward: an all-gather)."""
        t = self.transformer
        if position_ids is None and self.ps.cp_size > 1:  # this CP rank's two chunks: their global positions
            position_ids = context_positions(tokens.shape[1], self.ps, tokens.device)
        if position_ids is None:
            position_ids = torch.arange(offset, offset + tokens.shape[1], device=tokens.device).unsqueeze(0)
        learned = "wpe" in t
        if sp is None:
            x = t.wte(tokens)
            return t.drop(x + t.wpe(position_ids) if learned else x)
        positions = t.wpe(position_ids).transpose(0, 1) if learned else None
        x = reduce_scatter_to_sequence_parallel(t.wte.local_lookup(tokens.t()), self.ps, sp, inplace=True,
                                                replicated=positions)
        return _dropout(t.drop, x, self.tp_random, True)

    def rotary(self, seq_len: int, position_ids: Optional[torch.Tensor], offset: int = 0, device=None):
        """Rope's ``(cos, sin)`` (fp32 ``[b, 1, s, rotary_dim]``) at ``position_ids`` (``None``: ``offset ..
        offset + seq_len - 1``), or ``None`` without rope. Every block of a forward shares them."""
        cfg = self.config
        if cfg.position_embedding_type != "rope":
            return None
        if position_ids is None and self.ps.cp_size > 1:  # this CP rank's two chunks: their global positions
            position_ids = context_positions(seq_len, self.ps, device)
        if position_ids is None:
            position_ids = torch.arange(offset, offset + seq_len, device=device).unsqueeze(0)
        return rotary_angles(position_ids, cfg.rotary_dim, cfg.rotary_base)

    def head(self, x: torch.Tensor, sp: Optional[tuple[int, ...]], last_only: bool = False) -> torch.Tensor:
        """``ln_f`` and the parallel LM head (tied to the embedding, or untied): this rank's vocabulary
        shard of the logits, ``[b, s, V_pad / tp]`` (``[b, 1, ...]`` with ``last_only``: the next token's),
        or with ``sp`` sequence-first ``[s, b, V_pad / tp]``. Collectives: ``f`` (backward: an
        all-reduce over TP); with ``sp`` an all-gather of the sequence instead (backward: a reduce-scatter)."""
        x = self.transformer.ln_f(x, sp is not None)
        if last_only:  # generation needs only the next token's logits
            x = x[:, -1:]
        if sp is None:
            return F.linear(copy_to_tp(x, self.ps), self.output_weight)
        return column_parallel_linear(x, self.output_weight, None, self.ps, sp)


class GPT(DecoderBase):
    """GPT-2 decoder whose weights are split over ``ps.tp_group``.

    ``model(tokens)`` returns this rank's vocabulary shard of the logits
    ``[b, s, V_pad / tp]`` (use :func:`gather_logits` for the full ones);
    ``model(tokens, labels=labels)`` returns the mean loss (fp32) through the
    vocab-parallel cross-entropy (:func:`tnlg.parallel.loss.loss_sum`). ``labels`` are aligned with ``tokens``
    (``tokens = sample[:-1]``, ``labels = sample[1:]``); the model does not shift.
    ``loss_mask`` (same shape, 0/1) excludes targets from the mean; ``loss_divisor`` divides the sum
    instead of the micro batch's token count (the per-token normalisation,
    :func:`tnlg.parallel.loss.per_token_divisor`). ``last_only``
    computes the logits of the last position only (generation).

    ``config.sequence_parallel`` (with TP > 1) splits the activations between the TP regions
    along the sequence (module docstring); the attribute ``sequence_parallel`` turns it off or
    on for later calls without changing any parameter.
    """

    def __init__(self, config: GPTConfig, ps: Optional[ParallelState] = None, device=None):
        super().__init__(config, ps or ParallelState.single())
        self.heads_per_rank = config.heads_per_rank(self.ps.tp_size)
        names = stage_parts(config, first=True, last=True)
        parts = {name: self.part(name, device) for name in names if name not in ("ln_f", "lm_head")}
        parts["h"] = nn.ModuleList(self.part(f"h.{i}", device) for i in range(config.num_layers))
        parts["ln_f"] = self.part("ln_f", device)
        self.transformer = nn.ModuleDict(parts)
        if "lm_head" in names:
            self.lm_head = self.part("lm_head", device)

    @staticmethod
    def describe(config: GPTConfig, tp_size: int) -> dict[str, ShardSpec]:
        """How every parameter splits over ``tp_size`` ranks, by name, in the model's order (checkpoints
        reshard from it, the planner counts from it): read from the layers themselves, built for a
        virtual TP rank on the meta device (nothing allocated; each parameter's mark holds every rank's
        size), once per configuration and TP size."""
        return dict(_shard_specs(dataclasses.astuple(config), tp_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """TP-invariant init of every layer (each shard is the matching slice of the seeded full weight)."""
        for m in self.modules():
            if isinstance(m, SelfInitializing):
                m.reset_parameters()

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None,
                last_only: bool = False, loss_divisor: Optional[torch.Tensor] = None):
        if last_only and labels is not None:
            raise ValueError("last_only=True computes one position's logits; it cannot give a loss over labels.")
        if self.ps.cp_size > 1 and (kv_cache is not None or last_only):
            raise ValueError("generation (a KV cache, last_only) does not run with context parallelism: load the "
                             "model at context parallel size 1 to generate.")
        s = tokens.shape[1]
        offset = self.start_position(s, kv_cache)
        sp = self.sequence_split(s, kv_cache is not None or last_only)
        x = self.embed(tokens, position_ids, sp, offset)
        rotary = self.rotary(s, position_ids, offset, tokens.device)
        for block in self.transformer.h:
            x = block(x, attention_mask, kv_cache, sp, rotary)
        if kv_cache is not None:
            kv_cache.length += s
        logits = self.head(x, sp, last_only)
        if sp is not None:  # [s, b, V_r]: the loss is computed sequence-first, the logits returned batch-first
            if labels is None:
                return logits.transpose(0, 1)
            labels = labels.t()
            loss_mask = None if loss_mask is None else loss_mask.t()
        if labels is None:
            return logits
        total, count = loss_sum(logits, labels, loss_mask, self.ps, self.config.vocab_size)
        return normalised_loss(total, count, loss_divisor)


@functools.lru_cache(maxsize=32)
def _shard_specs(config_fields: tuple, tp_size: int) -> tuple[tuple[str, ShardSpec], ...]:
    """:meth:`GPT.describe` of the configuration with these field values (a tuple, so it can key the cache).
    The build allocates nothing, so no dispatch mode active around the call (a fake-tensor run, a memory
    tracker counting a checkpoint save) sees it, and its counts do not depend on whether it was cached."""
    with _disable_current_modes(), torch.device("meta"):
        model = GPT(GPTConfig(*config_fields), ParallelState.for_virtual_rank(tp_size))
    return tuple((name, ShardSpec.of(p)) for name, p in model.named_parameters())
