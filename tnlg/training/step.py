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
the loss (the last stage's mean over micro batches) is summed over the pipeline group, so every
rank reports the same loss as without a pipeline.

``--calculate-per-token-loss`` (Megatron's): each micro batch's loss is its sum divided by
``N / (k * dp)``, ``N`` the global batch's counted tokens (:func:`tnlg.parallel.loss.per_token_divisor`),
so the same averaging over micro batches and DP yields ``sum / N`` as the loss and its gradient.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from ..data.sampler import collate
from ..parallel.loss import per_token_divisor
from ..parallel.mappings import all_reduce

__all__ = ["TrainingDiverged", "autocast_to", "next_batch", "forward_loss", "train_step"]


class TrainingDiverged(RuntimeError):
    """The DP-reduced loss is not finite; ``tnlg_status``: the exit status once every rank agreed on it."""
    tnlg_status: Optional[int] = None


def next_batch(dataset, sampler, device: torch.device) -> dict:
    """The next micro batch of this rank (``sampler`` yields its sample indices), on ``device``."""
    batch = collate([dataset[i] for i in next(sampler)])
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def autocast_to(dtype: Optional[torch.dtype], device: torch.device):
    """Autocast to ``dtype`` on ``device`` (``None``: fp32, autocast off)."""
    return torch.autocast(device_type=device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def forward_loss(model, batch: dict, autocast: Optional[torch.dtype],
                 divisor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's loss of the batch under autocast to ``autocast`` (None: fp32): the mean over its loss-mask
    tokens, or with ``divisor`` (:func:`~tnlg.parallel.loss.per_token_divisor`) its sum divided by it."""
    extra = {} if divisor is None else dict(loss_divisor=divisor)
    with autocast_to(autocast, batch["tokens"].device):
        return model(batch["tokens"], labels=batch["labels"], loss_mask=batch.get("loss_mask"),
                     position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask"), **extra)


def train_step(model, engine, micro_batches: Iterable[dict], lr: float, *, autocast: Optional[torch.dtype],
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
    divisor, k = None, 0
    if per_token_loss:  # (every micro batch's loss mask first: the global batch's token count)
        micro_batches = list(micro_batches)
        divisor, k = per_token_divisor(micro_batches, ps), len(micro_batches)
    if pipeline is None:
        losses = []
        for batch in micro_batches:
            loss = forward_loss(model, batch, autocast, divisor)
            engine.backward(loss)
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean().reshape(1)
    else:
        mean = _pipeline_backward(pipeline, engine, list(micro_batches), ps, autocast, divisor)
    mean = all_reduce(mean, ps.dp_group) / ps.dp_size
    info = engine.step(lr, loss=mean)  # reads the loss with the gradient norm: one host synchronisation
    if divisor is not None:  # (computed before the forward: reading it now costs no wait)
        info["counted_tokens"] = round(float(divisor) * k * ps.dp_size)
    loss = info.pop("loss")
    if not math.isfinite(loss):
        raise TrainingDiverged(f"the training loss is {loss} at iteration {iteration}; stopping without "
                               f"an optimizer update (no checkpoint is written from this state). Lower --lr, "
                               f"raise --lr-warmup-iters, or check the data.")
    return loss, info


def _pipeline_backward(pipeline, engine, batches: list[dict], ps, autocast: Optional[torch.dtype],
                       divisor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every micro batch through the pipeline's schedule under autocast to ``autocast`` (the stages'
    forward as without a pipeline: the activations sent between stages come out in the training
    dtype); the mean micro-batch loss on every stage."""
    # (imported here: torch's pipelining imports torch._dynamo, 1.3 CPU-s a process without a pipeline skips)
    from ..parallel.pipeline_schedule import tie_embedding_grads
    out: list = [None]

    def run(factor: float) -> None:
        with autocast_to(autocast, ps.device):
            extra = () if divisor is None else (divisor,)  # (the per-token normalisation's divisor)
            out[0] = pipeline.run(batches, factor, *extra)
        tie_embedding_grads(pipeline.model, engine.grad_view)
    engine.backward_all(run)
    mean = out[0].reshape(1) if out[0] is not None else torch.zeros(1, device=ps.device)
    return all_reduce(mean, ps.pp_group)
