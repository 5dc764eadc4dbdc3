"""Each TP layer and the vocab-parallel cross-entropy against plain torch.nn on the same full weights."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tnlg.config import padded_vocab_size, partition_sizes
from tnlg.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                           vocab_parallel_cross_entropy)
from tnlg.parallel.sharding import shard_of
from .pool import run_distributed

from .conftest import LAYOUTS

ATOL = 1e-5


def _close(a, b, what):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, atol=ATOL, rtol=1e-5), f"{what}: max abs err {err}"


def _slice_last(t, sizes, rank):
    start = sum(sizes[:rank])
    return t[..., start:start + sizes[rank]]


def _reference_linear(W, b, x, gy):
    """A plain ``nn.Linear`` holding ``W`` and ``b``, run forward on a copy of ``x`` and backward from the output
    gradient ``gy``: (the layer, the input copy holding its gradient, the output)."""
    ref = nn.Linear(W.shape[1], W.shape[0])
    with torch.no_grad():
        ref.weight.copy_(W), ref.bias.copy_(b)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * gy).sum().backward()
    return ref, xr, yr


def _layers_body(ps):
    tp, r = ps.tp_size, ps.tp_rank
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=gen)
    out = 10                                       # uneven at tp=4: [3, 3, 2, 2]
    sizes = partition_sizes(out, tp)
    W, b = torch.randn(out, 8, generator=gen), torch.randn(out, generator=gen)
    gy = torch.randn(2, 5, out, generator=gen)
    ref, xr, yr = _reference_linear(W, b, x, gy)

    # column parallel, both output modes
    for gather in (True, False):
        col = ColumnParallelLinear(8, out, ps, gather_output=gather, partition_sizes=sizes)
        with torch.no_grad():
            col.weight.copy_(shard_of(W, col.weight, r)), col.bias.copy_(shard_of(b, col.bias, r))
        xi = x.clone().requires_grad_()
        y = col(xi)
        g = gy if gather else _slice_last(gy, sizes, r)
        _close(y, yr if gather else _slice_last(yr, sizes, r), f"column out gather={gather}")
        (y * g).sum().backward()
        _close(xi.grad, xr.grad, f"column input grad gather={gather}")
        _close(col.weight.grad, shard_of(ref.weight.grad, col.weight, r), "column weight grad")
        _close(col.bias.grad, shard_of(ref.bias.grad, col.bias, r), "column bias grad")

    # row parallel (in=10 split unevenly, out=8), both input modes
    W2, b2 = torch.randn(8, out, generator=gen), torch.randn(8, generator=gen)
    x2 = torch.randn(2, 5, out, generator=gen)
    g2 = torch.randn(2, 5, 8, generator=gen)
    ref2, x2r, y2r = _reference_linear(W2, b2, x2, g2)
    for parallel_in in (True, False):
        row = RowParallelLinear(out, 8, ps, input_is_parallel=parallel_in, partition_sizes=sizes)
        with torch.no_grad():
            row.weight.copy_(shard_of(W2, row.weight, r)), row.bias.copy_(b2)
        xi = (_slice_last(x2, sizes, r) if parallel_in else x2).clone().requires_grad_()
        y = row(xi)
        _close(y, y2r, f"row out input_is_parallel={parallel_in}")
        (y * g2).sum().backward()
        _close(xi.grad, _slice_last(x2r.grad, sizes, r) if parallel_in else x2r.grad, "row input grad")
        _close(row.weight.grad, shard_of(ref2.weight.grad, row.weight, r), "row weight grad")
        _close(row.bias.grad, ref2.bias.grad, "row bias grad (replicated)")

    # vocab-parallel embedding, vocab 13 that tp does not divide
    V, H = 13, 8
    E = torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (3, 7), generator=gen)
    ge = torch.randn(3, 7, H, generator=gen)
    emb = VocabParallelEmbedding(V, H, ps, padded_vocab_size(V, tp, divisible_by=1))
    with torch.no_grad():
        emb.weight.copy_(shard_of(E, emb.weight, r))
    ref_e = nn.Embedding(V, H)
    with torch.no_grad():
        ref_e.weight.copy_(E)
    ye, yer = emb(ids), ref_e(ids)
    _close(ye, yer, "embedding out")
    (ye * ge).sum().backward()
    (yer * ge).sum().backward()
    _close(emb.weight.grad, shard_of(ref_e.weight.grad, emb.weight, r), "embedding weight grad")

    # vocab-parallel cross-entropy: padded columns hold garbage that must not matter
    Vp = padded_vocab_size(V, tp, divisible_by=2)
    logits_full = torch.randn(3, 7, V, generator=gen) * 3
    labels = torch.randint(0, V, (3, 7), generator=gen)
    labels[0, :] = V - 1                           # targets on the last rank's shard
    gl = torch.rand(3, 7, generator=gen)
    padded = torch.cat([logits_full, 50 + torch.randn(3, 7, Vp - V, generator=gen)], dim=-1)
    shard = padded.chunk(tp, dim=-1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, ps, V)
    lr = logits_full.clone().requires_grad_()
    loss_ref = F.cross_entropy(lr.reshape(-1, V), labels.reshape(-1), reduction="none").view(3, 7)
    _close(loss, loss_ref, "cross-entropy loss")
    (loss * gl).sum().backward()
    (loss_ref * gl).sum().backward()
    grad_ref = torch.cat([lr.grad, torch.zeros(3, 7, Vp - V)], dim=-1).chunk(tp, dim=-1)[r]
    _close(shard.grad, grad_ref, "cross-entropy logit grad (padded columns get zero)")
    return True


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_layers_match_torch_nn(world, tp):
    assert all(run_distributed(_layers_body, world, tp))


def test_cross_entropy_rejects_out_of_vocab_target():
    from tnlg.parallel import ParallelState
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_cross_entropy(torch.randn(2, 16), torch.tensor([3, 16]), ParallelState.single(), 16)


def test_cross_entropy_does_not_read_targets_on_the_host():
    """The target range check is no per-step host sync on an accelerator. Tensors on the
    meta device stand in for device tensors: reading one on the host raises, so this runs only if the
    forward pass never syncs. On CPU the check stays one pass with a clear error."""
    from tnlg.parallel import ParallelState
    ps = ParallelState.single()
    logits = torch.empty(2, 5, 16, device="meta", requires_grad=True)
    target = torch.empty(2, 5, dtype=torch.int64, device="meta")
    loss = vocab_parallel_cross_entropy(logits, target, ps, 16)
    assert loss.shape == (2, 5) and loss.device.type == "meta"
    with pytest.raises(ValueError, match=r"target id -100 is outside the vocabulary \[0, 16\)"):
        vocab_parallel_cross_entropy(torch.randn(3, 16), torch.tensor([3, -100, 15]), ps, 16)
    good = vocab_parallel_cross_entropy(torch.zeros(2, 16), torch.tensor([0, 15]), ps, 16)
    torch.testing.assert_close(good, torch.full((2,), math.log(16.0)))



@pytest.mark.parametrize("tp", [1, 2, 3])
def test_layers_initialise_themselves_tp_invariantly(tp):
    """A layer used alone holds real values, each rank's shard is the matching slice of
    the TP=1 layer's (zero-padded vocabulary rows), and ``describe`` says how the layer splits."""
    from tnlg.parallel import ParallelState
    from tnlg.parallel.initialization import init_normal
    from tnlg.parallel.sharding import ShardSpec

    sizes = partition_sizes(12, tp)
    cases = [  # (class, positional args at TP size t, keyword args at t, describe's args at t)
        (ColumnParallelLinear, lambda t: (8, 12), lambda t: dict(partition_sizes=partition_sizes(12, t),
                                                                  init_method=init_normal(0.5)),
         (8, 12, sizes)),
        (RowParallelLinear, lambda t: (12, 8), lambda t: dict(partition_sizes=partition_sizes(12, t)),
         (12, 8, sizes)),
        (VocabParallelEmbedding, lambda t: (50, 16), lambda t: dict(padded_size=padded_vocab_size(50, t, 8)),
         (50, 16, padded_vocab_size(50, tp, 8), tp)),
    ]
    for cls, args, kw, describe_args in cases:
        ref = cls(*args(1), ParallelState.single(), seed=3, init_key="layer", **kw(1))
        assert ref.weight.std() > 0.01 and torch.isfinite(ref.weight).all(), cls.__name__
        for r in range(tp):
            layer = cls(*args(tp), ParallelState.for_virtual_rank(tp, r), seed=3, init_key="layer", device="cpu",
                        **kw(tp))
            for name, p in layer.named_parameters():
                full = getattr(ref, name)[:50] if cls is VocabParallelEmbedding else getattr(ref, name)
                assert torch.equal(p, shard_of(full, p, r)), f"{cls.__name__}.{name} tp={tp} rank {r}"
            described = {n: s for n, s in cls.describe(*describe_args).items() if s is not None}
            assert {n: ShardSpec.of(p) for n, p in layer.named_parameters()} == described, cls.__name__


