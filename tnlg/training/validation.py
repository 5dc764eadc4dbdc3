"""Validation during training: which samples, how often, and the loss (the one definition ``tnlg eval`` uses).

The validation loss is token-weighted over the loss-mask tokens of the first
``--eval-iters`` global batches of the validation split (the same samples every
time), as ``tnlg eval --task loss`` computes it (:func:`tnlg.eval.loss.dataset_loss`), with or
without a pipeline. ``--eval-iters`` unset (``None``, ``tnlg finetune``'s default) is the whole validation
set exactly once, as TRL's evaluation reads it: the sum of every counted token's loss over the number of
counted tokens, so packed and unpacked sequences of the same rows give the same figure.
Without ``--eod-mask-loss`` every batch holds the same number of tokens, so this
is also the mean of the batch means.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..eval.loss import dataset_loss
from ..options import LoggingOptions, ScheduleOptions
from ..parallel.state import ParallelState
from .step import autocast_to

__all__ = ["evaluate", "validation_samples", "Validation"]


def validation_samples(dataset, log: LoggingOptions, sch: ScheduleOptions, ps: ParallelState) -> int:
    """How many samples a validation reads: the first ``--eval-iters`` global batches, whole micro batches
    on every DP rank (0: fewer than one micro batch per rank); every sample once when ``--eval-iters`` is
    unset (the last micro batches may be short, and one DP rank may read one more than another)."""
    if log.eval_iters is None:
        return len(dataset)
    need, gbs = sch.micro_batch_size * ps.dp_size, sch.global_batch_size
    assert gbs is not None  # (set once the layout is known: resolve, init_run)
    return min(len(dataset), log.eval_iters * gbs) // need * need


def evaluate(model, dataset, log: LoggingOptions, sch: ScheduleOptions, ps: ParallelState,
             autocast: Optional[torch.dtype]) -> Optional[float]:
    """Token-weighted loss over the validation samples (``None``: no validation possible). Collective:
    the model's TP collectives per batch (the same number of batches on every DP rank) and one
    all-reduce of ``[loss sum, tokens]`` over DP. Through a pipeline (``model`` a stage's
    :class:`~tnlg.model.stage.StageModel`) each batch runs forward only, stage to stage
    (:func:`tnlg.model.inference.forward_logits`), the last stage computes the loss and
    broadcasts the sums over the pipeline group, so every rank reports the loss of the run without one."""
    if dataset is None or log.eval_iters == 0:
        return None
    n = validation_samples(dataset, log, sch, ps)
    if n == 0:
        return None
    with autocast_to(autocast, ps.device):
        return dataset_loss(model, dataset, micro_batch_size=sch.micro_batch_size, max_samples=n)["loss"]


class Validation:
    """Validates every ``--eval-interval`` iterations, after the last one and (from scratch) before the
    first; decides once whether the run can validate and says why not (rank 0). ``log`` holds the
    intervals and batches of validation, ``sch`` the batch sizes."""

    def __init__(self, model, dataset, log: LoggingOptions, sch: ScheduleOptions, ps: ParallelState,
                 autocast: Optional[torch.dtype], say: Callable[[str], None]):
        self.model, self.dataset, self.log, self.sch, self.ps, self.autocast = model, dataset, log, sch, ps, autocast
        self.enabled = validation_plan(dataset, log, sch, ps, say)

    def due(self, iteration: int, last: bool) -> bool:
        return self.enabled and (iteration % self.log.eval_interval == 0 or last)

    def loss(self) -> Optional[float]:
        """The validation loss now (collective)."""
        return evaluate(self.model, self.dataset, self.log, self.sch, self.ps, self.autocast)


def validation_plan(dataset, log: LoggingOptions, sch: ScheduleOptions, ps: ParallelState,
                    say: Callable[[str], None]) -> bool:
    """Whether this run validates; when it cannot, ``say`` why once. ``--eval-interval 0`` is off by
    request, silently."""
    if not log.eval_interval:
        return False
    if log.eval_iters == 0:
        say("note: --eval-iters 0: this run does no validation.")
        return False
    if dataset is None:
        say("note: the validation split is empty; validation is skipped.")
        return False
    if validation_samples(dataset, log, sch, ps) == 0:
        say(f"note: the validation split holds {len(dataset)} samples, fewer than one micro batch per "
            f"data-parallel rank ({sch.micro_batch_size * ps.dp_size}); validation is skipped.")
        return False
    return True
