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
multiple of ``128 * tp`` (as Megatron) and the padded logits are masked.

Initialisation is TP-invariant: every parameter is drawn in full from a CPU
generator seeded by ``(config.seed, parameter name)`` and then sliced, so a
shard is exactly the matching slice of the TP=1 weight.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import GPTConfig
from .parallel.cross_entropy import vocab_parallel_cross_entropy
from .parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, full_shape,
                              mark_replicated, shard_of)
from .parallel.mappings import copy_to_tp, gather_from_tp
from .parallel.random import TPRandom
from .parallel.state import ParallelState

__all__ = ["GPT", "KVCache", "gather_logits", "parameter_counts"]


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 (also under bf16 autocast); replicated over TP."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__(dim, eps=eps, device=device)
        mark_replicated(self.weight)
        mark_replicated(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)


class KVCache:
    """Keys and values of past positions for incremental decoding, this rank's heads only.

    ``k[layer]``/``v[layer]`` are ``[batch, local_heads, max_len, head_dim]``;
    ``length`` is the number of positions already written.
    """

    def __init__(self, model: "GPT", batch_size: int, max_len: int, dtype=None, device=None):
        cfg = model.config
        heads = model.heads_per_rank[model.ps.tp_rank]
        dtype = dtype or model.transformer.wte.weight.dtype
        device = device or model.transformer.wte.weight.device
        shape = (batch_size, heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.max_len = max_len
        self.length = 0


class ParallelAttention(nn.Module):
    """Causal self-attention with this rank's heads (column-parallel QKV, row-parallel output).

    Forward: ``f`` before QKV (identity), ``g`` after the output projection
    (all-reduce of ``[b, s, h]``). Backward: the reverse (one all-reduce in ``f``).
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, tp_random: TPRandom, device=None):
        super().__init__()
        heads = cfg.heads_per_rank(ps.tp_size)
        hd = cfg.head_dim
        self.local_heads, self.head_dim, self.layer_idx = heads[ps.tp_rank], hd, layer_idx
        self.dropout = cfg.attention_dropout
        self.tp_random = tp_random
        self.c_attn = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, ps,
                                           partition_sizes=[3 * hd * n for n in heads], device=device)
        self.c_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, ps, input_is_parallel=True,
                                        partition_sizes=[hd * n for n in heads], device=device)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.c_attn(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # [b, heads, s, hd]
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
        # one new token after a cache sees every cached key: neither a mask nor causality applies
        causal = attention_mask is None and kv_len == s
        if dropout == 0.0:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=causal)
        else:
            with self.tp_random.fork():  # heads differ per rank: dropout must too
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout,
                                                   is_causal=causal)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class ParallelMLP(nn.Module):
    """``h -> ffn -> h`` with GELU (tanh form): column-parallel then row-parallel.

    Forward: ``f`` (identity) then ``g`` (all-reduce of ``[b, s, h]``); backward: one all-reduce.
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, device=None):
        super().__init__()
        sizes = cfg.ffn_per_rank(ps.tp_size)
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, ps, partition_sizes=sizes,
                                         device=device)
        self.c_proj = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, ps, partition_sizes=sizes,
                                        device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; optional activation checkpointing (recompute in backward)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, tp_random: TPRandom, device=None):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.layernorm_epsilon, device=device)
        self.attn = ParallelAttention(cfg, ps, layer_idx, tp_random, device=device)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.layernorm_epsilon, device=device)
        self.mlp = ParallelMLP(cfg, ps, device=device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.tp_random = tp_random
        self.recompute = cfg.recompute_activations

    def _forward(self, x, attention_mask, kv_cache, tp_rng_state=None):
        live = self.tp_random.state
        replaying = tp_rng_state is not None and not torch.equal(live, tp_rng_state)
        if replaying:  # recomputation in backward: replay the forward's attention-dropout stream
            self.tp_random.state = tp_rng_state.clone()
        try:
            x = x + self.dropout(self.attn(self.ln_1(x), attention_mask, kv_cache))
            return x + self.dropout(self.mlp(self.ln_2(x)))
        finally:  # (try/finally: checkpoint may stop a recomputation early by raising)
            if replaying:
                self.tp_random.state = live

    def forward(self, x, attention_mask=None, kv_cache=None):
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attention_mask, kv_cache, self.tp_random.state.clone(),
                              use_reentrant=False)
        return self._forward(x, attention_mask, kv_cache)


