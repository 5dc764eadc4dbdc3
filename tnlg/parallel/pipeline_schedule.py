"""One iteration's micro batches through the pipeline: torch's schedules over tnlg's stages.

:class:`Pipeline` wraps this rank's :class:`~tnlg.model.stage.StageModel` chunks in
``torch.distributed.pipelining.PipelineStage`` s over ``ps.pp_group`` and runs one of torch's
schedules on them: ``1f1b`` (``Schedule1F1B``, the default, Megatron's non-interleaved
schedule), ``gpipe`` (``ScheduleGPipe``: every forward, then every backward) or ``interleaved``
(``ScheduleInterleaved1F1B``, ``v`` chunks per rank). torch's machinery is used as is (the stages are
``PipelineStage`` s that note their progress for a hang report, :mod:`~tnlg.parallel.stage_progress`):
micro batches are the equal row blocks of the concatenated local batch, activations and their
gradients go point-to-point between neighbouring stages.

The loss is the GPT's (:mod:`tnlg.parallel.loss`): on the last stage each micro batch's mean over its
loss-mask tokens (or, per-token, its sum over the global batch's count) through the vocab-parallel
cross-entropy (3 small all-reduces over TP), multiplied by the
engine's factor (``loss_scale / m``) before backward, so the gradients are those of the
mean over micro batches exactly as without a pipeline (``scale_grads=False``: torch does not
divide again). :meth:`Pipeline.run` returns the mean of the unscaled micro-batch losses on the
last stage. With context parallelism every micro batch is this CP rank's two chunks, the activations
between stages are its chunks' (``pp_group`` holds one CP rank's stages), and a micro batch's loss is
over the whole sequence (:func:`~tnlg.parallel.loss.loss_sum`: one ``[sum, tokens]`` all-reduce over the
CP group per micro batch, on the last stage).

Auxiliary losses (a mixture of experts'): each stage's chunks carry their layers' terms into the stage's own
backward with the gradient ``factor`` (:class:`~tnlg.parallel.loss.StageAuxLosses`, the model's
``aux_losses``), so the gradients are those of the micro batches' losses with their terms, as without a
pipeline; :attr:`Pipeline.aux` holds this rank's terms' means over the micro batches after :meth:`Pipeline.run`
(the training step sums them over the stages for the log).

Collectives per iteration, beyond the chunks' TP collectives: the schedule's send/recv of one
``[s, b, h]`` activation (the decoder's sequence-first layout) per micro batch and stage boundary in forward and of its gradient in
backward; then :func:`tie_embedding_grads`, one all-reduce of the word embedding's gradient over
the embedding group (first and last stage, tied embeddings only), in the gradient buffer's dtype
(16 bits under ``--bf16``/``--fp16``, fp32 with ``--accumulate-allreduce-grads-in-fp32``; at ZeRO 2/3
this rank's FSDP shard of it, after torch's schedule reduce-scattered it over DP).

Precision: the caller runs :meth:`Pipeline.run` under the training's autocast, so each stage's forward
is the PP 1 model's and the activations sent between stages come out in the training dtype (torch's
``PipelineStage`` learns their shapes and dtypes from a first forward). ZeRO 2/3: the stages run the
FSDP2 modules the engine left in ``model.pipeline_chunks`` (:class:`tnlg.optim.fsdp.ChunkModules`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..data.batch import Batch
from .loss import LossNormalisation, LossTerms, loss_sum
from .stage_progress import RecordedStage

__all__ = ["Pipeline", "SCHEDULES", "tie_embedding_grads"]

SCHEDULES = ("1f1b", "gpipe", "interleaved")


class _Stage(RecordedStage):
    """torch's ``PipelineStage`` (noting its progress for a hang report, :class:`RecordedStage`), whose
    metadata inference leaves the random streams as it found them.

    On a schedule's first step torch learns the activations' shapes by running each stage's forward
    once (``_compute_outputs``, used for nothing else); with dropout that forward would draw from
    torch's default generator and the chunk's TP generator, so a resumed run (a new schedule, whose
    first step is then not the run's first) would draw other masks than the uninterrupted one. Nor does it
    change the stage's buffers (a router's token counts, :mod:`tnlg.model.moe`) or its recorded auxiliary
    losses: that forward is not a micro batch's."""

    def _compute_outputs(self, *args, module, **kwargs):
        stage = module.stage
        tp_random, devices = stage.tp_random, [] if self.device.type == "cpu" else [self.device]
        saved = tp_random.state
        buffers = [(b, b.clone()) for b in stage.buffers()]
        aux = getattr(stage, "aux_losses", None)
        recorded = {} if aux is None else dict(aux.recorded)
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
            out = super()._compute_outputs(*args, module=module, **kwargs)
        tp_random.state = saved
        with torch.no_grad():
            for b, before in buffers:
                b.copy_(before)
        if aux is not None:
            aux.recorded = recorded
        return out


