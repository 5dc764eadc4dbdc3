"""The KV cache of incremental decoding: every layer's keys and values of past positions, a length per row.

Storage is preallocated, ``k[layer]``/``v[layer]`` ``[batch, local_kv_heads, max_len, head_dim]`` per layer
(this rank's key/value heads; ``None`` for the layers of other pipeline stages), and **each row has its own
length** (``lengths``, ``[b]``): slot ``p`` of row ``i`` holds the keys and values of the row's position ``p``,
so rows of one batch can be at different lengths (prompts of different lengths, requests that joined a
batch at different times) without left padding.

A forward with the cache takes tokens ``[b, s]`` and writes row ``i``'s new keys and values at slots
``lengths[i] .. lengths[i] + s - 1`` at positions ``lengths[i] + j``; query ``j`` of row ``i`` sees that row's
keys ``0 .. lengths[i] + j`` (and no further back than a sliding window), nothing beyond: the slots past a
row's length hold whatever an earlier forward left there (padding's keys, zeros) and are never read. Before
the forward :meth:`KVCache.feed` may say how many of the ``s`` columns of each row are real (a right-padded
prefill: row ``i``'s tokens in columns ``0 .. counts[i] - 1``); the row then advances by that many and its
next-token logits are those of column ``counts[i] - 1`` (:meth:`KVCache.last_positions`). Without
:meth:`feed` every row advances by ``s``. :meth:`reset` empties rows (a request's row taken by the next one),
which the next forward refills beside the other rows' decode tokens.

While every row has the same length (``uniform``) the attention takes the same path as a single
sequence's (no mask for one new token, causality otherwise): only rows at different lengths pay for a
per-row mask ``[b, s, kv]``, built once per forward (per window) and shared by the layers.
"""

from __future__ import annotations

from typing import Optional, Sequence, cast

import torch
import torch.nn as nn

from ..config import GPTConfig
from ..parallel.state import ParallelState

__all__ = ["KVCache", "local_kv_heads"]


def local_kv_heads(cfg: GPTConfig, tp: int, tp_rank: int) -> int:
    """Key/value heads TP rank ``tp_rank`` computes: its query heads', or its KV groups."""
    if cfg.kv_groups == cfg.num_attention_heads:
        return cfg.heads_per_rank(tp)[tp_rank]
    return len(cfg.kv_groups_per_rank(tp)[tp_rank])


