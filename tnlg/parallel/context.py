"""Context parallelism (CP): one sequence split across the ranks of a CP group, attention exact by a ring.

**The split (Megatron-core's causal load balance).** A sequence of ``s`` positions is cut into ``2C``
chunks of ``c = s / (2C)``; CP rank ``r`` holds chunks ``r`` and ``2C-1-r``, concatenated in that
order (``[b, 2c, ...]`` locally). Under a causal mask every rank then does the same attention
work: a rank with an early chunk also holds a late one. :func:`chunk_positions` gives the GLOBAL
positions of a rank's tokens (what rope and learned positions index by), :func:`split_for_context_parallel`
takes a rank's two chunks of a full batch and :func:`gather_from_context_parallel` puts the full
sequence back together (tests, evaluation).

**The ring** (:func:`ring_attention`, Liu et al. 2023 "Ring Attention"; Megatron-core's ``p2p`` CP).
Queries stay where they are; each rank's K/V block ``[b, G, 2c, d]`` (G key/value heads: GQA sends G
heads, not H) goes round the CP group, one hop per step, ``C - 1`` hops in forward. At step ``i`` rank
``r`` holds the K/V of rank ``j = (r - i) mod C``; of the four chunk pairs only these are below the
causal diagonal:

* ``i = 0`` (its own block): both query chunks against both key chunks, causal (the chunks are in
  increasing order, so the plain causal mask of the ``2c x 2c`` block is right);
* ``j < r``: both query chunks against key chunk ``j`` only, no mask;
* ``j > r``: query chunk ``2C-1-r`` only against both key chunks of ``j``, no mask.

The other quarter-blocks lie entirely above the diagonal and are skipped, so every step costs the
same half block. Each block returns its output and log-sum-exp (LSE); the partial outputs are
merged in fp32 (also under bf16): ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse)
+ out_b exp(lse_b - lse)``. The next K/V block is sent and received (``dist.batch_isend_irecv`` to
rank ``r+1`` and from rank ``r-1`` of the group) while the current block is computed.

**Backward: the dK/dV travel the ring.** Saved: q, this rank's k and v, the merged output and LSE
(nothing per block). Each block's gradients come from the fused attention backward given the
*merged* output and LSE (flash attention's backward recomputes the block's probabilities from
them, so a block's gradients are exact pieces of the whole): dQ accumulates locally (fp32); the
K/V blocks go round again (``C - 1`` hops) and with each travels an fp32 dK/dV accumulator to
which every rank adds its contribution (``C`` hops: after the last it is back at its owner). Each
hop is overlapped with the next block's compute.

**Sliding windows.** A layer with a window ``w`` masks every block to ``pos_q - pos_k < w`` as well; a
block none of whose queries sees any of its keys (all ``w`` or more positions behind) is skipped, not
computed and masked: its K/V are only passed on (and, in backward, its dK/dV accumulator).

**Documents** (``--reset-attention-mask``): ``doc_ids`` ``[b, s]`` gives the document of every
position of the whole sequence (``b * s`` integers, which every rank of the group holds); a block
then gets the mask ``pos_q >= pos_k and doc_q == doc_k``. A query row that sees no key of a block
gets LSE ``-inf`` there (it always sees itself in its own block, so the merge stays finite).
What it costs: the ids are O(b s) and are all that is saved for backward; each step builds its block's mask
(``[b, 1, n, m]`` bool, ``n, m`` each ``c`` or ``2c``: up to ``b (s / C)^2`` elements) from them when it runs
and drops it after, and builds it again in backward. A block whose mask would exceed
:data:`tnlg.parallel.masks.MASK_BUDGET` runs in parts of its query rows (each row's output and LSE are its
own, so the parts are exact; their dK/dV are summed), each part's mask built, used and dropped: one step
holds at most the budget's elements of mask (on CPU plus the kernel's additive copy in the queries' dtype,
2-4 bytes an element; elsewhere the fp32 block maths hold a part's scores ``[b, H, n_part, m]``), never a
mask per layer and never one quadratic in ``s``.

**Kernels.** On CPU a block is ``aten._scaled_dot_product_flash_attention_for_cpu`` (it returns the
output and an fp32 LSE; its backward takes the output and LSE) and its backward op; elsewhere a
block is computed in fp32 maths with an explicit LSE (exact, but ``[b, H, n, m]`` scores per
block: a fused CUDA kernel hook-up is future work). Attention dropout is not supported in the ring
(docs/context_parallel.md says why). Under ``--compile`` :func:`ring_attention` is left out of the
compiled graphs (``torch.compiler.disable``, applied when traced: one graph break per block), so its P2P runs eager.

**Why not torch's own.** ``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13)
was tried on gloo on CPU: its SDPA dispatcher only knows the CUDA kernels (flash, efficient,
cuDNN), so on CPU ``F.scaled_dot_product_attention`` of its DTensor buffers fails with
"aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"; it works by swapping ``F.scaled_dot_product_attention`` for a DTensor dispatch over a
``DeviceMesh`` (our TP layers hold plain tensors with explicit process groups), takes only
``is_causal`` (no document mask), and its ring pieces (``_templated_ring_attention``) are private,
rotate K/V by all-to-all/all-gather rather than P2P, and call the CUDA backward ops by name.

Collectives (per call, CP group of ``C``): forward ``C - 1`` P2P exchanges of ``2 b G 2c d`` elements;
backward ``C - 1`` exchanges of the same and ``C`` of the fp32 dK/dV. None at ``C = 1``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.batch import Batch
from . import masks
from .masks import query_parts

__all__ = ["chunk_positions", "split_for_context_parallel", "gather_from_context_parallel", "document_ids",
           "ring_attention", "check_context_parallel_length", "context_positions", "context_parallel_batch",
           "RingAttention", "context_parallel_attention", "TokenPositions"]


# ----------------------------------------------------------------------------------------- chunks

def check_context_parallel_length(seq_len: int, cp_size: int) -> None:
    """``ValueError`` unless ``2 * cp_size`` divides ``seq_len`` (each rank holds two equal chunks)."""
    if seq_len % (2 * cp_size) != 0:
        valid = [n for n in range(max(1, seq_len - 4 * cp_size), seq_len + 4 * cp_size + 1) if n % (2 * cp_size) == 0]
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split for context parallel size {cp_size}: "
                         f"it is cut into 2 x {cp_size} = {2 * cp_size} equal chunks, so the length must be a "
                         f"multiple of {2 * cp_size} (nearby: {', '.join(map(str, valid))}).")


def chunk_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions ``[2c]`` of CP rank ``cp_rank``'s tokens: chunk ``cp_rank`` then chunk ``2C-1-cp_rank``."""
    check_context_parallel_length(seq_len, cp_size)
    c = seq_len // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def split_for_context_parallel(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (the sequence: ``[b, s, ...]`` -> ``[b, 2c, ...]``)."""
    if cp_size == 1:
        return t
    return t.index_select(dim, chunk_positions(t.shape[dim], cp_size, cp_rank, t.device))


