"""Packed documents' masks cost O(s), not O(s^2): above the mask budget local attention runs per chunk of
queries, each chunk's mask built from the documents' ids over the keys it can see, and gives what the whole
mask gives.

The reference for the attention core is independent code: fp64 softmax attention with the block-causal (and
sliding-window) mask written out from its definition. The whole model per query chunk is compared with the
same model under the whole mask (losses and every gradient, fp32, 1e-6) at TP 1 (with recomputation) and TP 2
(6 heads over 2 KV groups: uneven heads, sequence parallelism). Memory is read by a dispatch mode that counts
the bytes of live storages (tnlg.plan.tracker.StepTracker), at a sequence whose whole mask alone exceeds the
bound the chunks keep to; a fine-tuning batch (the SFT dataset's packed items) at a long ``seq_length`` runs
forward and backward within it too. The ring of context parallelism runs a block whose mask exceeds the budget
in parts of its query rows, exact against fp64 attention at CP 2 and 4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tnlg.config import GPTConfig
from tnlg.parallel import masks

from .pool import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

S, B = 64, 2
LLAMA = dict(num_layers=3, hidden_size=48, num_attention_heads=6, seq_length=S, vocab_size=97,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2, add_bias_linear=False, sliding_window=5, window_layers=[0, 1, 0])
TOL = dict(rtol=1e-5, atol=1e-6)  # (the whole mask's own fp32 rounding against fp64 is 1.4e-6 on values up to 6)


def _documents(gen: torch.Generator, rows: int, s: int, longest: int) -> torch.Tensor:
    """``[rows, s]`` document ids: contiguous stretches of random lengths (1 .. ``longest``) named by a
    running label (not their start), one row a single document."""
    ids = torch.empty(rows, s, dtype=torch.int64)
    for r in range(rows):
        at, label = 0, 10 * r + 3
        while at < s:
            n = s if r == rows - 1 and rows > 1 else int(torch.randint(1, longest + 1, (1,), generator=gen))
            ids[r, at:at + n] = label
            at, label = at + n, label + 1
    return ids


def _allowed(ids, s: int, window) -> torch.Tensor:
    """``[b, 1, s, s]``: query i sees key j when j <= i, both in one document, and i - j < window."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (i - j < window)
    if ids is None:
        return ok[None, None]
    return (ok[None] & (ids[:, :, None] == ids[:, None, :]))[:, None]


def _reference(q, k, v, allowed, kv_index):
    """fp64 softmax attention, each query head reading its KV head ``kv_index[h]``."""
    if kv_index is not None:
        k, v = k[:, list(kv_index)], v[:, list(kv_index)]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


KV = {"mha": (None, False), "gqa_native": ((0, 0, 1, 1), True), "gqa_index": ((0, 1, 0, 1), False)}


