"""Global gradient norm across TP and DP equals the single-process norm; Megatron's clipping rule."""

import math

import pytest
import torch
import torch.nn as nn

from tnlg.optim.clip import clip_coefficient, clip_grad_norm_, global_norm, squared_sums
from tnlg.parallel.state import ParallelState, init_parallel
from .pool import run_distributed

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
    for t, (_shape, sharded, dim) in zip(full_grads(), SPECS):
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


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts every call that reads a tensor's values on the host (a device synchronisation on a GPU)."""

    READS = {"item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values()))
        if name in self.READS or to_cpu:
            self.calls.append(name)
        return func(*args, **kwargs)


def test_norm_reads_the_host_once_per_step():
    """squared_sums stays on the device (no per-piece .cpu()/.item()), global_norm
    reads one number, and the result equals the old per-piece fp64 computation, for mixed dtypes."""
    g = torch.Generator().manual_seed(0)
    pieces = [(torch.randn(int(torch.randint(1, 300, (), generator=g)), generator=g) * (1 + i % 7), i % 3 == 0)
              for i in range(200)]
    pieces += [(torch.randn(64, generator=g).to(dt), s) for dt in (torch.bfloat16, torch.float16, torch.float64)
               for s in (True, False)]
    pieces.append((torch.empty(0), True))
    ref_sh = sum(float(t.double().pow(2).sum()) for t, s in pieces if s)
    ref_rep = sum(float(t.double().pow(2).sum()) for t, s in pieces if not s)

    with _HostReads() as mode:
        sh, rep = squared_sums(iter(pieces))
    assert mode.calls == [], mode.calls
    assert isinstance(sh, torch.Tensor) and sh.dtype == torch.float64 and sh.dim() == 0
    with _HostReads() as mode:
        norm = global_norm(sh, rep, ParallelState.single(), over_dp=False)
    assert mode.calls == ["item"], mode.calls
    assert float(sh) == pytest.approx(ref_sh, rel=1e-6) and float(rep) == pytest.approx(ref_rep, rel=1e-6)
    assert norm == pytest.approx(math.sqrt(ref_sh + ref_rep), rel=1e-6)

    # tensors on the meta device cannot be read at all: any host read would raise here
    meta = [(torch.empty(10, device="meta"), True), (torch.empty(3, device="meta", dtype=torch.bfloat16), False)]
    sh, rep = squared_sums(meta)
    assert sh.device.type == "meta" and rep.device.type == "meta"
    # no pieces at all: zeros, and global_norm still accepts plain floats
    sh, rep = squared_sums([])
    assert global_norm(sh, rep, ParallelState.single(), over_dp=False) == 0.0
    assert global_norm(3.0, 4.0 ** 2 - 7.0, ParallelState.single(), over_dp=False) == pytest.approx(math.sqrt(12.0))


def test_16bit_norm_agrees_across_splits_without_a_wider_copy():
    """A 16-bit gradient's sum of squares accumulates in fp32 (no fp64 copy of the piece), yet the
    norm of 10^6 bf16 elements agrees with the fp64 norm within 1e-6 however the elements are split
    into pieces (TP shards, ZeRO slices): a running fp32 sum over the whole piece drifts by 3e-5 here."""
    g = torch.Generator().manual_seed(5)
    full = torch.randn(1_000_003, generator=g).to(torch.bfloat16)
    ref = float(full.double().square().sum())
    for parts in (1, 2, 4, 7):
        pieces = [(p, True) for p in full.tensor_split(parts)]
        sh, rep = squared_sums(pieces)
        assert float(sh) == pytest.approx(ref, rel=1e-6), parts
        assert float(rep) == 0.0