def test_split_marks_read_back_through_one_spec():
    """The marks a spec writes read back as the same spec, travel onto a re-created parameter only when copied,
    and give each rank's rows: a padded split (5 rows as 3 + 3, the last one a zero row) and an overlapping one
    (8 rows held as rows 0-3, 2-5 and 4-7: the gradient norm counts rows 0-3, 4-5 and 6-7, each once). A
    parameter marked ``tp_sharded`` alone is counted whole by the norm."""
    from tnlg.parallel import ParallelState
    from tnlg.parallel.sharding import (ShardSpec, copy_tp_attributes, counted_rows, full_shape, gather_full,
                                        is_tp_sharded, shard_of, uncounted_elements)

    full = torch.arange(16.0).reshape(8, 2)
    shared = ShardSpec((8, 2), 0, (4, 4, 4), (0, 2, 4))
    p = shared.parameter(1)
    assert ShardSpec.of(p) == shared and full_shape(p) == (8, 2) and is_tp_sharded("w", p, ParallelState.single())
    assert ShardSpec.of(copy_tp_attributes(p, nn.Parameter(p.detach().clone()))) == shared
    assert ShardSpec.of(nn.Parameter(p.detach().clone())) == ShardSpec((4, 2))  # an uncopied re-wrap is unmarked
    assert [counted_rows(p, r) for r in range(3)] == [(0, 4), (2, 4), (2, 4)]
    assert [uncounted_elements(p, r) for r in range(3)] == [0, 4, 4]
    assert torch.equal(shard_of(full, p, 1), full[2:6]) and torch.equal(shard_of(full, p, 2), full[4:8])

    padded = ShardSpec((5, 2), 0, (3, 3)).parameter(1)
    assert full_shape(padded) == (5, 2) and counted_rows(padded, 1) == (0, 3) and uncounted_elements(padded, 1) == 0
    assert torch.equal(shard_of(full[:5], padded, 1), torch.cat([full[3:5], torch.zeros(1, 2)]))
    whole = ShardSpec((5, 2), 0, (6,)).parameter(0)  # TP 1: the one shard holds a padding row, gathered away
    assert torch.equal(gather_full(torch.cat([full[:5], torch.zeros(1, 2)]), whole, ParallelState.single()), full[:5])
    replicated = ShardSpec((5, 2)).parameter(0)
    assert ShardSpec.of(replicated) == ShardSpec((5, 2)) and counted_rows(replicated, 0) == (0, 0)
    assert shard_of(full, replicated, 0) is full
    flagged = nn.Parameter(torch.zeros(4, 2))
    flagged.tp_sharded = True  # the flag alone (all the gradient norm reads): nothing left out, no other mark asked
    assert is_tp_sharded("w", flagged, ParallelState.single()) and uncounted_elements(flagged, 0) == 0
