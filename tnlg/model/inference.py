"""Forward-only passes through a pipeline: validation, ``tnlg eval`` and generation with a KV cache per stage.

At ``PP > 1`` a rank's model is a :class:`~tnlg.model.stage.StageModel` (the GPT's parameter
names, this rank's layers). :func:`forward_logits` runs one batch through every stage: the first
stage embeds the tokens, each stage runs its layers and sends the hidden state ``[s, b, h]`` (the
decoder's sequence-first layout, :mod:`tnlg.model.forward`) to the
rank of the next model chunk (``dist.send``/``dist.recv`` over ``pp_group``), the last stage applies
``ln_f`` and the LM head and returns this rank's vocabulary shard of the logits; the other stages
return ``None``. Each chunk runs :class:`~tnlg.model.stage.PipelineChunk`'s forward (the decoder's one
forward over the chunk's layers), the one training's schedule runs, with the stage's KV cache when decoding. Whatever the last stage computes
from them (a loss sum, a correct count, the next token) reaches every stage through
:func:`from_last_stage` (one broadcast over ``pp_group``), so every rank reports the same figures as
without a pipeline. A plain :class:`tnlg.GPT` goes through the same calls unchanged (its forward; no
pipeline communication), which is how the evaluation and generation code serves both.

Generation (:mod:`tnlg.generation`): each stage keeps the keys and values of its own layers
(a :class:`tnlg.model.kv_cache.KVCache` of the stage's model, a length per row); every new token's
hidden state ``[1, b, h]`` goes stage to stage, the last stage chooses the token exactly as without a pipeline and broadcasts it to
every stage, which all feed it next. Per new token: the layers' TP collectives, one send/recv per
stage boundary, the sampler's TP collectives on the last stage, one broadcast of ``[b]`` ids over PP.

Why not torch's schedules (``torch.distributed.pipelining``, used for training in
:mod:`tnlg.parallel.pipeline_schedule`): their eval path (``_PipelineSchedule.eval``, ``step`` without backward)
exists, but a schedule fixes its micro-batch count at construction and its stages fix the micro
batch's shapes at their first step (and infer them again whenever training and evaluation
alternate), and the loss function returns one scalar per micro batch. Evaluation batches vary
(LAMBADA pads each batch to its longest example, the last batch is smaller, the validation batches
need not be a multiple of the training's micro batches), the figures are token-weighted sums, and
generation feeds each token back to the first stage with a cache that grows; no torch schedule does
that. The pass here has no schedule of its own, but consecutive batches still overlap: a stage
starts the next batch as soon as the next stage has received the previous one.

Sequence parallelism is not used in these passes (the activations are ``[s, b, h]`` on every TP rank;
same numbers, more activation memory), as the GPT's own incremental decoding does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..config import GPTConfig
from ..parallel.pipeline import chunk_layers
from ..parallel.state import ParallelState
from .decoder import GPT
from .stage import StageModel

__all__ = ["forward_logits", "from_last_stage", "inference_model", "model_device", "stage_rank"]


def inference_model(config: GPTConfig, ps: ParallelState, device=None):
    """The model of this rank for inference: a :class:`tnlg.GPT` at PP 1, else the :class:`StageModel`
    of this pipeline rank with the layers split as evenly as possible (larger stages first, one chunk
    per rank). Parameter names are the GPT's either way, so a checkpoint loads by name."""
    if ps.pp_size == 1:
        return GPT(config, ps, device=device)
    return StageModel(config, ps, [chunk_layers(config.num_layers, ps.pp_size)[ps.pp_rank]], device=device)


def model_device(model) -> torch.device:
    """Where the model's parameters are (every stage holds some)."""
    return next(model.parameters()).device


def stage_rank(ps: ParallelState, pp_rank: int) -> int:
    """The global rank of pipeline stage ``pp_rank`` with this rank's ``(dp_rank, cp_rank, tp_rank)`` (stages
    are ``dp x cp x tp`` ranks apart: :class:`~tnlg.parallel.state.ParallelState`'s order)."""
    return ps.rank + (pp_rank - ps.pp_rank) * ps.dp_size * ps.cp_size * ps.tp_size


def from_last_stage(t: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``t`` as the last pipeline stage holds it, on every stage (in place: one broadcast over
    ``pp_group``); ``t`` itself at PP 1."""
    if ps.pp_size > 1:
        dist.broadcast(t, src=stage_rank(ps, ps.pp_size - 1), group=ps.pp_group)
    return t


def forward_logits(model, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   attention_mask: Optional[torch.Tensor] = None, kv_cache=None,
                   last_only: bool = False) -> Optional[torch.Tensor]:
    """This rank's vocabulary shard of the logits ``[b, s, V_pad / tp]`` (``[b, 1, ...]`` with
    ``last_only``) on the last pipeline stage, ``None`` on the others; a GPT's forward at PP 1.

    Every stage of a pipeline group calls it with the same ``tokens`` (their shape sizes the hidden
    states received) and arguments. Collectives: the layers' TP collectives, and at PP > 1 one
    send/recv of ``[s, b, h]`` per model-chunk boundary (chunk ``c`` to chunk ``c + 1``, on rank
    ``(c + 1) % P``)."""
    if not isinstance(model, StageModel):
        return model(tokens, position_ids=position_ids, attention_mask=attention_mask, kv_cache=kv_cache,
                     last_only=last_only)
    ps, cfg = model.ps, model.config
    b, s = tokens.shape
    model.start_position(s, kv_cache)
    p = next(model.parameters())
    chunks, x, logits = ps.pp_size * len(model.chunk_ranges), tokens, None
    for k, c in enumerate(range(ps.pp_rank, chunks, ps.pp_size)):  # this rank's model chunks, in pipeline order
        if c > 0 and ps.pp_size > 1:
            x = torch.empty(s, b, cfg.hidden_size, dtype=p.dtype, device=p.device)  # (sequence-first)
            dist.recv(x, src=stage_rank(ps, (c - 1) % ps.pp_size), group=ps.pp_group)
        x = model.chunk(k)(x, position_ids, attention_mask, kv_cache, last_only, sequence_parallel=False)
        if c == chunks - 1:
            logits = x
        elif ps.pp_size > 1:
            if x.dtype != p.dtype:  # the receiver sizes its buffer with the parameters' dtype
                raise RuntimeError(f"a stage's hidden state is {x.dtype}, its parameters {p.dtype}.")
            dist.send(x.contiguous(), dst=stage_rank(ps, (c + 1) % ps.pp_size), group=ps.pp_group)
    if kv_cache is not None:
        kv_cache.advance(s)
    return logits
