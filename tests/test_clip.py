"""Global gradient norm across TP and DP equals the single-process norm; Megatron's clipping rule."""

import math

import pytest
import torch
import torch.nn as nn

from tnlg.optim.clip import clip_coefficient, clip_grad_norm_, global_norm, squared_sums
from tnlg.parallel.state import ParallelState, init_parallel
from tnlg.testing import run_distributed

# (shape, tp_sharded, split dim)
SPECS = [((8, 6), True, 0), ((6, 8), True, 1), ((8,), True, 0), ((6,), False, None), ((5, 6), False, None)]


def full_grads():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*shape, generator=g) for shape, _, _ in SPECS]


def reference_norm() -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in full_grads()]).double()))


def _local_pieces(ps: ParallelState):
    """This rank's TP shard of every gradient, as ZeRO-1 would hold it: a disjoint 1/dp slice."""
    out = []
    for t, (shape, sharded, dim) in zip(full_grads(), SPECS):
        if sharded:
            t = t.chunk(ps.tp_size, dim=dim)[ps.tp_rank]
        flat = t.reshape(-1)
        out.append((flat.tensor_split(ps.dp_size)[ps.dp_rank], sharded, t))
    return out


def _body(world_ps, max_norm):
    results = []
    for tp in (1, 2, 4):
        ps = init_parallel(tensor_parallel_size=tp)
        pieces = _local_pieces(ps)
        sh, rep = squared_sums((p, s) for p, s, _ in pieces)
        dp_sharded = global_norm(sh, rep, ps, over_dp=True)
        # stage 0 / plain DP: every DP rank holds the full TP-shard gradient
        params = []
        for _, sharded, t in pieces:
            p = nn.Parameter(torch.zeros_like(t))
            p.grad = t.clone()
            p.tp_sharded = sharded
            params.append(p)
        replicated_norm = clip_grad_norm_(params, max_norm, ps)
        coeff = clip_coefficient(replicated_norm, max_norm)
        scaled_ok = all(torch.allclose(p.grad, t * coeff, rtol=1e-6, atol=0) for p, (_, _, t) in zip(params, pieces))
        results.append((tp, dp_sharded, replicated_norm, scaled_ok))
    return results


def test_norm_equals_single_process_for_every_layout():
    ref = reference_norm()
    per_rank = run_distributed(_body, 4, 1, 1.0)
    for rank_results in per_rank:
        for tp, dp_sharded, replicated_norm, scaled_ok in rank_results:
            assert dp_sharded == pytest.approx(ref, rel=1e-6), (tp, "dp-sharded")
            assert replicated_norm == pytest.approx(ref, rel=1e-6), (tp, "dp-replicated")
            assert scaled_ok, tp


def test_clip_coefficient_rule():
    assert clip_coefficient(2.0, 1.0) == pytest.approx(1.0 / (2.0 + 1e-6))
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(5.0, 0.0) == 1.0                  # clipping off
    assert clip_coefficient(float("inf"), 1.0) == 1.0         # non-finite: the step is skipped instead
    assert math.isnan(global_norm(float("nan"), 0.0, ParallelState.single(), over_dp=False))


def test_single_process_matches_torch_clip_grad_norm():
    ps = ParallelState.single()
    grads = full_grads()
    ours = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    theirs = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    n1 = clip_grad_norm_(ours, 1.0, ps)
    n2 = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    assert n1 == pytest.approx(n2, rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