class KVCache:
    """Keys and values of past positions for incremental decoding, this rank's key/value heads only
    (its query heads' without grouped-query attention; with it, the rank's KV groups: ``G`` heads in
    all, not ``H``), with a length per row (the module's docstring).

    ``k[layer]``/``v[layer]`` are ``[batch, local_kv_heads, max_len, head_dim]`` (global layer index;
    ``None`` for the layers of other pipeline stages when ``model`` is a pipeline rank's
    :class:`~tnlg.model.stage.StageModel`); ``lengths`` ``[batch]`` (long, on the cache's device) the positions
    each row has written; ``end`` (an int, no device sync) a bound on every row's length, the slots a
    forward reads being ``0 .. end + s - 1``; ``uniform``: whether every row's length is ``end``. Keys are
    stored rotated (rope), as transformers stores them. The model's forward advances the lengths
    (:meth:`advance`) once every layer has run.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, dtype=None, device=None):
        cfg, ps = cast(GPTConfig, model.config), cast(ParallelState, model.ps)
        like = next(model.parameters())  # (the GPT's and a stage's parameters share one dtype and device)
        device = device or like.device
        shape = (batch_size, local_kv_heads(cfg, ps.tp_size, ps.tp_rank), max_len, cfg.head_dim)
        ranges = getattr(model, "chunk_ranges", [range(cfg.num_layers)])
        mine = {i for r in ranges for i in r}

        def cache() -> list[Optional[torch.Tensor]]:
            return [torch.zeros(shape, dtype=dtype or like.dtype, device=device) if i in mine
                    else None for i in range(cfg.num_layers)]
        self.k, self.v = cache(), cache()
        self.max_len, self.batch_size = max_len, batch_size
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.end = 0
        self.uniform = True
        self.counts: Optional[torch.Tensor] = None  # the next forward's real tokens per row (feed)
        self._counts_max, self._counts_equal = 0, True
        self._per_forward: dict = {}  # what every layer of one forward shares (masks, write index)

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def feed(self, counts: Sequence[int]) -> None:
        """The next forward's real tokens per row: row ``i``'s first ``counts[i]`` columns (``1 <= counts[i] <=
        s``); the columns after them are padding, whose keys land past the row's length (never read, and
        overwritten by the row's next tokens). ``ValueError`` for a count out of range or of another batch."""
        counts = [int(c) for c in counts]
        if len(counts) != self.batch_size or min(counts) < 1:
            raise ValueError(f"the cache holds {self.batch_size} rows, each forward adding at least one token; "
                             f"got new-token counts {counts}.")
        self.counts = torch.tensor(counts, dtype=torch.long, device=self.device)
        self._counts_max, self._counts_equal = max(counts), len(set(counts)) == 1

    def reset(self, rows: Sequence[int]) -> None:
        """Empty rows ``rows`` (a finished request's row, taken by a new one): their lengths back to 0, so
        the next forward writes their new tokens from slot 0 (with :meth:`feed`, a new prompt beside other
        rows' single decode tokens). Reads the longest remaining length (one device sync)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.lengths.index_fill_(0, index, 0)
        self.end = int(self.lengths.max())
        self.uniform = bool((self.lengths == self.end).all())
        self._per_forward.clear()

    def start(self, s: int) -> int:
        """The first slot a forward of ``s`` columns writes (when the rows are ``uniform``; else a bound),
        after checking the cache has room: ``ValueError`` otherwise."""
        if self.counts is not None and self._counts_max > s:
            raise ValueError(f"a forward of {s} tokens per row cannot add {self._counts_max} to a row.")
        if self.end + s > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions per row; {s} more after {self.end} "
                             "do not fit.")
        return self.end

    def positions(self, s: int) -> torch.Tensor:
        """The positions of a forward's ``s`` new tokens: ``[1, s]`` from ``end`` for uniform rows, else each
        row's from its length, ``[b, s]``."""
        steps = torch.arange(s, device=self.device)
        if self.uniform:
            return (steps + self.end).unsqueeze(0)
        return self.lengths[:, None] + steps

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer``'s new keys and values ``[b, kv_heads, s, d]`` at every row's length; return
        the layer's keys and values of slots ``0 .. end + s - 1`` (views)."""
        ck, cv = cast(torch.Tensor, self.k[layer]), cast(torch.Tensor, self.v[layer])
        s = k.shape[2]
        if self.uniform:
            ck[:, :, self.end:self.end + s] = k
            cv[:, :, self.end:self.end + s] = v
        else:  # row i's columns at slots lengths[i] + j
            index = self._shared(("index", s), lambda: (self.lengths[:, None] + torch.arange(
                s, device=self.device))[:, None, :, None])
            ck.scatter_(2, index.expand_as(k), k.to(ck.dtype))
            cv.scatter_(2, index.expand_as(v), v.to(cv.dtype))
        return ck[:, :, :self.end + s], cv[:, :, :self.end + s]

    def attention_mask(self, s: int, window: Optional[int] = None) -> torch.Tensor:
        """``[b, s, end + s]`` bool (True = may attend) for rows at their own lengths: query ``j`` of row ``i``
        (position ``p = lengths[i] + j``) sees slots ``0 .. p``, within a sliding ``window`` the slots
        ``p - window + 1 .. p``. One per forward and window (the layers share it)."""
        def build() -> torch.Tensor:
            q = self.positions(s)[:, :, None]  # [b, s, 1]
            slots = torch.arange(self.end + s, device=self.device)
            allowed = slots <= q
            return allowed if window is None else allowed & (slots > q - window)
        return self._shared(("mask", s, window), build)

    def last_positions(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's last real column of a sequence-first ``x`` ``[s, b, ...]``: ``[1, b, ...]`` (column
        ``counts[i] - 1`` after :meth:`feed`, else the last)."""
        if self.counts is None:
            return x[-1:]
        index = (self.counts - 1).view(1, -1, *([1] * (x.dim() - 2))).expand(1, *x.shape[1:])
        return x.gather(0, index)

    def advance(self, s: int) -> None:
        """After a forward of ``s`` columns: every row's length grows by its fed count (else by ``s``)."""
        if self.counts is None:
            self.lengths += s
            self.end += s
        else:
            counts = self.counts
            self.lengths += counts
            self.end += self._counts_max
            self.uniform = self.uniform and self._counts_equal
            self.counts = None
        self._per_forward.clear()

    def _shared(self, key, build):
        value = self._per_forward.get(key)
        if value is None:
            value = self._per_forward[key] = build()
        return value
