"""The data-parallel collectives on one bucket of a flat buffer (ZeRO stages 0 and 1).

A bucket of ``n`` elements (padded to a multiple of ``shards``) is owned in ``shards``
equal slices: DP rank ``r`` owns ``[r n / shards, (r + 1) n / shards)`` (see
:mod:`tnlg.optim.layout`). Two collectives run on it, both over the DP group only:

* :meth:`BucketComm.reduce` (backward): divide the bucket's gradients by ``dp``, then
  stage 0 all-reduces the bucket, stage 1 reduce-scatters it into the owned slice (in place);
* :meth:`BucketComm.gather` (after the step, stage 1): all-gather the owned parameter
  slices into the full bucket (in place).

Stage 1 moves reduce-scatter + all-gather = the 2 units of an all-reduce, as ZeRO's
analysis says. On gloo the reduce-scatter is issued as ``dp`` reduces (chunk ``k`` to its
owner ``k``) and the all-gather as ``dp`` broadcasts (chunk ``k`` from ``k``): the same
bytes per rank, but gloo's own ``reduce_scatter``/``all_gather`` ran 3-10x slower than
those here (``collectives="native"`` forces them; NCCL always uses them). Every call is
asynchronous and returns the work handles to wait on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UserError
from ..parallel.mappings import all_gather_flat, reduce_scatter_flat
from ..parallel.state import ParallelState
from .layout import Bucket

__all__ = ["BucketComm", "pick_collectives"]


class BucketComm:
    """Reduce (gradients) and gather (parameters) one bucket over the DP group; see the module docstring.

    ``shards`` is ``dp`` at stage 1 (states partitioned) and 1 at stage 0. ``counts`` records
    how many buckets were reduced during backward / at the step and how many were gathered.
    """

    def __init__(self, ps: ParallelState, shards: int, collectives: str = "auto"):
        self.group, self.dp, self.shards = ps.dp_group, ps.dp_size, shards
        self.rank = ps.dp_rank if shards > 1 else 0
        self.collectives = "native" if ps.virtual else pick_collectives(collectives, self.group, self.dp)
        self.global_ranks = ([dist.get_global_rank(self.group, k) for k in range(self.dp)]
                             if self.group is not None else list(range(self.dp)))
        self.counts = dict(launched_in_backward=0, launched_at_step=0, param_gathers=0)

    def reduce(self, grads: torch.Tensor, b: Bucket, in_backward: bool) -> list:
        """Average bucket ``b`` of the flat gradient buffer ``grads`` over DP (stage 0: everywhere;
        stage 1: into this rank's owned slice only). Nothing with one DP rank."""
        if self.dp == 1:
            return []
        g = grads[b.start:b.start + b.padded_numel]
        g.div_(self.dp)
        if self.shards == 1:
            works = [dist.all_reduce(g, group=self.group, async_op=True)]
        elif self.collectives == "native":
            lo, hi = b.shard_range(self.rank)
            works = [reduce_scatter_flat(grads[lo:hi], g, self.group, async_op=True)]
        else:  # one reduce per owner: the same data movement as a reduce-scatter, fast on gloo
            works = [dist.reduce(chunk, dst=dst, group=self.group, async_op=True)
                     for chunk, dst in zip(self._chunks(g, b), self.global_ranks)]
        self.counts["launched_in_backward" if in_backward else "launched_at_step"] += 1
        return works

    def gather(self, params: torch.Tensor, b: Bucket) -> list:
        """Stage 1: every rank's owned slice of bucket ``b`` of the flat parameter buffer ``params``
        into the full bucket on every rank. Nothing at stage 0."""
        if self.shards == 1:
            return []
        full = params[b.start:b.start + b.padded_numel]
        self.counts["param_gathers"] += 1
        if self.collectives == "native":
            lo, hi = b.shard_range(self.rank)
            return [all_gather_flat(full, params[lo:hi], self.group, async_op=True)]
        # one broadcast per owner: an all-gather's data movement, fast on gloo
        return [dist.broadcast(chunk, src=src, group=self.group, async_op=True)
                for chunk, src in zip(self._chunks(full, b), self.global_ranks)]

    @staticmethod
    def _chunks(full: torch.Tensor, b: Bucket) -> list[torch.Tensor]:
        n = b.shard_numel
        return [full[k * n:(k + 1) * n] for k in range(b.shards)]


def pick_collectives(choice: str, group, dp: int) -> str:
    """``native`` (reduce-scatter / all-gather) or ``p2p`` (one reduce / broadcast per owner).

    ``auto``: native except on gloo, whose ``reduce_scatter``/``all_gather`` measured
    3-10x slower than its ``reduce``/``broadcast`` of the same data (torch 2.13, 2 CPUs).
    """
    if choice not in ("auto", "native", "p2p"):
        raise UserError(f"collectives must be 'auto', 'native' or 'p2p', got {choice!r}.")
    if choice != "auto":
        return choice
    if dp == 1 or group is None:
        return "native"
    return "p2p" if dist.get_backend(group) == "gloo" else "native"
