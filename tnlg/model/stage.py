"""Pipeline stages of the GPT: the module of one rank's stages. Which layers each chunk holds and which
rank runs it is the layer split of :mod:`tnlg.parallel.pipeline` (:func:`~tnlg.parallel.pipeline.chunk_layers`).

:class:`StageModel` is what one rank trains: the layers of its chunks, plus the word and position
embeddings on the first stage and the final LayerNorm and LM head on the last, built from the GPT's
own pieces (:mod:`tnlg.model.decoder`) under the GPT's parameter names (``transformer.h.<global index>``),
so every parameter is initialised exactly as the PP=1 model's of that name and a stage's
parameters are a subset of the PP=1 model's. With tied input/output embeddings the last stage holds
its own copy of ``transformer.wte.weight`` (the LM head): the copies start equal and stay equal
because their gradients are all-reduced over the embedding group (first and last stage) before
the optimizer step (:mod:`tnlg.parallel.pipeline_schedule`); the last stage's copy is marked
``pipeline_duplicate`` so the gradient norm counts it once.

Collectives of a chunk's forward and backward: the TP collectives of the GPT's layers (the
embedding's all-reduce, two per block, the LM head's ``f``; with sequence parallelism the GPT's
reduce-scatters and all-gathers instead); none across stages (the schedule sends activations and
gradients point-to-point). The activations sent between stages are the decoder's, sequence-first
``[s, b, h]`` (with sequence parallelism this rank's positions ``[s_r, b, h]``).

Documents (``--reset-position-ids``, ``--reset-attention-mask``): a chunk takes the micro batch's
``position_ids`` and ``attention_mask`` as keyword arguments. torch's schedules (2.13) hand the
keyword arguments of ``schedule.step`` to every stage, split into micro batches as the inputs
are, while only the activation travels between stages; every pipeline rank reads the same batch,
so each stage gets its micro batch's mask from its own copy: no extra send per boundary, and no
second stage output (the tokens) from which every stage would rebuild the mask.

Auxiliary losses (a mixture of experts' balancing and z losses, which its layers add to the forward's
:attr:`~tnlg.model.forward.ForwardContext.aux`): a chunk's output carries its layers' terms into the stage's
backward (:class:`tnlg.parallel.loss.StageAuxLosses`, ``StageModel.aux_losses``), since only the last stage's
loss is back-propagated; the pipeline reads their values for the log.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..config import GPTConfig, stage_parts
from ..parallel.loss import StageAuxLosses
from ..parallel.state import ParallelState
from .attention import KVCache
from .decoder import DecoderBase

__all__ = ["StageModel", "PipelineChunk"]


class StageModel(DecoderBase):
    """The layers of one pipeline rank's chunks (``chunks``: their global layer indices, this rank's
    in order), with the embeddings on the first stage and ``ln_f`` + LM head on the last.

    Parameter names are the GPT's; :meth:`chunk` gives the module each pipeline stage runs. ``aux_losses``: the
    auxiliary losses its chunks' forwards carry into their backward (module docstring)."""

    def __init__(self, config: GPTConfig, ps: ParallelState, chunks: list[range], device=None):
        super().__init__(config, ps)
        self.chunk_ranges = list(chunks)
        self.aux_losses = StageAuxLosses()
        tied = not config.untie_embeddings_and_output_weights
        parts: dict = dict(h=nn.ModuleDict({str(i): self.part("h", device, layer=i)
                                            for r in self.chunk_ranges for i in r}))
        names = stage_parts(config, ps.is_first_stage, ps.is_last_stage)
        parts.update((name, self.part(name, device)) for name in names if name != "lm_head")
        self.transformer = nn.ModuleDict(parts)
        if "lm_head" in names:
            self.lm_head = self.part("lm_head", device)
        if ps.is_last_stage and tied and not ps.is_first_stage:
            # the first stage's copy is the one counted
            setattr(self.transformer["wte"].weight, "pipeline_duplicate", True)  # noqa: B010 (an attribute of a tensor)

    def chunk(self, k: int) -> "PipelineChunk":
        """The module of this rank's ``k``-th chunk (global chunk ``k * P + pp_rank``)."""
        c = k * self.ps.pp_size + self.ps.pp_rank
        return PipelineChunk(self, self.chunk_ranges[k], first=c == 0,
                             last=c == self.ps.pp_size * len(self.chunk_ranges) - 1)


class PipelineChunk(nn.Module):
    """One pipeline stage's forward over the :class:`StageModel`'s modules (it registers none itself,
    so the engine sees each parameter once): tokens ``[b, s]`` -> hidden ``[s, b, h]`` (sequence-first,
    :mod:`tnlg.model.forward`) on the first stage, hidden -> hidden in the middle, hidden -> this rank's
    vocabulary shard of the logits on the last, handed out batch-first ``[b, s, V_pad / tp]`` (a
    transposed view). Training's schedule (torch's ``PipelineStage``) calls it with
    the activation and the documents' keyword arguments; the forward-only passes
    (:func:`tnlg.model.inference.forward_logits`) also with a KV cache."""

    stage: StageModel

    def __init__(self, stage: StageModel, layers: range, first: bool, last: bool):
        super().__init__()
        object.__setattr__(self, "stage", stage)  # not a submodule: its parameters belong to the StageModel
        self.layers, self.first, self.last = layers, first, last

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None,
                last_only: bool = False, sequence_parallel: bool = True) -> torch.Tensor:
        """The stage's part of the decoder's one forward (:meth:`~tnlg.model.decoder.DecoderBase.run`).
        ``position_ids`` ``[b, s]`` (first stage) and ``attention_mask`` (document ids ``[b, s]`` or a mask ``[b, s, s]``; every stage): a
        micro batch's per-document positions and block-diagonal mask (``--reset-position-ids`` /
        ``--reset-attention-mask``), as the GPT takes them; ``None``: causal, positions from 0 (from
        each row's cache length with ``kv_cache``). ``kv_cache``: the stage's keys and values (its
        lengths are advanced by the caller, once every chunk has run); ``last_only``: the logits of
        the last position only; ``sequence_parallel=False``: every TP rank holds the whole sequence
        ``[s, b, h]`` whatever the config says (the forward-only passes, whose batches vary in length).
        Sequence-parallel training: the activations between stages are this rank's positions
        ``[s_r, b, h]``, as between the GPT's TP regions. The layers' auxiliary losses ride on the output into
        the backward (:class:`~tnlg.parallel.loss.StageAuxLosses`)."""
        out, ctx = self.stage.run(x, self.layers, self.first, self.last, position_ids=position_ids,
                                  attention_mask=attention_mask, kv_cache=kv_cache, last_only=last_only,
                                  sequence_parallel=sequence_parallel)
        out = self.stage.aux_losses.carry(out, ctx.aux)
        return ctx.batch_first(out) if self.last else out
