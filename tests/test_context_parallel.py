"""Ring attention across context-parallel ranks against full-sequence causal attention in one process.

Each check builds q/k/v for the whole sequence from one seed on every rank, gives each rank its two
chunks (``r`` and ``2C-1-r``), runs the ring over a CP group, and compares this rank's output and the
q/k/v gradients of its chunks with ``F.scaled_dot_product_attention`` over the whole sequence (K/V heads
repeated per query head, an explicit causal/document mask): CP 2 and 4, multi-head and grouped-query
(6 query heads, 2 K/V heads), with document boundaries. One spawn of 4 processes does every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tnlg.parallel.context import (chunk_positions, check_context_parallel_length, document_ids,
                                   gather_from_context_parallel, ring_attention, split_for_context_parallel)
from .pool import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(b, h, g, s, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=gen) for n in (h, g, g))
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.randn(b, h, s, d, generator=gen).to(dtype)


def _documents(b, s, seed=1):
    """``[b, s, s]`` causal masks with random document boundaries (True = may attend)."""
    gen = torch.Generator().manual_seed(seed)
    seg = torch.cumsum((torch.rand(b, s, generator=gen) < 0.15).long(), dim=1)
    return torch.ones(s, s, dtype=torch.bool).tril() & (seg[:, :, None] == seg[:, None, :])


def _reference(q, k, v, dout, mask):
    """Full-sequence attention in fp64: output and q/k/v gradients (independent of the ring)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask.unsqueeze(1))
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _ring_case(group, cp, cp_rank, h, g, with_docs, dtype=torch.float32, s=32):
    b, d = 2, 8
    q, k, v, dout = _inputs(b, h, g, s, d, dtype)
    mask = _documents(b, s) if with_docs else None
    ref = _reference(q, k, v, dout, mask)
    mine = [split_for_context_parallel(t, cp, cp_rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    docs = None if mask is None else document_ids(mask)
    out = ring_attention(*mine, group, doc_ids=docs)
    out.backward(split_for_context_parallel(dout, cp, cp_rank, dim=2))
    got = (out.detach(), *(t.grad for t in mine))
    want = tuple(split_for_context_parallel(t, cp, cp_rank, dim=2).to(dtype) for t in ref)
    full = gather_from_context_parallel(out.detach(), group, dim=2)
    return got, want, full, ref[0].to(dtype)


def _groups(world, size):
    """Every rank creates every CP group of ``size`` (collective); returns this rank's."""
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        grp = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = grp
    return mine


def _all_cases(_ps):
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for cp in (2, 4):
        group = _groups(world, cp)
        cp_rank = dist.get_rank(group)
        for name, h, g, docs in (("mha", 4, 4, False), ("gqa", 6, 2, False), ("docs", 4, 4, True),
                                 ("gqa-docs", 6, 2, True)):
            results[(cp, name)] = _ring_case(group, cp, cp_rank, h, g, docs)
        results[(cp, "bf16")] = _ring_case(group, cp, cp_rank, 6, 2, False, torch.bfloat16)
    return rank, results


@pytest.fixture(scope="module")
def ring_results():
    return run_distributed(_all_cases, 4, 1, timeout_s=120)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", ["mha", "gqa", "docs", "gqa-docs"])
def test_ring_attention_equals_full_sequence_attention(ring_results, cp, case):
    for rank, results in ring_results:
        got, want, full, full_ref = results[(cp, case)]
        for what, a, e in zip(("output", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, e, **TOL, msg=lambda m, w=what, r=rank: f"rank {r} {w}: {m}")
        torch.testing.assert_close(full, full_ref, **TOL)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_in_bf16_merges_in_fp32(ring_results, cp):
    """bf16 inputs: within bf16 rounding of the fp64 reference (the merge and dK/dV accumulate in fp32)."""
    for rank, results in ring_results:
        got, want, _, _ = results[(cp, "bf16")]
        for what, a, e in zip(("output", "dq", "dk", "dv"), got, want):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m, w=what, r=rank: f"rank {r} {w}: {m}")


def test_chunks_are_megatrons_causal_load_balance():
    """Rank r holds chunks r and 2C-1-r; the ranks' positions together are every position once."""
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    allpos = torch.cat([chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(allpos.tolist()) == list(range(24))
    x = torch.arange(2 * 16).view(2, 16)
    assert split_for_context_parallel(x, 2, 1).tolist() == [list(range(4, 12)), list(range(20, 28))]


def test_a_length_2c_does_not_divide_is_one_clear_error():
    with pytest.raises(ValueError, match=r"multiple of 8"):
        check_context_parallel_length(30, 4)


def test_document_ids_mark_each_documents_first_position():
    mask = _documents(1, 12)
    ids = document_ids(mask)[0]
    same = ids[:, None] == ids[None, :]
    assert torch.equal(same & torch.ones(12, 12, dtype=torch.bool).tril(), mask[0])


@pytest.mark.parametrize("causal,docs", [(True, False), (False, False), (False, True)])
def test_the_fp32_block_maths_equals_the_cpu_kernel(causal, docs):
    """The block path of devices without the CPU kernel (fp32 maths, explicit LSE) against the CPU kernel."""
    from tnlg.parallel.context import _block_backward, _block_forward, _block_mask, _math_backward, _math_forward
    q, k, v, dout = _inputs(2, 4, 4, 12, 8, torch.float32)
    mask = None
    if docs:  # a query block after its key block, some rows seeing none of these keys
        ids = document_ids(_documents(2, 24, seed=3))
        pos_q, pos_k = torch.arange(12, 24), torch.arange(12)
        mask = _block_mask(pos_q, pos_k, ids[:, pos_q], ids[:, pos_k])
        assert (~mask.any(-1)).any()
    out, lse = _block_forward(q, k, v, causal, mask)
    m_out, m_lse = _math_forward(q, k, v, causal, mask)
    if mask is not None:
        m_lse = m_lse.masked_fill(~mask.any(dim=-1), float("-inf"))
    torch.testing.assert_close(m_out, out, **TOL)
    torch.testing.assert_close(m_lse, lse, **TOL)
    safe = lse.clamp(min=-1e4)  # a merged LSE is always finite: give the empty rows any finite value
    for a, e in zip(_math_backward(dout, q, k, v, out, safe, causal, mask),
                    _block_backward(dout, q, k, v, out, safe, causal, mask)):
        torch.testing.assert_close(a, e, **TOL)
