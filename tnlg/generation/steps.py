"""The steps of generation at any TP x PP: a prefill of each row's prompt, a decode of one token per row, the choice.

Every rank of a TP x PP group calls each step with the same arguments; the logits come back on the last
pipeline stage (this rank's vocabulary shard ``[b, V_pad / tp]`` of each row's next position), ``None`` on
the others, and :func:`choose_next` gives every rank the same ids.

**Prompts are left-aligned** (right-padded): row ``i``'s prompt fills columns ``0 .. n_i - 1`` of the
prefill's ``[b, max n]`` tokens. With a length per row in the cache (:mod:`tnlg.model.kv_cache`), column
``j`` is position ``j`` and cache slot ``j`` for every row: no row has padding before its tokens, so no
position offset and no mask against padding is needed; a row's padding columns write keys past its length
(never read: each row's queries see its own slots only, and its next tokens overwrite them). Left padding
(the other choice) would put the same real tokens at other slots per row and need both. The cost moves to
one place: each row's next-token logits are those of its own last column (the cache's
:meth:`~tnlg.model.kv_cache.KVCache.last_positions`, a gather in the LM head). Without a cache the same
layout needs no mask at all: causality alone keeps a row's queries before its padding.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..model.inference import forward_logits, from_last_stage
from ..model.kv_cache import KVCache
from ..parallel.vocab import full_vocab_candidates, vocab_parallel_argmax, vocab_parallel_topk
from .options import SamplingOptions
from .sampling import sample_from_candidates

__all__ = ["right_padded", "prefill", "decode", "recompute", "choose_next"]


def right_padded(prompts: Sequence[Sequence[int]], width: int, pad_id: int = 0, device=None) -> torch.Tensor:
    """``[b, width]`` ids: prompt ``i`` in columns ``0 .. len - 1``, ``pad_id`` after it (any valid id: no
    row ever attends to its padding)."""
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
    return tokens.to(device)


def prefill(model, cache: KVCache, tokens: torch.Tensor, lengths: Sequence[int]) -> Optional[torch.Tensor]:
    """Run the prompts ``tokens`` ``[b, s]`` (right-padded, row ``i``'s ``lengths[i]`` tokens first) into
    ``cache``: each row's keys and values, its length advanced by its own count. Returns the logits of each
    row's next position (last stage; ``None`` elsewhere)."""
    if any(n != tokens.shape[1] for n in lengths):
        cache.feed(lengths)
    logits = forward_logits(model, tokens, kv_cache=cache, last_only=True)
    return None if logits is None else logits[:, -1]


def decode(model, cache: KVCache, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """One new token per row (``ids`` ``[b]``), each at its row's own length; the logits of each row's
    next position (last stage; ``None`` elsewhere)."""
    logits = forward_logits(model, ids.view(-1, 1), kv_cache=cache, last_only=True)
    return None if logits is None else logits[:, -1]


def recompute(model, tokens: torch.Tensor, lengths: torch.Tensor) -> Optional[torch.Tensor]:
    """Without a cache: every row's whole sequence again (``tokens`` ``[b, s]`` right-padded, row ``i``'s
    ``lengths[i]`` tokens first) and the logits after each row's last token (last stage; ``None`` elsewhere)."""
    logits = forward_logits(model, tokens)
    if logits is None:
        return None
    return logits[torch.arange(tokens.shape[0], device=logits.device), lengths.to(logits.device) - 1]


def choose_next(logits: Optional[torch.Tensor], ps, options: SamplingOptions, vocab: int,
                generators: Sequence[torch.Generator], device) -> torch.Tensor:
    """The next id per row ``[b]`` from the last stage's vocabulary shards ``[b, V_pad / tp]`` (``None`` on
    the other stages), identical on all TP ranks and pipeline stages; only ids below ``vocab`` are chosen.
    Collectives: the vocabulary-parallel argmax / top-k / gather over TP (:mod:`tnlg.parallel.vocab`),
    one broadcast of ``[b]`` ids over TP and one over PP."""
    if logits is None:  # a stage before the last: the id comes from the last stage
        return from_last_stage(torch.empty(len(generators), dtype=torch.long, device=device), ps)
    logits = logits.float()
    if options.argmax:
        nxt = vocab_parallel_argmax(logits, ps, vocab)
    else:
        if options.top_k > 0:
            values, ids = vocab_parallel_topk(logits, ps, vocab, options.top_k)
        else:
            values, ids = full_vocab_candidates(logits, ps, vocab)
        nxt = sample_from_candidates(values, ids, options.temperature, options.top_p, generators)
    nxt = nxt.contiguous()
    if ps.tp_size > 1:  # the candidates are identical already; this makes the choice so by construction
        dist.broadcast(nxt, src=ps.tp_src_rank, group=ps.tp_group)
    return from_last_stage(nxt, ps)