def gather_from_context_parallel(t: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = 1) -> torch.Tensor:
    """The full sequence from every CP rank's two chunks (an all-gather over ``group``; not differentiable)."""
    cp = 1 if group is None else dist.get_world_size(group)
    if cp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    chunks: list = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def document_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-position document ids ``[b, s]`` from a causal document mask ``[b, s, s]`` or ``[s, s]`` (True = may
    attend): the first position each row may see, i.e. where its document starts; document ids already
    (integers ``[b, s]`` or ``[s]``, as the datasets give them: the same starts) as they are."""
    if attention_mask.dtype != torch.bool:
        return attention_mask if attention_mask.dim() == 2 else attention_mask.unsqueeze(0)
    m = attention_mask if attention_mask.dim() == 3 else attention_mask.unsqueeze(0)
    return m.to(torch.uint8).argmax(dim=-1)


# ----------------------------------------------------------------------------------------- one block

def _block_mask(pos_q, pos_k, doc_q, doc_k, window: Optional[int] = None) -> torch.Tensor:
    """``[b, 1, n, m]`` bool (``[1, 1, n, m]`` without documents): causal by global position, within one
    document (``doc_q``/``doc_k`` ``None``: one document), and with ``window`` within the sliding window
    (the query at ``p`` sees the keys ``p - window + 1 .. p``)."""
    mask = pos_q[:, None] >= pos_k[None, :]
    if window is not None:
        mask = mask & (pos_q[:, None] - pos_k[None, :] < window)
    mask = mask[None] if doc_q is None else mask & (doc_q[:, :, None] == doc_k[:, None, :])
    return mask.unsqueeze(1)


def _block_forward(q, k, v, causal: bool, mask: Optional[torch.Tensor]):
    """Output (q's dtype) and fp32 LSE ``[b, H, n]`` of one block; rows that see no key: output 0, LSE -inf."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                             attn_mask=_bias(mask, q.dtype))
        lse = lse.float()
    else:
        out, lse = _math_forward(q, k, v, causal, mask)
    if mask is not None:  # the CPU kernel gives LSE 0 to a row it fully masks
        lse = lse.masked_fill(~mask.any(dim=-1), float("-inf"))
    return out, lse


def _bias(mask: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """The CPU kernel's additive mask (its dtype must be the query's)."""
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))