class Pipeline:
    """The schedule of ``micro_batches`` micro batches over this rank's stages of ``model`` (a
    :class:`tnlg.model.stage.StageModel`, which this library module does not import: the model sits above it)."""

    def __init__(self, model, micro_batches: int, schedule: str = "1f1b"):
        ps, v = model.ps, len(model.chunk_ranges)
        self.model, self.ps, self.micro_batches = model, ps, micro_batches
        # the chunks' modules: FSDP2's engine (ZeRO 2/3) leaves its sharded ones in ``model.pipeline_chunks``
        chunks = getattr(model, "pipeline_chunks", None) or [model.chunk(k) for k in range(v)]
        stages: list[Any] = [_Stage(chunks[k], k * ps.pp_size + ps.pp_rank, ps.pp_size * v, ps.device,
                                          group=ps.pp_group) for k in range(v)]
        self.schedule: Any
        if schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=self._loss, scale_grads=False)
        else:
            if v != 1:
                raise ValueError(f"schedule {schedule!r} runs one stage per rank, got {v} chunks.")
            cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            self.schedule = cls(stages[0], micro_batches, loss_fn=self._loss, scale_grads=False)
        self._factor = 1.0
        self._losses: list[torch.Tensor] = []
        self._normalisation = LossNormalisation()
        self.aux: dict[str, torch.Tensor] = {}

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro batch's loss (``target``: labels and mask stacked): its :class:`~tnlg.parallel.loss.LossTerms`
        (:func:`~tnlg.parallel.loss.loss_sum`) through the step's normalisation, as without a pipeline, times
        the engine's factor; the unscaled value is kept for :meth:`run`."""
        labels, mask = target[:, 0], target[:, 1]
        loss = self._normalisation(LossTerms(*loss_sum(logits, labels, mask, self.ps, self.model.config.vocab_size)))
        self._losses.append(loss.detach().float())
        return loss * self._factor

    def run(self, batches: Sequence[Union[Batch, dict]], factor: float,
            normalisation: LossNormalisation = LossNormalisation()) -> Optional[torch.Tensor]:
        """Forward and backward of every micro batch (:class:`~tnlg.data.batch.Batch`; the loss multiplied by
        ``factor`` before backward; ``normalisation``: the step's, per micro batch or per token); the mean
        micro-batch loss on the last stage, ``None`` on the others (without the auxiliary terms: this rank's
        are in :attr:`aux`, each its mean over the micro batches, fp32 ``[1]``)."""
        if len(batches) != self.micro_batches:
            raise ValueError(f"the pipeline was built for {self.micro_batches} micro batches, got {len(batches)}.")
        whole = Batch.cat([Batch.of(b) for b in batches])
        target = torch.stack([whole.labels, whole.mask_or_ones().long()], dim=1)
        documents = {k: v for k, v in (("position_ids", whole.position_ids), ("attention_mask", whole.attention_mask))
                     if v is not None}
        self._factor, self._losses, self._normalisation = factor, [], normalisation
        aux = getattr(self.model, "aux_losses", None)
        if aux is not None:
            aux.begin(factor)
        self.schedule.step(whole.tokens, target=target, return_outputs=False, **documents)  # (kwargs reach every stage)
        self.aux = {} if aux is None else {k: v / self.micro_batches for k, v in aux.recorded.items()}
        # the last m calls are the micro batches' (torch's first step also calls the loss once on a
        # stand-in output to learn the gradient's metadata)
        return torch.stack(self._losses[-self.micro_batches:]).mean() if self.ps.is_last_stage else None


def tie_embedding_grads(model, grad_of: Callable[[str], torch.Tensor]) -> None:
    """Sum the word embedding's gradient of the first and the last stage on both (one all-reduce over
    the embedding group, Megatron's), so that the tied copies take the same update; nothing for untied
    or frozen embeddings, at PP 1 or on the middle stages. ``grad_of(name)``: the gradient the engine steps."""
    ps = model.ps
    if ps.embedding_group is None or model.config.untie_embeddings_and_output_weights:
        return
    holds = ps.is_first_stage or ps.is_last_stage
    if holds and model.transformer["wte"].weight.requires_grad:  # (frozen under adapters: nothing to tie)
        dist.all_reduce(grad_of("transformer.wte.weight"), group=ps.embedding_group)
