"""Full (layout-independent) tensors <-> this rank's TP shards.

A *full state dict* maps every parameter name to the tensor TP=1 would hold,
without vocabulary padding. It does not depend on the TP size, so it is the
exchange format for Hugging Face conversion and checkpoint resharding.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from .parallel.layers import full_shape, shard_of
from .parallel.mappings import all_gather_uneven
from .parallel.state import ParallelState

__all__ = ["gather_full", "full_state_dict", "load_full_state_dict"]


def gather_full(shard: torch.Tensor, param: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """The full tensor of a (possibly split) parameter: all-gather over TP along its
    ``partition_dim`` (uneven sizes allowed), padding removed. Collective over TP."""
    if not getattr(param, "tp_sharded", False):
        return shard
    if ps.tp_size > 1:
        shard = all_gather_uneven(shard.detach(), param.partition_sizes, param.partition_dim, ps.tp_group)
    return shard.narrow(param.partition_dim, 0, param.full_size)


@torch.no_grad()
def full_state_dict(model: nn.Module, ps: ParallelState) -> dict[str, torch.Tensor]:
    """Every parameter as its full TP=1 tensor (collective over TP; all TP ranks get it)."""
    return {name: gather_full(p.detach(), p, ps).clone() for name, p in model.named_parameters()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: Mapping[str, torch.Tensor], ps: ParallelState) -> None:
    """Copy this rank's slice of every full tensor into the model (no communication).

    Names and full shapes must match exactly; a mismatch is a ``ValueError`` naming it.
    """
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(full)), sorted(set(full) - set(params))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''}.")
    for name, p in params.items():
        expected = full_shape(p)
        if tuple(full[name].shape) != expected:
            raise ValueError(f"parameter {name!r} has shape {tuple(full[name].shape)} in the state dict but "
                             f"the model expects the full shape {expected}.")
        p.copy_(shard_of(full[name].to(p.dtype), p, ps.tp_rank))