def _math_forward(q, k, v, causal: bool, mask: Optional[torch.Tensor]):
    """:func:`_block_forward` in fp32 maths with an explicit LSE (devices without the CPU kernel)."""
    scores = _scores(q, k, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (torch.exp(scores - safe[..., None]) @ v.float()).to(q.dtype), lse


def _scores(q, k, causal: bool, mask: Optional[torch.Tensor]) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril_()
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _block_backward(dout, q, k, v, out, lse, causal: bool, mask: Optional[torch.Tensor]):
    """dq, dk, dv of one block given the MERGED output and LSE of its query rows."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal,
            attn_mask=_bias(mask, q.dtype))
    return _math_backward(dout, q, k, v, out, lse, causal, mask)


def _math_backward(dout, q, k, v, out, lse, causal: bool, mask: Optional[torch.Tensor]):
    """:func:`_block_backward` in fp32 maths: ``P = exp(S - lse)``, ``dS = P (dO V^T - rowsum(dO O))``."""
    p = torch.exp(_scores(q, k, causal, mask) - lse[..., None])  # [b, H, n, m], fp32
    do, scale = dout.float(), q.shape[-1] ** -0.5
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.float().transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, dv


# ----------------------------------------------------------------------------------------- the ring

class _Ring:
    """This rank's place in the CP group: neighbours (global ranks) and the block schedule."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int, device, window: Optional[int] = None):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.window = window
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.c = seq_len // (2 * self.size)
        self.positions = [chunk_positions(seq_len, self.size, j, device) for j in range(self.size)]

    def exchange(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send ``send`` to the next rank and receive the previous rank's into a new buffer (asynchronous)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    def block(self, step: int) -> tuple[int, slice, slice, bool]:
        """``(j, query rows, key rows, causal)`` of step ``step``: whose K/V, and which quarter-blocks count."""
        j, c, every = (self.rank - step) % self.size, self.c, slice(None)
        if step == 0:
            return j, every, every, True
        return (j, every, slice(0, c), False) if j < self.rank else (j, slice(c, None), every, False)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _expand(t: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
    """K/V heads ``[b, G, n, d]`` -> one per query head ``[b, H, n, d]`` (GQA), locally."""
    return t if index is None else t.index_select(1, index)


class _RingAttention(torch.autograd.Function):
    """The ring of the module docstring; ``forward(q [b,H,2c,d], k, v [b,G,2c,d], group, doc_ids, index, window)``."""

    @staticmethod
    def forward(ctx, q, k, v, group, doc_ids, index, window):
        ring = _Ring(group, q.shape[2] * dist.get_world_size(group), q.device, window)
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, lse = _ring_forward(ring, q, k, v, doc_ids, index)
        ctx.save_for_backward(q, k, v, out, lse, doc_ids, index)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc_ids, index = ctx.saved_tensors
        with torch.autocast(device_type=q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(ctx.ring, dout, q, k, v, out, lse, doc_ids, index)
        return dq, dk, dv, None, None, None, None


def _mask_for(ring: _Ring, j: int, rows: slice, cols: slice, doc_ids: Optional[torch.Tensor]):
    """The block's mask (documents, sliding window), or ``None`` where causality alone applies."""
    if doc_ids is None and ring.window is None:
        return None
    pos_q, pos_k = ring.positions[ring.rank][rows], ring.positions[j][cols]
    if doc_ids is None:
        return _block_mask(pos_q, pos_k, None, None, window=ring.window)
    return _block_mask(pos_q, pos_k, doc_ids[:, pos_q], doc_ids[:, pos_k], window=ring.window)


def _outside(mask: Optional[torch.Tensor]) -> bool:
    """Whether no query of the block sees any of its keys (wholly outside the window, or other documents):
    the block is skipped, its K/V only passed on."""
    return mask is not None and not bool(mask.any())


def _parts(ring: _Ring, rows: slice, cols: slice, doc_ids: Optional[torch.Tensor]) -> list[slice]:
    """The block's query rows: whole where causality alone applies (no mask), else in parts whose masks keep to
    :data:`tnlg.parallel.masks.MASK_BUDGET` (module docstring: what it costs)."""
    if doc_ids is None and ring.window is None:
        return [rows]
    start, stop, _ = rows.indices(2 * ring.c)
    keys = len(range(2 * ring.c)[cols])
    return query_parts(start, stop, 1 if doc_ids is None else doc_ids.shape[0], keys, masks.MASK_BUDGET)


def _ring_forward(ring: _Ring, q, k, v, doc_ids, index):
    """Merged output (q's dtype) and fp32 LSE ``[b, H, 2c]`` over every K/V block of the group."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])  # [2, b, G, 2c, d]: one buffer per hop
    for step in range(ring.size):
        pending = ring.exchange(kv) if step + 1 < ring.size else None
        j, rows, cols, causal = ring.block(step)
        kb = vb = None
        for part in _parts(ring, rows, cols, doc_ids):
            mask = _mask_for(ring, j, part, cols, doc_ids)
            if _outside(mask):
                continue
            if kb is None:
                kb, vb = (_expand(t[:, :, cols], index).contiguous() for t in kv.unbind(0))
            o, l_blk = _block_forward(q[:, :, part].contiguous(), kb, vb, causal and mask is None, mask)
            new = torch.logaddexp(lse[:, :, part], l_blk)
            out[:, :, part] = (out[:, :, part] * torch.exp(lse[:, :, part] - new)[..., None]
                               + o.float() * torch.exp(l_blk - new)[..., None])
            lse[:, :, part] = new
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    return out.to(q.dtype), lse


def _ring_backward(ring: _Ring, dout, q, k, v, out, lse, doc_ids, index):
    """dq, dk, dv: K/V go round again; an fp32 dK/dV accumulator travels with them back to its owner."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dkv_pending = None
    for step in range(ring.size):
        pending = ring.exchange(kv) if step + 1 < ring.size else None
        j, rows, cols, causal = ring.block(step)
        grads: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        kb = vb = None
        for part in _parts(ring, rows, cols, doc_ids):
            mask = _mask_for(ring, j, part, cols, doc_ids)
            if _outside(mask):
                continue
            if kb is None:
                kb, vb = (_expand(t[:, :, cols], index).contiguous() for t in kv.unbind(0))
            gq, gk, gv = _block_backward(dout[:, :, part], q[:, :, part].contiguous(), kb, vb, out[:, :, part],
                                         lse[:, :, part], causal and mask is None, mask)
            dq[:, :, part] += gq.float()
            # (one part, as without a mask: kept in the block's dtype until added; parts summed in fp32)
            grads = (gk, gv) if grads is None else (grads[0].float() + gk.float(), grads[1].float() + gv.float())
        if dkv_pending is not None:  # the accumulator of block j, from the previous rank
            _wait(dkv_pending[1])
            dkv = dkv_pending[0]
        for slot, g in enumerate(grads or ()):
            _add_heads(dkv[slot][:, :, cols], g.float(), index)
        dkv_pending = ring.exchange(dkv)
        if pending is not None:
            _wait(pending[1])
            kv = pending[0]
    dkv, works = cast(tuple, dkv_pending)  # (the loop ran: C > 1 steps)
    _wait(works)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _add_heads(acc: torch.Tensor, g: torch.Tensor, index: Optional[torch.Tensor]) -> None:
    """``acc [b, G, m, d] += g [b, H, m, d]`` summed over the query heads of each K/V head (in place)."""
    if index is None:
        acc += g
    else:
        acc.index_add_(1, index, g)


_EXCLUDED: list = []  # torch.compiler.disable(_ring_attention), made once by exclude_ring_from_compile


def exclude_ring_from_compile() -> None:
    """Make the ring's form excluded from compilation (``torch.compiler.disable``, which imports
    ``torch._dynamo``: about 1.3 CPU-s a process that never compiles should not pay). Called where compilation
    starts (:func:`tnlg.training.compile.compile_blocks`), before anything is traced."""
    if not _EXCLUDED:
        _EXCLUDED.append(torch.compiler.disable(_ring_attention, reason="the ring's P2P runs eager"))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup],
                   doc_ids: Optional[torch.Tensor] = None,
                   kv_heads: Optional[Sequence[int] | torch.Tensor] = None,
                   window: Optional[int] = None) -> torch.Tensor:
    """:func:`_ring_attention`, run eager under ``torch.compile``: one graph break, as Dynamo does not trace the
    ring's P2P (after :func:`exclude_ring_from_compile`; a compilation that did not call it breaks twice, at
    the ``disable`` made while tracing and at the ring)."""
    if torch.compiler.is_compiling():
        excluded = _EXCLUDED[0] if _EXCLUDED else torch.compiler.disable(_ring_attention)
        return excluded(q, k, v, group, doc_ids, kv_heads, window)
    return _ring_attention(q, k, v, group, doc_ids, kv_heads, window)


def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup],
                    doc_ids: Optional[torch.Tensor] = None,
                    kv_heads: Optional[Sequence[int] | torch.Tensor] = None,
                    window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence: ``[b, H, 2c, d]``.

    ``q`` ``[b, H, 2c, d]``, ``k``/``v`` ``[b, G, 2c, d]``: this rank's two chunks (module docstring).
    ``doc_ids`` ``[b, s]`` (whole sequence): attention stays inside a document. ``kv_heads`` (length
    ``H``): the K/V head of each query head; default ``H // G`` consecutive query heads per K/V head
    (transformers' ``repeat_kv``). ``window``: a sliding window (the query at ``p`` sees the keys
    ``p - window + 1 .. p``), in every block's mask; a block wholly outside it (or outside the documents) is
    skipped, its K/V only passed on. ``group`` ``None`` or of one rank: plain causal SDPA.
    """
    h, g = q.shape[1], k.shape[1]
    index = None
    if kv_heads is not None or h != g:
        index = torch.as_tensor(kv_heads if kv_heads is not None else [i // (h // g) for i in range(h)],
                                dtype=torch.long, device=q.device)
    if doc_ids is not None and (doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool):
        raise ValueError(f"doc_ids must be the whole sequence's integer document ids [b, s] (document_ids() of a "
                         f"[b, s, s] mask), got {tuple(doc_ids.shape)} {doc_ids.dtype}.")
    if group is None or dist.get_world_size(group) == 1:
        return _single(q, k, v, doc_ids, index, window)
    if doc_ids is not None:
        doc_ids = doc_ids.to(q.device)
    return _RingAttention.apply(q, k, v, group, doc_ids, index, window)


def _single(q, k, v, doc_ids, index, window: Optional[int] = None) -> torch.Tensor:
    """CP 1: the whole sequence is local."""
    k, v = _expand(k, index), _expand(v, index)
    if doc_ids is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pos = torch.arange(q.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_block_mask(pos, pos, doc_ids, doc_ids, window))


# ----------------------------------------------------------------------------------------- model and data

def context_positions(local_len: int, ps, device=None) -> torch.Tensor:
    """``[1, 2c]`` global positions of this CP rank's ``local_len = 2c`` tokens (``ps``: its parallel state)."""
    return chunk_positions(local_len * ps.cp_size, ps.cp_size, ps.cp_rank, device).unsqueeze(0)


class RingAttention:
    """The attention core of a layer under context parallelism (swapped into the layer's core slot when the
    model is built, :func:`context_parallel_attention`): :func:`ring_attention` over the CP group, with the
    whole sequence's document ids ``[b, s]`` as the mask (or ``None``: causal). GQA: the ring carries this
    rank's K/V groups and ``kv_heads`` maps each query head to its group. ``window``: the layer's sliding
    window (blocks outside it skipped). Attention dropout is not run in the
    ring (the options refuse it with CP, docs/context_parallel.md)."""

    def __init__(self, group: dist.ProcessGroup, kv_heads: Optional[Sequence[int]] = None,
                 window: Optional[int] = None):
        self.group, self.kv_heads, self.window = group, kv_heads, window

    def mask(self, ctx, s: int, kv_len: int, device) -> Optional[torch.Tensor]:
        """The mask as the ring takes it: the forward's (``ctx``, a :class:`tnlg.model.forward.ForwardContext`)
        whole sequence's document ids ``[b, s]`` as given, or ``None`` (causal); the window is the ring's own
        (no KV cache under context parallelism). Each step builds its block's mask from them (module
        docstring: what it costs)."""
        if ctx.kv_cache is not None:
            raise ValueError("the ring attention of context parallelism runs no KV cache.")
        return ctx.attention_mask

    def keys_values(self, k: torch.Tensor, v: torch.Tensor, attention_mask, dropout: float):
        """The keys and values as they are (the ring reads the groups itself)."""
        return k, v, False

    def __call__(self, q, k, v, attention_mask, causal: bool, dropout: float, gqa: bool = False,
                 tp_rng_state=None) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, doc_ids=attention_mask, kv_heads=self.kv_heads,
                              window=self.window)


