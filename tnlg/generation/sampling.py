"""Sampling from vocabulary-parallel logits: seeded draws among candidates.

The candidates (global top-``k``, or the whole vocabulary) come from
:mod:`tnlg.parallel.vocab`, in one canonical order - value descending, ties by smaller
id - so a seeded draw (:func:`sample_from_candidates`, inverse CDF with one uniform
number per row from a CPU generator) picks the same token at every TP size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["sample_from_candidates", "make_generators"]


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
