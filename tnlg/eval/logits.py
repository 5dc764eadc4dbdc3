"""Operations on vocabulary-parallel logits: argmax, top-k candidates, sampling.

The LM head leaves every tensor-parallel rank with a contiguous shard of the
(padded) vocabulary, ``[*, V_pad / tp]``, rank ``r`` holding ids
``[r * V_pad / tp, (r + 1) * V_pad / tp)`` (equal shards: Megatron pads ``V`` to a
multiple of ``128 * tp``). Ids ``>= vocab_size`` are padding and never chosen.

Greedy choice and top-k need no full logits: each rank takes its local top ``k``
(value, global id) pairs and one all-gather of ``[tp, *, k]`` candidates gives every
rank the same set, from which the global top ``k`` follows exactly. Only sampling
from the whole distribution (``top_k = 0``) all-gathers the full last-position
logits ``[b, V]``.

Candidates are put in one canonical order - value descending, ties by smaller id -
so the result does not depend on how the vocabulary was split, and a seeded draw
(:func:`sample_from_candidates`, inverse CDF with one uniform number per row from a
CPU generator) picks the same token at every TP size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..parallel.mappings import gather_from_tp
from ..parallel.state import ParallelState

__all__ = ["vocab_parallel_topk", "vocab_parallel_argmax", "full_vocab_candidates", "sample_from_candidates",
           "canonical_order", "make_generators"]


def canonical_order(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort candidates along the last dim by value (descending), ties by id (ascending)."""
    by_id = torch.argsort(ids, dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = torch.argsort(values, dim=-1, descending=True, stable=True)
    return values.gather(-1, by_value), ids.gather(-1, by_value)


def _masked_local(logits: torch.Tensor, ps: ParallelState, vocab_size: int) -> tuple[torch.Tensor, int]:
    """This shard with padded columns set to ``-inf``, and its first global id."""
    local = logits.shape[-1]
    start = ps.tp_rank * local
    if start + local > vocab_size:
        logits = logits.clone()
        logits[..., max(0, vocab_size - start):] = float("-inf")
    return logits, start


def vocab_parallel_topk(logits: torch.Tensor, ps: ParallelState, vocab_size: int,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-``k`` ``(values, ids)`` ``[*, k]`` of vocab-sharded logits, in canonical order.

    One all-gather over TP of ``[*, k]`` values and ids (none at TP = 1); every TP rank
    returns the same tensors. ``k`` is clamped to ``vocab_size``. Values keep the
    logits' dtype.
    """
    k = max(1, min(int(k), vocab_size))
    masked, start = _masked_local(logits.detach(), ps, vocab_size)
    k_local = min(k, masked.shape[-1])
    values, ids = torch.topk(masked, k_local, dim=-1)
    ids = ids + start
    if ps.tp_size > 1:
        parts_v = [torch.empty_like(values) for _ in range(ps.tp_size)]
        parts_i = [torch.empty_like(ids) for _ in range(ps.tp_size)]
        dist.all_gather(parts_v, values.contiguous(), group=ps.tp_group)
        dist.all_gather(parts_i, ids.contiguous(), group=ps.tp_group)
        values, ids = torch.cat(parts_v, dim=-1), torch.cat(parts_i, dim=-1)
    values, ids = canonical_order(values, ids)
    return values[..., :k], ids[..., :k]


def vocab_parallel_argmax(logits: torch.Tensor, ps: ParallelState, vocab_size: int) -> torch.Tensor:
    """Id of the largest logit over the real vocabulary, ``[*]`` (ties: the smaller id, as
    ``torch.argmax``). One all-gather of ``[*, 1]`` values and ids over TP."""
    return vocab_parallel_topk(logits, ps, vocab_size, 1)[1][..., 0]


def full_vocab_candidates(logits: torch.Tensor, ps: ParallelState,
                          vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All ``vocab_size`` logits ``[*, V]`` (all-gather over TP, padding dropped) and their ids,
    in canonical order."""
    full = gather_from_tp(logits.detach(), ps)[..., :vocab_size]
    ids = torch.arange(vocab_size, device=full.device).expand_as(full)
    return canonical_order(full, ids)


def sample_from_candidates(values: torch.Tensor, ids: torch.Tensor, temperature: float, top_p: float,
                           generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Draw one id per row from candidates ``[b, K]`` in canonical order.

    ``softmax(values / temperature)`` in float64; with ``top_p < 1`` the smallest
    prefix whose probability reaches ``top_p`` is kept (always at least one token);
    then one uniform number per row from ``generators[row]`` (CPU generators) picks
    by inverse CDF. No communication.
    """
    probs = torch.softmax(values.double().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better candidates
        probs = probs.masked_fill(before >= top_p, 0.0)  # the first candidate always stays
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    # candidates with probability > 0 form a prefix (canonical order); u * total may round up to total
    pick = torch.minimum(pick, (probs > 0).sum(-1) - 1)
    return ids.cpu().gather(-1, pick.unsqueeze(-1)).squeeze(-1).to(ids.device)


def make_generators(seeds: Sequence[Optional[int]]) -> list[torch.Generator]:
    """One CPU generator per row: seeded, or from a fresh random seed when ``None``."""
    gens = []
    for s in seeds:
        g = torch.Generator()
        if s is None:
            g.seed()
        else:
            g.manual_seed(int(s))
        gens.append(g)
    return gens