def _core_run(core, ids, q, k, v, w, dropout=0.0):
    """The core as the layer calls it (mask, keys and values, attention): the mask and the output, with
    ``(w * y).sum()``'s gradients in ``q``, ``k``, ``v``."""
    from tnlg.model.forward import ForwardContext
    ctx = ForwardContext(attention_mask=ids)
    mask = core.mask(ctx, q.shape[2], k.shape[2], q.device)
    kk, vv, gqa = core.keys_values(k, v, mask, dropout)
    y = core(q, kk, vv, mask, mask is None, dropout, gqa)
    (w * y).sum().backward()
    return mask, y


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("docs", [True, False])
@pytest.mark.parametrize("size", [1, 7, S - 1])
def test_attention_per_query_chunk_is_attention_under_the_whole_mask(monkeypatch, kv, window, docs, size):
    from tnlg.model.attention import LocalAttention
    from tnlg.parallel.random import TPRandom
    if not docs and window is None:
        pytest.skip("causal attention builds no mask")
    gen = torch.Generator().manual_seed(size + 31 * (window or 0) + docs)
    ids = _documents(gen, B, S, 12) if docs else None
    kv_index, native = KV[kv]
    heads, groups, d = 4, 2 if kv_index else 4, 8
    q64, k64, v64 = (torch.randn(B, n, S, d, generator=gen, dtype=torch.float64) for n in (heads, groups, groups))
    w = torch.randn(B, heads, S, d, generator=gen)
    core = LocalAttention(TPRandom(0, 0, torch.device("cpu")), kv_index, native, window)
    rows = 1 if ids is None else B
    results = {}
    for name, budget in (("whole", masks.MASK_BUDGET), ("chunks", rows * S * size)):
        monkeypatch.setattr(masks, "MASK_BUDGET", budget)
        q, k, v = (t.float().requires_grad_() for t in (q64, k64, v64))
        mask, y = _core_run(core, ids, q, k, v, w)
        assert isinstance(mask, masks.QueryChunks) == (name == "chunks")
        results[name] = (y, q.grad, k.grad, v.grad)
    assert len(mask.spans()) == -(-S // size)
    q, k, v = (t.clone().requires_grad_() for t in (q64, k64, v64))
    ref = _reference(q, k, v, _allowed(ids, S, window), kv_index)
    (w.double() * ref).sum().backward()
    expected = (ref.detach(), q.grad, k.grad, v.grad)
    for got in results.values():  # (fp32 against fp64)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-5)
    for a, b in zip(results["chunks"], results["whole"]):
        torch.testing.assert_close(a, b, **TOL)


def test_a_chunk_reads_only_the_keys_its_queries_can_see(monkeypatch):
    """Key ranges: from the earliest document start (over the rows) of the chunk's first query, or its
    window, to its last query."""
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2],
                        [5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6]])
    chunks = masks.QueryChunks(ids, 12, 12, None, budget=2 * 12 * 4)
    assert chunks.spans() == [(0, 4, 0, 4), (4, 8, 0, 8), (8, 12, 5, 12)]  # (row 1's document from 0)
    windowed = masks.QueryChunks(ids, 12, 12, 2, budget=2 * 12 * 4)
    assert windowed.spans() == [(0, 4, 0, 4), (4, 8, 3, 8), (8, 12, 7, 12)]
    alone = masks.QueryChunks(None, 12, 12, 3, budget=12 * 5)
    assert alone.spans() == [(0, 5, 0, 5), (5, 10, 3, 10), (10, 12, 8, 12)]
    assert alone.rows(5, 10, 3, 10).shape == (1, 1, 5, 7)


def test_attention_dropout_per_chunk_is_replayed_in_backward(monkeypatch):
    """With dropout, attention is linear in v: y = A v with A the dropped probabilities, so <dL/dv, v> equals
    <w, y> for L = <w, y> exactly when backward recomputes every chunk with the forward's own dropout."""
    from tnlg.model.attention import LocalAttention
    from tnlg.parallel.random import TPRandom
    gen = torch.Generator().manual_seed(5)
    ids = _documents(gen, B, S, 20)
    q0, k0, v0, w = (torch.randn(B, 4, S, 8, generator=gen) for _ in range(4))
    monkeypatch.setattr(masks, "MASK_BUDGET", B * S * 8)
    outs = []
    for dropout in (0.0, 0.3):
        core = LocalAttention(TPRandom(0, 0, torch.device("cpu")), None, False, None)
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        mask, y = _core_run(core, ids, q, k, v, w, dropout)
        assert isinstance(mask, masks.QueryChunks) and len(mask.spans()) == S // 8
        torch.testing.assert_close((v.grad * v0).sum(), (w * y).sum().detach(), rtol=1e-5, atol=1e-5)
        outs.append(y.detach())
    assert not torch.allclose(outs[0], outs[1])  # (dropout did drop)


def _model_loss_and_grads(ps, fields: dict, budget: int, ids: torch.Tensor, tokens: torch.Tensor):
    """Loss and every parameter's gradient of a GPT built from ``fields`` on ``ps``, under ``budget``; how many
    chunk masks were built; how many whole document masks."""
    from tnlg.model import GPT
    from tnlg.model import attention
    counts = {"rows": 0, "whole": 0}
    rows, whole, saved_budget = masks.QueryChunks.rows, attention.document_mask, masks.MASK_BUDGET

    def counted_rows(self, *a):
        counts["rows"] += 1
        return rows(self, *a)

    def counted_whole(*a):
        counts["whole"] += 1
        return whole(*a)
    masks.MASK_BUDGET, masks.QueryChunks.rows, attention.document_mask = budget, counted_rows, counted_whole
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**fields), ps).train()
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(ids.shape),
                     position_ids=positions, attention_mask=ids)
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}, counts
    finally:
        masks.MASK_BUDGET, masks.QueryChunks.rows, attention.document_mask = saved_budget, rows, whole


