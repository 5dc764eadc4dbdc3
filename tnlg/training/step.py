"""One training iteration: the micro batches of this rank, the loss averaged over them and over DP, the step.

As picotron's ``train_step``: ``engine.zero_grad()``; for each of the ``k``
micro batches (Megatron's sampler: the global sample order does not depend on
DP) a forward under autocast and ``engine.backward(loss)`` (only the last micro
step communicates gradients, bucketed and overlapped with backward); the loss is
averaged over micro batches and over DP (one tiny all-reduce, not read yet); then
``engine.step(lr, loss=...)`` (global-norm clipping across TP and DP, AdamW on the
owned ZeRO slice, parameters all-gathered) reads the loss with the gradient norm in
the iteration's one host synchronisation and makes no update if the loss is NaN/inf:
the run then stops, so no checkpoint is ever written from the bad state.

With a pipeline (``pipeline``: :class:`tnlg.parallel.pipeline_schedule.Pipeline`) the ``k``
micro batches go through its schedule in one ``engine.backward_all`` (gradients reduced over DP
once, at the step), the tied embedding's gradient is summed over the first and last stage, and
the loss (the last stage's mean over micro batches, plus every stage's auxiliary terms' means: a mixture of
experts' losses, which each stage back-propagates itself) is summed over the pipeline group, so every
rank reports the same loss, and the same auxiliary terms, as without a pipeline.

``--calculate-per-token-loss`` (Megatron's): each micro batch's loss is its sum divided by
``N / (k * dp)``, ``N`` the global batch's counted tokens (:meth:`tnlg.parallel.loss.LossNormalisation.per_token`),
so the same averaging over micro batches and DP yields ``sum / N`` as the loss and its gradient.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch

from ..data.batch import Batch
from ..model.moe import aux_loss_names, update_expert_bias
from ..parallel.loss import LossNormalisation
from ..parallel.mappings import all_reduce

__all__ = ["TrainingDiverged", "autocast_to", "next_batch", "forward_loss", "train_step"]


class TrainingDiverged(RuntimeError):
    """The DP-reduced loss is not finite; ``tnlg_status``: the exit status once every rank agreed on it."""
    tnlg_status: Optional[int] = None


def next_batch(dataset, sampler, device: torch.device) -> Batch:
    """The next micro batch of this rank (``sampler`` yields its sample indices), on ``device``."""
    return Batch.collate([dataset[i] for i in next(sampler)]).to(device, non_blocking=True)


def autocast_to(dtype: Optional[torch.dtype], device: torch.device):
    """Autocast to ``dtype`` on ``device`` (``None``: fp32, autocast off)."""
    return torch.autocast(device_type=device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def forward_loss(model, batch: Union[Batch, dict], autocast: Optional[torch.dtype],
                 normalisation: LossNormalisation = LossNormalisation()) -> torch.Tensor:
    """The model's loss of the batch under autocast to ``autocast`` (None: fp32): its loss terms
    (``model(batch)``) through ``normalisation`` (the mean over its loss-mask tokens, or per token)."""
    return forward_terms(model, batch, autocast, normalisation)[0]


def forward_terms(model, batch: Union[Batch, dict], autocast: Optional[torch.dtype],
                  normalisation: LossNormalisation = LossNormalisation()) -> tuple[torch.Tensor, dict]:
    """:func:`forward_loss`, and its auxiliary terms (a mixture of experts' losses, already in the loss)
    detached, by name, to be logged apart."""
    batch = Batch.of(batch)
    with autocast_to(autocast, batch.tokens.device):
        terms = model(batch)
        return normalisation(terms), {k: v.detach().float().reshape(1) for k, v in terms.aux.items()}


def train_step(model, engine, micro_batches: Iterable[Union[Batch, dict]], lr: float, *, autocast: Optional[torch.dtype],
               ps, iteration: int, pipeline=None, per_token_loss: bool = False) -> tuple[float, dict]:
    """Train one iteration (number ``iteration``) on ``micro_batches``; return ``(loss, engine.step's info)``.

    ``per_token_loss`` (``--calculate-per-token-loss``): the loss is the global batch's sum over the
    tokens counted in it (:mod:`tnlg.parallel.loss`), not the mean of the micro batches' means; the
    count is all-reduced over DP x CP before the first forward.

    Collectives: the model's TP all-reduces, the engine's gradient reduction over DP (last micro
    batch), one all-reduce of the loss over DP, and the engine step's (norm, parameter all-gather);
    with a pipeline also its point-to-point traffic, the tied embedding's all-reduce over the
    first and last stage and one all-reduce of the loss over the pipeline group.
    """
    engine.zero_grad()
    batches: Iterable[Batch] = (Batch.of(b) for b in micro_batches)  # (read as the steps go, but per token)
    normalisation, k = LossNormalisation(), 0
    if per_token_loss:  # (every micro batch's loss mask first: the global batch's token count)
        batches = list(batches)
        normalisation, k = LossNormalisation.per_token(batches, ps), len(batches)
    aux: dict[str, torch.Tensor] = {}
    if pipeline is None:
        losses = []
        for batch in batches:
            loss, terms = forward_terms(model, batch, autocast, normalisation)
            engine.backward(loss)
            losses.append(loss.detach().float())
            aux = {k: aux[k] + v if k in aux else v for k, v in terms.items()}
        mean = torch.cat([torch.stack(losses).mean().reshape(1), *aux.values()])  # (one all-reduce for all)
        mean[1:] /= max(1, len(losses))
        names = list(aux)
    else:
        mean, names = _pipeline_backward(pipeline, engine, list(batches), ps, autocast, normalisation)
    mean = all_reduce(mean, ps.dp_group) / ps.dp_size
    info = engine.step(lr, loss=mean[:1])  # reads the loss with the gradient norm: one host synchronisation
    if names:  # the auxiliary terms' means (in the loss already), logged apart: read after the step's read
        info["aux"] = dict(zip(names, mean[1:].tolist()))
    if not info["skipped"]:
        update_expert_bias(engine.model, ps)  # (DeepSeek-V3's balancing; nothing without expert biases)
    if normalisation.divisor is not None:  # (computed before the forward: reading it now costs no wait)
        info["counted_tokens"] = round(float(normalisation.divisor) * k * ps.dp_size)
    loss = info.pop("loss")
    if not math.isfinite(loss):
        raise TrainingDiverged(f"the training loss is {loss} at iteration {iteration}; stopping without "
                               f"an optimizer update (no checkpoint is written from this state). Lower --lr, "
                               f"raise --lr-warmup-iters, or check the data.")
    return loss, info


def _pipeline_backward(pipeline, engine, batches: list[Batch], ps, autocast: Optional[torch.dtype],
                       normalisation: LossNormalisation = LossNormalisation()) -> tuple[torch.Tensor, list[str]]:
    """Every micro batch through the pipeline's schedule under autocast to ``autocast`` (the stages'
    forward as without a pipeline: the activations sent between stages come out in the training
    dtype), each micro batch's loss through ``normalisation``. On every stage: ``[the mean micro-batch loss,
    then each auxiliary term's mean]`` (the terms summed over the stages, which hold different layers, and
    included in the loss) and the terms' names (:func:`~tnlg.model.moe.aux_loss_names`, the same on every
    stage, whether or not its layers add them). Collective: one all-reduce over the pipeline group."""
    # (imported here: torch's pipelining imports torch._dynamo, 1.3 CPU-s a process without a pipeline skips)
    from ..parallel.pipeline_schedule import tie_embedding_grads
    out: list = [None]

    def run(factor: float) -> None:
        with autocast_to(autocast, ps.device):
            out[0] = pipeline.run(batches, factor, normalisation)
        tie_embedding_grads(pipeline.model, engine.grad_view)
    engine.backward_all(run)
    mean = out[0].reshape(1) if out[0] is not None else torch.zeros(1, device=ps.device)
    names = list(aux_loss_names(pipeline.model.config))
    terms = [pipeline.aux[n].to(mean) if n in pipeline.aux else torch.zeros_like(mean) for n in names]
    return all_reduce(torch.cat([mean + sum(terms), *terms]), ps.pp_group), names