class GPT(nn.Module):
    """GPT-2 decoder whose weights are split over ``ps.tp_group``.

    ``model(tokens)`` returns this rank's vocabulary shard of the logits
    ``[b, s, V_pad / tp]`` (use :func:`gather_logits` for the full ones);
    ``model(tokens, labels=labels)`` returns the mean loss (fp32) through the
    vocab-parallel cross-entropy. ``labels`` are aligned with ``tokens``
    (``tokens = sample[:-1]``, ``labels = sample[1:]``); the model does not shift.
    ``loss_mask`` (same shape, 0/1) excludes targets from the mean. ``last_only``
    computes the logits of the last position only (generation).
    """

    def __init__(self, config: GPTConfig, ps: Optional[ParallelState] = None, device=None):
        super().__init__()
        ps = ps or ParallelState.single()
        config.check_tensor_parallel(ps.tp_size)
        self.config, self.ps = config, ps
        device = device if device is not None else (None if ps.virtual else ps.device)
        self.heads_per_rank = config.heads_per_rank(ps.tp_size)
        self.padded_vocab_size = config.padded_vocab_size(ps.tp_size)
        self.tp_random = TPRandom(config.seed, ps.tp_rank, ps.device)
        self.transformer = nn.ModuleDict(dict(
            wte=VocabParallelEmbedding(config.vocab_size, config.hidden_size, ps, self.padded_vocab_size,
                                       device=device),
            wpe=nn.Embedding(config.seq_length, config.hidden_size, device=device),
            drop=nn.Dropout(config.hidden_dropout),
            h=nn.ModuleList(Block(config, ps, i, self.tp_random, device=device)
                            for i in range(config.num_layers)),
            ln_f=LayerNorm(config.hidden_size, config.layernorm_epsilon, device=device),
        ))
        mark_replicated(self.transformer.wpe.weight)
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    def _init_full(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The full (TP=1) value of a parameter, drawn from a generator seeded by its name."""
        cfg = self.config
        shape = full_shape(param)
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        std = cfg.init_method_std
        if name.endswith("c_proj.weight"):  # residual projections: GPT-2 / Megatron scaled init
            std = std / math.sqrt(2.0 * cfg.num_layers)
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        return torch.empty(shape).normal_(0.0, std, generator=gen)

    def initial_shard(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """This TP rank's initial value of parameter ``name`` (fp32, CPU): the matching slice of the
        seeded full weight. The data-parallel engine uses it to materialise a meta-device model
        straight into its buffers, one parameter at a time."""
        return shard_of(self._init_full(name, param), param, self.ps.tp_rank)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """TP-invariant init: each shard is the matching slice of the seeded full weight."""
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            p.copy_(self.initial_shard(name, p))

    # ------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None,
                last_only: bool = False):
        if last_only and labels is not None:
            raise ValueError("last_only=True computes one position's logits; it cannot give a loss over labels.")
        b, s = tokens.shape
        offset = kv_cache.length if kv_cache is not None else 0
        if offset + s > self.config.seq_length:
            raise ValueError(f"sequence of {offset + s} tokens is longer than seq_length={self.config.seq_length}.")
        if position_ids is None:
            position_ids = torch.arange(offset, offset + s, device=tokens.device).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(tokens) + self.transformer.wpe(position_ids))
        for block in self.transformer.h:
            x = block(x, attention_mask, kv_cache)
        if kv_cache is not None:
            kv_cache.length += s
        x = self.transformer.ln_f(x)
        if last_only:  # generation needs only the next token's logits
            x = x[:, -1:]
        # parallel LM head tied to the embedding: f, then a local matmul -> this rank's vocab shard
        logits = F.linear(copy_to_tp(x, self.ps), self.transformer.wte.weight)
        if labels is None:
            return logits
        losses = vocab_parallel_cross_entropy(logits, labels, self.ps, self.config.vocab_size)
        if loss_mask is None:
            return losses.mean()
        loss_mask = loss_mask.to(losses.dtype)
        return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)

    # -------------------------------------------------------------- interop
    @classmethod
    def from_hf(cls, model_or_dir, ps: Optional[ParallelState] = None, **overrides) -> "GPT":
        """Load a `transformers` GPT-2 (a ``GPT2LMHeadModel`` or a ``save_pretrained`` folder)."""
        from .hf import from_hf
        return from_hf(model_or_dir, ps, **overrides)

    def to_hf(self, out_dir: Optional[str] = None, tokenizer=None):
        """Gather the shards into a ``GPT2LMHeadModel`` (collective over TP); save it (and ``tokenizer``,
        in a form ``AutoTokenizer`` loads) if ``out_dir``, which must be new or empty."""
        from .hf import to_hf
        return to_hf(self, out_dir, tokenizer)


def gather_logits(logits: torch.Tensor, ps: ParallelState, vocab_size: int) -> torch.Tensor:
    """Full logits ``[*, vocab_size]`` from vocab shards (all-gather over TP; padding removed)."""
    return gather_from_tp(logits, ps)[..., :vocab_size]


def parameter_counts(config: GPTConfig, tp_size: int = 1) -> dict:
    """Parameter counts per TP rank, from shards built on the meta device (nothing allocated).

    Returns ``total`` (unpadded: equals :meth:`GPTConfig.num_parameters_formula`),
    ``total_padded`` (with the padded embedding rows), ``replicated`` (parameters
    every TP rank holds a copy of) and ``per_rank``: for each TP rank ``params``
    (with padding), ``params_unpadded`` and ``replicated``. Per-rank counts sum to
    ``total_padded + replicated * (tp - 1)``.
    """
    per_rank = []
    for r in range(tp_size):
        with torch.device("meta"):
            shard = GPT(config, ParallelState.for_virtual_rank(tp_size, r))
        n = n_unpadded = n_rep = 0
        for p in shard.parameters():
            n += p.numel()
            if getattr(p, "tp_sharded", False):
                n_unpadded += p.numel() // p.shape[p.partition_dim] * _unpadded_rows(p, r)
            else:
                n_unpadded += p.numel()
                n_rep += p.numel()
        per_rank.append(dict(params=n, params_unpadded=n_unpadded, replicated=n_rep))
        del shard
    replicated = per_rank[0]["replicated"]
    return dict(total=sum(r["params_unpadded"] for r in per_rank) - replicated * (tp_size - 1),
                total_padded=sum(r["params"] for r in per_rank) - replicated * (tp_size - 1),
                replicated=replicated, per_rank=per_rank, tp_size=tp_size,
                padded_vocab_size=config.padded_vocab_size(tp_size))


def _unpadded_rows(p: torch.Tensor, rank: int) -> int:
    """Entries along ``partition_dim`` of this rank's shard that are real (not vocabulary padding)."""
    start = sum(p.partition_sizes[:rank])
    return max(0, min(p.full_size, start + p.partition_sizes[rank]) - start)
