"""The decoder whole (:class:`GPT`) and its one forward (:meth:`DecoderBase.run`); embeddings and LM head."""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Optional, Union, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from ..config import GPTConfig, stage_parts
from ..errors import UserError
from ..parallel.context import TokenPositions
from ..parallel.initialization import InitMethod, SelfInitializing, init_normal
from ..parallel.layers import VocabParallelEmbedding, column_parallel_linear
from ..data.batch import Batch
from ..parallel.loss import LossNormalisation, LossTerms, loss_sum
from ..parallel.mappings import reduce_scatter_to_sequence_parallel, sequence_sizes
from ..parallel.random import TPRandom
from ..parallel.rotary import rotary_angles
from ..parallel.sharding import ShardSpec
from ..parallel.state import ParallelState
from .block import Block, _dropout
from .forward import ForwardContext
from .kv_cache import KVCache
from .norms import make_norm
from .spec import block_spec

__all__ = ["DecoderBase", "GPT", "PositionEmbedding", "OutputLayer"]


class PositionEmbedding(SelfInitializing, nn.Module):
    """Learned position embeddings ``[max_position_embeddings, hidden]``, replicated over TP; no communication."""

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

    def forward(self, x: torch.Tensor, sequence_sizes: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """This rank's vocabulary shard of the logits of ``x`` ``[s, b, h]`` (sequence-parallel: this rank's
        positions ``[s_r, b, h]`` and every rank's ``sequence_sizes``): a column-parallel matmul (``f``:
        backward an all-reduce over TP; sequence-parallel an all-gather, backward a reduce-scatter)."""
        return column_parallel_linear(x, self.weight, None, self.ps, sequence_sizes)


class DecoderBase(nn.Module):
    """The decoder, whole (:class:`GPT`) or one pipeline rank's part of it (:class:`tnlg.model.stage.StageModel`):
    every module built by name (:meth:`part`, under the GPT's parameter names, so each is initialised as
    the GPT's of that name), the one forward over a range of its layers (:meth:`run`: the embedding when it
    holds the first, the head when it holds the last), the sequence split and the initial value of a
    parameter. The parallel layout is decided when it is built: the attention core of every layer
    (:class:`tnlg.model.attention.ParallelAttention`) and the tokens' default positions
    (:class:`tnlg.parallel.context.TokenPositions`: with context parallelism, this rank's chunks')."""

    transformer: nn.ModuleDict
    lm_head: nn.Module  # (untied only)

    def __init__(self, config: GPTConfig, ps: ParallelState):
        super().__init__()
        config.check_tensor_parallel(ps.tp_size)
        self.config, self.ps = config, ps
        self.padded_vocab_size = config.padded_vocab_size(ps.tp_size)
        self.tp_random = TPRandom(config.seed, ps.tp_rank, ps.device)
        self.sequence_parallel = config.sequence_parallel
        self.positions = TokenPositions(ps)

    def layout(self) -> dict[str, ShardSpec]:
        """How every parameter of the whole GPT this model (or pipeline stage) belongs to splits over its TP
        size, by name: :meth:`GPT.describe` of its configuration, what checkpoints save and load by."""
        return GPT.describe(self.config, self.ps.tp_size)

    def part(self, name: str, device=None, *, layer: Optional[int] = None) -> nn.Module:
        """The module ``transformer.<name>`` (``wte``, ``wpe``, ``drop``, ``h`` with ``layer`` its global index,
        ``ln_f``) or ``lm_head`` (the untied LM head); ``device`` ``None``: the parallel state's (for a virtual
        state, the current default device, e.g. ``torch.device("meta")``). A block is built from its layer's
        :class:`~tnlg.model.spec.BlockSpec`."""
        cfg, ps = self.config, self.ps
        device = device if device is not None else (None if ps.virtual else ps.device)
        init, seed, h = init_normal(cfg.init_method_std), cfg.seed, cfg.hidden_size
        if (name == "h") != (layer is not None):
            raise ValueError(f"part({name!r}, layer={layer!r}): a block is part('h', layer=i), other parts take "
                             f"no layer.")
        key = name if name == "lm_head" else f"transformer.{name}" if layer is None else f"transformer.h.{layer}"
        if name == "wte":
            return VocabParallelEmbedding(cfg.vocab_size, h, ps, self.padded_vocab_size, device=device,
                                          init_method=init, seed=seed, init_key=key)
        if name == "wpe" and cfg.position_embedding_type == "learned_absolute":
            return PositionEmbedding(cfg.max_position_embeddings, h, init, seed, key, device)
        if name == "drop":
            return nn.Dropout(cfg.hidden_dropout)
        if layer is not None:
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(f"the GPT has layers 0..{cfg.num_layers - 1}, not {layer}.")
            return Block(cfg, ps, layer, self.tp_random, device=device, init_key=key,
                         spec=block_spec(cfg, ps, layer))
        if name == "ln_f":
            return make_norm(cfg, ps, key, device)
        if name == "lm_head":
            return OutputLayer(cfg.vocab_size, h, ps, self.padded_vocab_size, init, seed, key, device)
        raise ValueError(f"the GPT has no part {name!r}.")

    @property
    def output_weight(self) -> torch.Tensor:
        """This rank's vocabulary rows of the LM head: the word embedding's, or the untied output layer's."""
        head = self.lm_head if self.config.untie_embeddings_and_output_weights else self.transformer["wte"]
        return cast(torch.Tensor, cast(nn.Module, head).weight)

    def initial_shard(self, name: str, param: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This TP rank's initial value of parameter ``name`` (fp32, CPU), from the layer that owns
        it: the matching slice of the seeded full weight (``param``: the parameter as built, when
        a wrapper has replaced it). The data-parallel engine uses it to
        materialise a meta-device model straight into its buffers, one parameter at a time."""
        owner, _, leaf = name.rpartition(".")
        return cast(SelfInitializing, self.get_submodule(owner)).initial_shard(leaf, param)

    def start_position(self, seq_len: int, kv_cache: Optional[KVCache]) -> int:
        """The position of the first of ``seq_len`` new tokens: the cache's length (its longest row's, rows
        at their own lengths), or 0 without one; a ``ValueError`` when they would run past the model's
        positions (``max_position_embeddings``) or the cache."""
        offset = kv_cache.start(seq_len) if kv_cache is not None else 0
        if offset + seq_len > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {offset + seq_len} tokens is longer than the model's "
                             f"max_position_embeddings={self.config.max_position_embeddings} positions.")
        return offset

    def sequence_split(self, seq_len: int, incremental: bool = False) -> Optional[tuple[int, ...]]:
        """Every TP rank's positions of a ``seq_len`` sequence when this call runs sequence-parallel,
        else ``None``: off without TP, when turned off, for incremental decoding, and for sequences
        shorter than TP (a rank would hold no position)."""
        tp = self.ps.tp_size
        if not self.sequence_parallel or tp == 1 or incremental or seq_len < tp:
            return None
        return sequence_sizes(seq_len, tp)

    def block(self, i: int) -> nn.Module:
        """Transformer block ``i`` (global index) of those this model holds."""
        h = self.transformer["h"]
        if isinstance(h, nn.ModuleDict):  # a pipeline stage's: by global index
            return h[str(i)]
        return cast(nn.ModuleList, h)[i]

    def run(self, x: torch.Tensor, layers: Iterable[int], first: bool = True, last: bool = True, *,
            position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
            kv_cache: Optional[KVCache] = None, last_only: bool = False,
            sequence_parallel: bool = True) -> tuple[torch.Tensor, ForwardContext]:
        """The decoder's one forward: the blocks ``layers``, after the embedding when ``first`` (``x``: tokens
        ``[b, s]``), before ``ln_f`` and the LM head when ``last`` (the output: this rank's vocabulary shard of
        the logits, sequence-first ``[s, b, V_pad / tp]``, ``[1, b, ...]`` with ``last_only``; the returned
        context's :meth:`~ForwardContext.batch_first` turns them); else hidden states in and out,
        sequence-first ``[s, b, h]`` (sequence-parallel this rank's positions ``[s_r, b, h]``). The whole GPT
        is ``run(tokens, range(L))``; a pipeline chunk runs its layers.

        ``position_ids`` ``[b, s]`` and ``attention_mask`` (document ids ``[b, s]``, or ``[b, s, s]`` bool; with CP the whole sequence's document
        ids ``[b, s]``): per-document positions and mask; ``None``: causal, positions from 0 (with ``kv_cache``
        each row's from its length; with CP this rank's chunks'). ``kv_cache``: keys and values of past
        positions (:mod:`tnlg.model.kv_cache`; its lengths are advanced by the caller, once every layer has
        run). Sequence parallelism runs when configured and ``sequence_parallel``, except for incremental
        decoding and sequences shorter than TP;
        between pipeline stages (``first`` false) the sequence is a training sample's (``seq_length``, this
        CP rank's share)."""
        incremental = kv_cache is not None or last_only
        self.positions.check(incremental)
        n = x.shape[1] if first else self.positions.local_length(self.config.seq_length)
        sp = self.sequence_split(n, incremental or not sequence_parallel)
        s = x.shape[1] if first else x.shape[0] if sp is None else sum(sp)  # ([b, s] tokens, [s, b, h], [s_r, b, h])
        offset = self.start_position(s, kv_cache)
        if position_ids is None:  # (with a cache each row's from its own length)
            position_ids = self.positions(s, offset, x.device) if kv_cache is None else kv_cache.positions(s)
        ctx = ForwardContext(sp, self.rotary(s, position_ids), attention_mask, kv_cache, last_only)
        if first:
            x = self.embed(x, position_ids, sp)
        for i in layers:
            x = self.block(i)(x, ctx)
        return (self.head(x, ctx) if last else x), ctx

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor, sp: Optional[tuple[int, ...]]) -> torch.Tensor:
        """Word plus (learned) position embeddings, then dropout, sequence-first: the tokens ``[b, s]`` are
        looked up transposed (``tokens.t()``: no copy of the activations) into ``[s, b, h]``, or with ``sp``
        (every rank's positions) this rank's positions ``[s_r, b, h]``. Collectives: the word embedding's
        all-reduce over TP; with ``sp`` a reduce-scatter of the partial word embeddings instead, to which each
        rank adds its positions' (backward: an all-gather)."""
        t = self.transformer
        wte, drop = cast(VocabParallelEmbedding, t["wte"]), cast(nn.Dropout, t["drop"])
        positions = t["wpe"](position_ids).transpose(0, 1) if "wpe" in t else None  # [s, b or 1, h]
        if sp is None:
            x = wte(tokens.t())
            x = x if positions is None else x + positions
        else:
            x = reduce_scatter_to_sequence_parallel(wte.local_lookup(tokens.t()), self.ps, sp, inplace=True,
                                                    replicated=positions)
        return _dropout(drop, x, self.tp_random, sp is not None)

    def rotary(self, seq_len: int, position_ids: Optional[torch.Tensor], offset: int = 0, device=None):
        """Rope's ``(cos, sin)`` (fp32 ``[b, 1, s, rotary_dim]``) at ``position_ids`` (``None``: the default
        positions of ``seq_len`` tokens from ``offset``), or ``None`` without rope. Every block of a forward
        shares them."""
        cfg = self.config
        if cfg.position_embedding_type != "rope":
            return None
        if position_ids is None:
            position_ids = self.positions(seq_len, offset, device)
        return rotary_angles(position_ids, cfg.rotary_dim, cfg.rotary_base, cfg.rope_scaling)

    def head(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``ln_f`` and the parallel LM head (tied to the embedding, or untied): this rank's vocabulary
        shard of the logits, sequence-first ``[s, b, V_pad / tp]`` (``[1, b, ...]`` with ``last_only``: the
        next token's). Collectives: ``f`` (backward: an all-reduce over TP); sequence-parallel an all-gather
        of the sequence instead (backward: a reduce-scatter)."""
        x = self.transformer["ln_f"](x, ctx.sequence_parallel)
        if ctx.last_only:  # generation needs only the next token's logits (each row's last fed token's)
            x = x[-1:] if ctx.kv_cache is None else ctx.kv_cache.last_positions(x)
        if self.config.untie_embeddings_and_output_weights:  # the output layer, called
            return self.lm_head(x, ctx.sp)
        # tied: the word embedding's rows as the output weight (as PEFT's tied head: an adapter on the
        # embedding's lookup does not change the output projection)
        return column_parallel_linear(x, self.output_weight, None, self.ps, ctx.sp)


class GPT(DecoderBase):
    """GPT-2 decoder whose weights are split over ``ps.tp_group``.

    ``model(tokens)`` returns this rank's vocabulary shard of the logits
    ``[b, s, V_pad / tp]`` (use :func:`gather_logits` for the full ones): a batch-first view of the
    decoder's sequence-first ``[s, b, V_pad / tp]`` (:mod:`tnlg.model.forward`);
    ``model(tokens, labels=labels)`` returns the mean loss (fp32) through the
    vocab-parallel cross-entropy (:func:`tnlg.parallel.loss.loss_sum`). ``labels`` are aligned with ``tokens``
    (``tokens = sample[:-1]``, ``labels = sample[1:]``); the model does not shift.
    ``loss_mask`` (same shape, 0/1) excludes targets from the mean. ``model(batch)`` (a
    :class:`~tnlg.data.batch.Batch`) returns the batch's :class:`~tnlg.parallel.loss.LossTerms` (the sum, the
    count and the layers' auxiliary terms), which the training step normalises
    (:class:`~tnlg.parallel.loss.LossNormalisation`: per micro batch or per token). ``last_only``
    computes the logits of the last position only (generation).

    ``config.sequence_parallel`` (with TP > 1) splits the activations between the TP regions
    along the sequence (:mod:`tnlg.model`'s docstring); the attribute ``sequence_parallel`` turns it off or
    on for later calls without changing any parameter.
    """

    def __init__(self, config: GPTConfig, ps: Optional[ParallelState] = None, device=None):
        super().__init__(config, ps or ParallelState.single())
        self.heads_per_rank = config.heads_per_rank(self.ps.tp_size)
        names = stage_parts(config, first=True, last=True)
        parts = {name: self.part(name, device) for name in names if name not in ("ln_f", "lm_head")}
        parts["h"] = nn.ModuleList(self.part("h", device, layer=i) for i in range(config.num_layers))
        parts["ln_f"] = self.part("ln_f", device)
        self.transformer = nn.ModuleDict(parts)
        if "lm_head" in names:
            self.lm_head = self.part("lm_head", device)

    @staticmethod
    def describe(config: GPTConfig, tp_size: int) -> dict[str, ShardSpec]:
        """How every parameter splits over ``tp_size`` ranks, by name, in the model's order (checkpoints
        reshard from it, the planner counts from it): read from the layers themselves, built for a
        virtual TP rank on the meta device (nothing allocated; each parameter's mark holds every rank's
        size), once per configuration and TP size. A TP size the configuration cannot split over: a
        :class:`~tnlg.errors.UserError` naming it."""
        try:
            config.check_tensor_parallel(tp_size)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        fields = tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(config))  # (hashable)
        return dict(_shard_specs(fields, tp_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """TP-invariant init of every layer (each shard is the matching slice of the seeded full weight)."""
        for m in self.modules():
            if isinstance(m, SelfInitializing):
                m.reset_parameters()

    def forward(self, tokens: Union[torch.Tensor, Batch], labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None,
                last_only: bool = False):
        batch = tokens if isinstance(tokens, Batch) else None
        if batch is not None:  # a typed batch: its loss terms, normalised by the caller
            if labels is not None or loss_mask is not None or position_ids is not None or \
                    attention_mask is not None or kv_cache is not None or last_only:
                raise ValueError("model(batch) takes everything from the Batch; give no other argument.")
            tokens, labels, loss_mask = batch.tokens, batch.labels, batch.loss_mask
            position_ids, attention_mask = batch.position_ids, batch.attention_mask
        tokens = cast(torch.Tensor, tokens)
        if last_only and labels is not None:
            raise ValueError("last_only=True computes one position's logits; it cannot give a loss over labels.")
        logits, ctx = self.run(tokens, range(self.config.num_layers), position_ids=position_ids,
                               attention_mask=attention_mask, kv_cache=kv_cache, last_only=last_only)
        if kv_cache is not None:
            kv_cache.advance(tokens.shape[1])
        if labels is None:
            return ctx.batch_first(logits)
        # the loss is computed sequence-first, as the logits come
        mask = None if loss_mask is None else ctx.like_head(loss_mask)
        terms = LossTerms(*loss_sum(logits, ctx.like_head(labels), mask, self.ps, self.config.vocab_size), aux=ctx.aux)
        return terms if batch is not None else LossNormalisation()(terms)


@functools.lru_cache(maxsize=32)
def _shard_specs(config_fields: tuple, tp_size: int) -> tuple[tuple[str, ShardSpec], ...]:
    """:meth:`GPT.describe` of the configuration with these field values (a tuple, so it can key the cache).
    The build allocates nothing, so no dispatch mode active around the call (a fake-tensor run, a memory
    tracker counting a checkpoint save) sees it, and its counts do not depend on whether it was cached."""
    with _disable_current_modes(), torch.device("meta"):
        model = GPT(GPTConfig(*config_fields), ParallelState.for_virtual_rank(tp_size))
    return tuple((name, ShardSpec.of(p)) for name, p in model.named_parameters())