def _whole_and_chunks(ps, fields: dict, chunk: int, seed: int) -> dict:
    """Worker (and TP 1): the model's loss and gradients under the whole mask and per chunks of ``chunk``
    queries; the largest differences and the mask counts."""
    gen = torch.Generator().manual_seed(seed)
    ids = _documents(gen, B, S, 16)
    tokens = torch.randint(0, 97, (B, S + 1), generator=gen)
    loss_w, grads_w, counts_w = _model_loss_and_grads(ps, fields, masks.MASK_BUDGET, ids, tokens)
    loss_c, grads_c, counts_c = _model_loss_and_grads(ps, fields, B * S * chunk, ids, tokens)
    return dict(loss=abs(loss_w - loss_c), grads=max(float((grads_w[n] - grads_c[n]).abs().max()) for n in grads_w),
                whole=counts_w, chunks=counts_c)


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_the_model_per_query_chunk_trains_as_under_the_whole_mask(recompute):
    from tnlg.parallel.state import ParallelState
    out = _whole_and_chunks(ParallelState.single(), dict(LLAMA, recompute_granularity=recompute), 9, 1)
    assert out["loss"] <= 1e-6 and out["grads"] <= 1e-6, out
    # the whole mask: once per forward for the two full layers and once for the window's (not once per layer,
    # nor again when a layer is recomputed); per chunk: every chunk of every layer built in forward and again
    # in backward (with full recomputation a third time: the block's forward runs again)
    assert out["whole"] == {"rows": 0, "whole": 2}, out
    runs = 3 if recompute == "full" else 2
    assert out["chunks"]["whole"] == 0 and out["chunks"]["rows"] == 3 * runs * -(-S // 9), out


def test_the_model_per_query_chunk_at_tp2_with_uneven_heads_and_sequence_parallelism():
    fields = dict(LLAMA, sequence_parallel=True)
    for out in run_distributed(_whole_and_chunks, 2, 2, fields, 5, 2):
        assert out["loss"] <= 1e-6 and out["grads"] <= 1e-6, out
        assert out["chunks"]["rows"] > 0 and out["chunks"]["whole"] == 0, out


def _peak_bytes(fn) -> tuple[int, int]:
    """The most bytes of storages created by ``fn()`` (forward and backward) alive at once, and the most
    elements of a bool tensor it created (a mask)."""
    from tnlg.plan.tracker import StepTracker
    tracker = StepTracker()
    with tracker, tracker.phase("step"):
        fn()
    return tracker.phases[0].peak, tracker.largest_new.get(torch.bool, 0)


def test_one_attention_layer_per_query_chunk_stays_under_what_the_whole_mask_needs(monkeypatch):
    """s = 4096 packed documents: the whole bool mask alone is s^2 = 16 MiB (SDPA's additive copy 64 MiB more);
    per chunk of 64 queries forward and backward peak under 4 MiB."""
    from tnlg.model.attention import ParallelAttention
    from tnlg.model.forward import ForwardContext
    from tnlg.model.spec import block_spec
    from tnlg.parallel.random import TPRandom
    from tnlg.parallel.state import ParallelState
    s = 4096
    cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=s, vocab_size=97)
    ps = ParallelState.single()
    layer = ParallelAttention(cfg, ps, 0, TPRandom(0, 0, ps.device), spec=block_spec(cfg, ps, 0)).train()
    gen = torch.Generator().manual_seed(3)
    ids = _documents(gen, 1, s, 600)[:1]
    x0 = torch.randn(s, 1, 16, generator=gen)

    def step():
        x = x0.clone().requires_grad_()
        layer(x, ForwardContext(attention_mask=ids)).sum().backward()
    peaks = {}
    for name, budget in (("whole", masks.MASK_BUDGET), ("chunks", s * 64)):
        monkeypatch.setattr(masks, "MASK_BUDGET", budget)
        peaks[name] = _peak_bytes(step)
    assert peaks["whole"][0] >= s * s and peaks["whole"][1] == s * s, peaks  # (the tracker sees the whole mask)
    assert peaks["chunks"][0] < 4 << 20 and peaks["chunks"][1] <= s * 64, peaks