def context_parallel_attention(ps, kv_heads: Optional[Sequence[int]] = None,
                               window: Optional[int] = None) -> Optional[RingAttention]:
    """The attention core a layer takes under context parallelism (``ps.cp_size > 1``): :class:`RingAttention`
    over the CP group (with the layer's sliding ``window``); ``None`` at CP 1 (the layer keeps its local core)."""
    return RingAttention(ps.cp_group, kv_heads, window) if ps.cp_size > 1 else None


class TokenPositions:
    """The positions of a forward's tokens when the caller gives none: ``offset .. offset + s - 1`` (``[1, s]``),
    or with context parallelism the global positions of this CP rank's two chunks (:func:`context_positions`).
    Chosen when the model is built; :meth:`check` refuses incremental decoding under CP."""

    def __init__(self, ps):
        self.ps = ps if ps.cp_size > 1 else None

    def check(self, incremental: bool) -> None:
        """``ValueError`` for generation (a KV cache, ``last_only``) under context parallelism."""
        if incremental and self.ps is not None:
            raise ValueError("generation (a KV cache, last_only) does not run with context parallelism: load the "
                             "model at context parallel size 1 to generate.")

    def local_length(self, seq_length: int) -> int:
        """The tokens of a ``seq_length`` training sample this rank holds (its CP share)."""
        return seq_length // (1 if self.ps is None else self.ps.cp_size)

    def __call__(self, seq_len: int, offset: int = 0, device=None) -> torch.Tensor:
        if self.ps is not None:  # this CP rank's two chunks: their global positions
            return context_positions(seq_len, self.ps, device)
        return torch.arange(offset, offset + seq_len, device=device).unsqueeze(0)



def context_parallel_batch(batch: Union[Batch, dict], ps) -> Batch:
    """This CP rank's part of a batch of whole samples (``[b, s]`` each): its two chunks of ``tokens``,
    ``labels``, ``loss_mask`` and ``position_ids`` (given ones, e.g. reset at documents; else the model
    takes the global positions), and for an ``attention_mask`` (document ids ``[b, s]``, or a mask
    ``[b, s, s]``) the whole sequence's document ids ``[b, s]`` (:func:`document_ids`), which the ring takes. No
    communication."""
    batch = Batch.of(batch)
    if ps.cp_size == 1:
        return batch

    def part(name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "attention_mask":
            return document_ids(t)
        return split_for_context_parallel(t, ps.cp_size, ps.cp_rank, dim=1) if t.dim() >= 2 else t
    return batch.map(part)
