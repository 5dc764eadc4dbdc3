"""The language-model loss in one place: a micro batch's masked loss sum and token count, and its normalisation.

:func:`loss_sum` is the one function that turns this rank's logit shard into ``(sum of token losses,
number of tokens counted)`` for a micro batch (the vocab-parallel cross-entropy, the ``loss_mask``
applied, and with context parallelism both summed over the CP group); the GPT's forward with
``labels``, the pipeline schedule's last stage, and evaluation all call it.

:class:`LossNormalisation` is the one choice of normalisation (docs/formulas.md, "Loss normalisation"):

* **per micro batch** (Megatron's default; ``divisor=None``): ``sum / count``, the mean over the micro
  batch's counted tokens; the engine averages these means over the ``k`` micro batches and over DP;
* **per token** (Megatron's ``--calculate-per-token-loss``): the whole global batch's sum divided by
  the number of tokens counted in it (``N``, over every micro batch and every DP, CP and PP rank).
  The count is known from the loss masks before any forward (:meth:`LossNormalisation.per_token`:
  one all-reduce over DP x CP per step); each micro batch's loss is ``sum / (N / (k * dp))``, so that the
  engine's averaging (``1 / k`` over micro batches, ``1 / (dp * cp)`` over DP x CP, with each CP rank's
  gradient being ``cp`` times its local part, below) leaves the gradient of ``sum_all / N``, and the
  logged mean of the micro batches' values over ``k`` and DP is ``sum_all / N`` itself.

**Context parallelism.** Each CP rank holds two chunks of every sequence. The returned sum's value is
the whole sequence's (one all-reduce of ``[sum, count]`` over the CP group, no gradient), the same
on every CP rank; its gradient is that of ``cp * local_sum`` (what a differentiable all-reduce whose
backward sums every rank's equal upstream gradient gives, without the backward collective). The
engine averages gradients over DP x CP, which divides by ``cp`` again, so the reduced gradient is
that of the whole sequence's loss (as Megatron scales by the CP size).

**Auxiliary losses in a pipeline.** Without a pipeline a micro batch's auxiliary terms (a mixture of experts'
balancing and z losses, :attr:`LossTerms.aux`) are added to its loss, whose backward reaches every layer. With
one, each stage's layers add theirs during the stage's own forward, which the last stage's loss does not see:
:class:`StageAuxLosses` makes them part of the stage's backward instead (megatron-core's
``MoEAuxLossAutoScaler``): the stage's output activation passes through an identity whose backward also gives
every auxiliary term the gradient ``scale`` (the engine's factor, loss scale / micro batches, the one the LM
loss is multiplied by), which is the gradient the term gets as part of the loss without a pipeline. Its values
are kept (detached, summed over the step's micro batches) for the log.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..data.batch import Batch
from .state import ParallelState
from .vocab import vocab_parallel_cross_entropy

__all__ = ["loss_sum", "LossTerms", "LossNormalisation", "StageAuxLosses"]


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor], ps: ParallelState,
             vocab_size: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the token losses, tokens counted)`` of a micro batch, both ``dtype`` scalars.

    ``logits``: this rank's vocabulary shard ``[*, V_pad / tp]``; ``labels`` and ``loss_mask`` (0/1,
    ``None``: every token counts) ``[*]``, in the logits' layout. Collectives: the cross-entropy's three
    ``[*]`` all-reduces over TP; with CP one all-reduce of ``[sum, count]`` over the CP group (module
    docstring: the sum's value is the whole sequence's, its gradient ``cp`` times this rank's part)."""
    losses = vocab_parallel_cross_entropy(logits, labels, ps, vocab_size).to(dtype)
    mask = torch.ones_like(losses) if loss_mask is None else loss_mask.to(dtype)
    local, count = (losses * mask).sum(), mask.sum()
    if ps.cp_size == 1:
        return local, count
    totals = torch.stack([local.detach(), count])
    dist.all_reduce(totals, group=ps.cp_group)
    if not local.requires_grad:
        return totals[0], totals[1]
    scaled = local * ps.cp_size
    return scaled + (totals[0] - scaled).detach(), totals[1]


