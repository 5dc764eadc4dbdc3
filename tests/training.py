"""Helpers of the training tests: a run's summary with its final parameters, read from the trained engine."""

from __future__ import annotations

import torch


def full_params(trainer) -> dict:
    """Full TP=1 tensors of every parameter of a trained :class:`tnlg.training.Trainer`, whatever the ZeRO
    stage (collective over DP and TP)."""
    from tnlg.model import GPT
    from tnlg.parallel.state import ParallelState
    from tnlg.parallel.sharding import gather_full
    ps = trainer.ps
    with torch.device("meta"):  # the partition metadata of this rank's shard, without memory
        shard = GPT(trainer.config, ParallelState(tp_rank=ps.tp_rank, tp_size=ps.tp_size, virtual=True))
    meta = dict(shard.named_parameters())
    return {n: gather_full(t.detach().cpu(), meta[n], ps) for n, t in trainer.engine.model_state_by_param().items()}


def train_with_params(o) -> dict:
    """:func:`tnlg.training.train`'s summary, plus ``params``: the full parameters after training (collective)."""
    from tnlg.training import Trainer
    trainer = Trainer(o)
    summary = trainer.train()
    summary["params"] = full_params(trainer)
    return summary