def test_a_packed_fine_tuning_batch_at_a_long_seq_length_needs_no_whole_mask(monkeypatch):
    """The SFT dataset's packed items (document ids per position) at seq_length 8192 through a 2-layer GPT,
    forward and backward, at the default budget scaled down 64 times (at the default a row of 8192 positions
    is just within it): no mask above the budget, everything together under the whole bool mask's s^2 bytes
    alone (which SDPA would copy into 4 s^2 bytes of fp32 per layer), and each sample's logits those of the
    sample alone."""
    from tnlg.data.sft import pack, sequence_item
    from tnlg.model import GPT
    s = 8192
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 400, size=60)
    samples = [(rng.integers(1, 97, size=n), np.ones(n, dtype=np.float32)) for n in lengths]
    bins = pack([len(ids) for ids, _ in samples], s + 1)
    item = sequence_item([samples[j] for j in bins[0]], s, 0)
    assert len(bins[0]) > 10 and item["attention_mask"].shape == (s,)  # O(s) per item
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=s, vocab_size=97,
                    position_embedding_type="rope")
    torch.manual_seed(0)
    model = GPT(cfg).train()
    batch = {k: v[None] for k, v in item.items()}
    monkeypatch.setattr(masks, "MASK_BUDGET", masks.MASK_BUDGET // 64)
    losses = []

    def step():
        loss = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                     position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
        loss.backward()
        losses.append(loss.detach())
    peak, largest_mask = _peak_bytes(step)
    assert peak < s * s and largest_mask <= masks.MASK_BUDGET, (peak, largest_mask)
    # each of the first samples alone (no mask, positions from 0) gives the packed item's logits there
    with torch.no_grad():
        packed = model(batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
        at = 0
        for j in bins[0][:3]:
            n = len(samples[j][0])
            alone = model(batch["tokens"][:, at:at + n])
            torch.testing.assert_close(packed[:, at:at + n], alone, rtol=0, atol=1e-5)
            at += n


def _ring_in_parts(_ps) -> dict:
    """Worker (world 4): the ring at CP 2 and CP 4 (6 heads over 2 KV groups, documents) under the default
    budget and one that cuts every block into parts of a few query rows; how many parts the largest block
    took."""
    import torch.distributed as dist

    from tnlg.parallel import context

    from .test_context_parallel import _groups, _ring_case
    saved_budget, saved_parts = masks.MASK_BUDGET, context.query_parts
    most = [0]

    def counted(*a):
        parts = saved_parts(*a)
        most[0] = max(most[0], len(parts))
        return parts
    results: dict = {}
    try:
        context.query_parts = counted
        for cp in (2, 4):
            group = _groups(dist.get_world_size(), cp)
            for name, budget in (("whole", saved_budget), ("parts", 2 * 16 * 3)):
                masks.MASK_BUDGET, most[0] = budget, 0
                results[(cp, name)] = _ring_case(group, cp, dist.get_rank(group), 6, 2, True), most[0]
    finally:
        masks.MASK_BUDGET, context.query_parts = saved_budget, saved_parts
    return results


def test_the_ring_runs_a_block_whose_mask_exceeds_the_budget_in_parts_of_its_queries():
    for results in run_distributed(_ring_in_parts, 4, 1, timeout_s=120):
        for cp in (2, 4):
            (got, want, full, full_ref), parts = results[(cp, "parts")]
            (whole, _, _, _), one = results[(cp, "whole")]
            assert one == 1 and parts >= 2, (one, parts)
            for a, e, w in zip(got, want, whole):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)  # (fp32 against fp64)
                torch.testing.assert_close(a, w, **TOL)
            torch.testing.assert_close(full, full_ref, rtol=1e-5, atol=1e-5)