class LossTerms(NamedTuple):
    """What one micro batch's forward gives the loss: ``total`` (the sum of its token losses) and ``counted``
    (the tokens counted), both fp32 scalars (:func:`loss_sum`), and ``aux``: named auxiliary losses the
    model's layers added during the forward (:attr:`tnlg.model.forward.ForwardContext.aux`), each a
    scalar already weighted by its coefficient, added to the language-model loss as they are. (A named
    tuple, so wrappers that walk a module's outputs for tensors, DeepSpeed's ZeRO-3 hooks, see them.)"""

    total: torch.Tensor
    counted: torch.Tensor
    aux: Mapping[str, torch.Tensor] = MappingProxyType({})


@dataclass(frozen=True)
class LossNormalisation:
    """The one choice of how a micro batch's :class:`LossTerms` become the loss to back-propagate and log
    (module docstring): ``divisor`` ``None``: ``total / counted`` (its mean over the counted tokens; 0 when
    none is counted), else ``total / divisor`` (the per-token normalisation, :meth:`per_token`); then plus
    every auxiliary term. The training step makes one per iteration, and the same one serves the
    micro batches with and without a pipeline."""

    divisor: Optional[torch.Tensor] = None

    def __call__(self, terms: LossTerms) -> torch.Tensor:
        loss = terms.total / (terms.counted.clamp(min=1.0) if self.divisor is None else self.divisor)
        for value in terms.aux.values():
            loss = loss + value
        return loss

    @classmethod
    def per_token(cls, batches: Iterable[Batch], ps: ParallelState) -> "LossNormalisation":
        """``N / (k * dp)`` as the divisor of each of this rank's ``k`` micro batches, ``N`` the tokens
        counted in the whole global batch (at least 1). ``batches``: this rank's micro batches of the step
        (this CP rank's chunks at CP > 1; every pipeline stage reads the same ones). Collective: one
        all-reduce of the count over DP x CP (:meth:`ParallelState.for_gradients`'s group)."""
        batches = list(batches)
        count = torch.stack([b.tokens_counted() for b in batches]).sum()
        group = ps.for_gradients().dp_group
        if group is not None:
            dist.all_reduce(count, group=group)
        return cls(count.clamp(min=1.0) / (len(batches) * ps.dp_size))


class _CarryAux(torch.autograd.Function):
    """Identity on ``activation``; its backward also gives each auxiliary term the gradient ``holder.scale``
    (megatron-core's ``MoEAuxLossAutoScaler``; read at backward time, so the schedule's scale applies)."""

    @staticmethod
    def forward(ctx, activation, holder, *aux):
        ctx.holder = holder
        ctx.save_for_backward(*aux)
        return activation

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.holder.scale
        return (grad, None, *(torch.full_like(t, scale) for t in ctx.saved_tensors))


class StageAuxLosses:
    """One pipeline rank's auxiliary losses (module docstring, "Auxiliary losses in a pipeline"). ``scale``: the
    gradient each term gets in backward (the pipeline sets the engine's factor before its schedule runs);
    ``recorded``: every term's value summed over the forwards since :meth:`begin` (detached fp32 ``[1]``)."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.recorded: dict[str, torch.Tensor] = {}

    def carry(self, activation: torch.Tensor, aux: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``activation`` (a stage's output), carrying the terms ``aux`` into its backward; the values recorded.
        Unchanged without terms or gradients (evaluation, generation)."""
        if not aux or not torch.is_grad_enabled():
            return activation
        for name, value in aux.items():
            value = value.detach().float().reshape(1)
            self.recorded[name] = self.recorded[name] + value if name in self.recorded else value
        return _CarryAux.apply(activation, self, *aux.values())

    def begin(self, scale: float) -> None:
        """Start a step: terms recorded from now on, their gradient ``scale``."""
        self.scale, self.recorded = scale, {}
