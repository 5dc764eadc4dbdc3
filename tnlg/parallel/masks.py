"""The masks of attention over packed documents and sliding windows, from what a batch carries to what the
kernels take, and what each costs (local attention, :mod:`tnlg.model.attention`; the ring of context
parallelism, :mod:`tnlg.parallel.context`).

A packed batch carries its documents as per-position ids ``[b, s]`` (O(s) per sample; equal ids: one
document, each a contiguous stretch, as the datasets give them: the position where it starts). Attention
needs, for ``s`` queries (positions ``kv_len - s .. kv_len - 1``) over ``kv_len`` keys, the block-causal
mask ``doc_q == doc_k and k <= q`` (:func:`document_mask`), with a sliding window also ``k > q - window``
(:func:`window_mask`). Built whole, that is a ``[b, 1, s, kv_len]`` bool (``[s, kv_len]`` for a window alone):
at ``s = kv_len = 131072`` one row's is 16 GiB, and SDPA turns a bool mask into an additive one of the
queries' dtype inside (4 bytes an element in fp32), which its fused kernels save for backward.

**Dense, under the budget.** A mask of at most :data:`MASK_BUDGET` elements (``b * s * kv_len``; ``s *
kv_len`` without documents) is built whole, once per forward and window: the forward's
:class:`~tnlg.model.forward.ForwardContext` keeps it (:meth:`~tnlg.model.forward.ForwardContext.shared`) and
every layer of that window takes the same tensor. At the budget that is 64 MiB of bool, and SDPA's additive
copy (256 MiB in fp32, 128 MiB in bf16) per layer, saved for backward.

**Per query chunk, above it** (:class:`QueryChunks`). The queries are cut into chunks of ``c =
MASK_BUDGET // (b * kv_len)`` (at least one); chunk ``[a, e)`` attends to the keys ``[lo, kv_len - s + e)``
only: none after its last query (causal), and none before ``lo``, the earliest position any of its queries
may see (the start of its first query's document, the lowest over the batch's rows, and with a window its
first query's window). Its mask ``[b, 1, c, hi - lo]`` (at most :data:`MASK_BUDGET` elements) is built from
the ids when the chunk runs, and in training each chunk runs under ``torch.utils.checkpoint`` (non-reentrant):
backward rebuilds the chunk's mask and recomputes its attention rather than saving either (selective
recomputation, chunk by chunk). Memory: O(b c kv_len) transient per chunk, plus the documents' starts ``[b,
kv_len]`` (int64) once per forward; nothing per layer beyond q, k and v. Time: the attention's forward
runs twice in training (once more in backward), over the keys each chunk can see only: with documents much
shorter than ``s`` that is far less than the dense mask's ``s * kv_len / 2``. The starts of the chunks' key
ranges are read to the host once per forward and window (one synchronisation on a GPU).

Exactness: the keys a chunk leaves out are masked out in the dense mask, so each query's softmax is over the
same keys; outputs and gradients agree to rounding (tests/test_packed_mask.py: 1e-6 in fp32). Attention
dropout draws per chunk from the TP rank's generator (other masks than one dense draw, as any other
kernel order would), and each chunk's recomputation replays its own draws.

**The ring** (context parallelism, :mod:`tnlg.parallel.context`) keeps the whole sequence's ids (O(b s), all
it saves for backward) and builds each step's block mask from them when it runs, by the same budget: a block
of ``n x m`` (``n, m <= s / C``) whose mask would exceed :data:`MASK_BUDGET` is run in parts of
``MASK_BUDGET // (b m)`` query rows, each part's mask built, used and dropped (forward, and again in
backward), so one step holds at most :data:`MASK_BUDGET` mask elements. The KV cache of incremental decoding
keeps its own masks (:meth:`tnlg.model.kv_cache.KVCache.attention_mask`).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["MASK_BUDGET", "Mask", "document_mask", "window_mask", "document_starts", "mask_elements", "QueryChunks",
           "query_parts"]

# The most elements of an attention mask built at once (b * s * kv_len; 64 MiB of bool): above it attention runs
# per chunk of queries (QueryChunks; the ring per part of a block). Read when a forward runs, so tests may set it smaller.
MASK_BUDGET = 1 << 26


def document_mask(doc_ids: torch.Tensor, s: int, kv_len: int) -> torch.Tensor:
    """``[b, s, kv_len]`` bool (True = may attend) of the last ``s`` of ``kv_len`` positions from the per-position
    document ids ``doc_ids`` ``[b, >= kv_len]`` (integers; equal ids: one document, each a contiguous stretch):
    causal, and within the query's document (the block-causal mask of packed documents). Built where attention
    runs, so a batch carries O(s) per sample, never an ``[s, s]`` matrix; whole only under :data:`MASK_BUDGET`."""
    q, k = doc_ids[:, kv_len - s:kv_len], doc_ids[:, :kv_len]
    causal = torch.ones(s, kv_len, dtype=torch.bool, device=doc_ids.device).tril(kv_len - s)
    return (q[:, :, None] == k[:, None, :]) & causal


def window_mask(s: int, kv_len: int, window: int, device=None) -> torch.Tensor:
    """``[s, kv_len]`` bool (True = may attend) of sliding-window causal attention for the last ``s`` of
    ``kv_len`` positions: the query at position ``p`` sees the keys ``p - window + 1 .. p`` (transformers'
    ``sliding_window``; Megatron-core's ``window_size=(window - 1, 0)``)."""
    q = torch.arange(kv_len - s, kv_len, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    return (k <= q) & (k > q - window)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[b, n]`` int64: for each position of ``doc_ids`` ``[b, n]`` the position where its document (its
    contiguous stretch of equal ids) starts."""
    n = doc_ids.shape[1]
    index = torch.arange(n, device=doc_ids.device).expand_as(doc_ids)
    change = torch.ones_like(doc_ids, dtype=torch.bool)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(change, index, torch.zeros_like(index)).cummax(dim=1).values


def mask_elements(doc_ids: Optional[torch.Tensor], s: int, kv_len: int) -> int:
    """The elements of the whole mask of ``s`` queries over ``kv_len`` keys: ``b * s * kv_len`` with documents
    (a mask per row), ``s * kv_len`` without."""
    return (1 if doc_ids is None else doc_ids.shape[0]) * s * kv_len


class QueryChunks:
    """The mask of ``s`` queries over ``kv_len`` keys (the last ``s`` positions) kept as its O(s) description
    (module docstring): the documents' ids ``[b, >= kv_len]`` (or ``None``) and the sliding ``window`` (or
    ``None``). :meth:`spans` cuts the queries into chunks of at most ``budget`` mask elements and gives each
    chunk's key range; :meth:`rows` builds one chunk's mask."""

    def __init__(self, doc_ids: Optional[torch.Tensor], s: int, kv_len: int, window: Optional[int],
                 budget: int, device=None):
        self.doc_ids, self.s, self.kv_len, self.window = doc_ids, s, kv_len, window
        self.device = device if doc_ids is None else doc_ids.device
        self.offset = kv_len - s
        self.parts = query_parts(0, s, mask_elements(doc_ids, 1, 1), kv_len, budget)
        self._spans: Optional[list[tuple[int, int, int, int]]] = None

    def spans(self) -> list[tuple[int, int, int, int]]:
        """``(first query, end of queries, first key, end of keys)`` of every chunk, queries counted from 0
        (position ``kv_len - s``), keys from position 0. Worked out once (one host read of the documents'
        starts) and kept."""
        if self._spans is None:
            starts, ends = [p.start for p in self.parts], [p.stop for p in self.parts]
            firsts = [self.offset + a for a in starts]  # the position of each chunk's first query
            lows = [0] * len(starts) if self.window is None else [max(0, p - self.window + 1) for p in firsts]
            if self.doc_ids is not None:  # the start of the first query's document: no query of the chunk sees before
                begin = document_starts(self.doc_ids[:, :self.kv_len])
                index = torch.tensor(firsts, device=begin.device)
                doc_lows = begin.index_select(1, index).amin(dim=0).tolist()
                lows = [max(w, d) for w, d in zip(lows, doc_lows)]
            self._spans = [(a, e, lo, self.offset + e) for a, e, lo in zip(starts, ends, lows)]
        return self._spans

    def rows(self, start: int, stop: int, lo: int, hi: int) -> torch.Tensor:
        """``[b, 1, stop - start, hi - lo]`` bool (``[1, 1, ...]`` without documents; True = may attend): the
        mask of queries ``start .. stop - 1`` over the keys at positions ``lo .. hi - 1``."""
        device = self.device
        q = torch.arange(self.offset + start, self.offset + stop, device=device)[:, None]
        k = torch.arange(lo, hi, device=device)[None, :]
        allowed = k <= q
        if self.window is not None:
            allowed = allowed & (k > q - self.window)
        if self.doc_ids is None:
            return allowed[None, None]
        ids = self.doc_ids
        same = ids[:, self.offset + start:self.offset + stop, None] == ids[:, None, lo:hi]
        return (same & allowed).unsqueeze(1)


def query_parts(start: int, stop: int, rows: int, keys: int, budget: int) -> list[slice]:
    """Queries ``start .. stop - 1`` in parts of at most ``budget // (rows * keys)`` (at least one), each part's
    mask of ``rows`` x part x ``keys`` elements within ``budget``: one part where the whole fits."""
    size = max(1, budget // max(1, rows * keys))
    return [slice(a, min(a + size, stop)) for a in range(start, stop, size)]


Mask = Union[torch.Tensor, QueryChunks]  # what an attention core takes: a whole mask, or one kept per query chunk
