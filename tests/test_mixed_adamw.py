"""The one-pass 16-bit AdamW: ``torch.optim.AdamW``'s arithmetic, and one fused kernel when compiled.

The independent reference is ``torch.optim.AdamW`` itself, stepped on fp32 copies of the master and
moments with the fp32 gradient ``factor * grad``: master and moments must agree within fp32 rounding
over several steps (weight decay on and off, bias correction, a clip coefficient, bf16 gradients and
loss-scaled fp16 ones), and the 16-bit parameter must be the master rounded. The compiled update is
checked by reading what Inductor generated for it on the CPU: one kernel, and Inductor's own count of
its bytes equal to the tracker's count of the operator (30 bytes per element: the written-only 16-bit
parameter is charged as read by both).
"""

from __future__ import annotations

import pytest
import torch

from tnlg.optim import mixed_adamw
from tnlg.optim.mixed_adamw import CHUNK, adamw_16bit_, adamw_update, _scalars
from tnlg.plan.tracker import StepTracker

BETAS, EPS = (0.9, 0.95), 1e-8


def _state(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    return master.bfloat16(), master, 0.1 * torch.randn(n, generator=g), torch.rand(n, generator=g) * 1e-3


@pytest.mark.parametrize("grad_dtype,weight_decay,clip,loss_scale", [
    (torch.bfloat16, 0.1, 1.0, 1.0),      # weight decay, no clipping
    (torch.bfloat16, 0.0, 0.37, 1.0),     # clipped, no weight decay
    (torch.float16, 0.1, 0.5, 1024.0),    # fp16 gradients of a loss scaled by 1024, unscaled in the pass
    (torch.float32, 0.1, 0.8, 1.0),       # fp32 gradients (accumulated in fp32) into a 16-bit parameter
])
@pytest.mark.parametrize("kernel", ["fused CPU", "eager composite"])
def test_the_one_pass_update_is_torch_adamw_on_fp32_copies(grad_dtype, weight_decay, clip, loss_scale, kernel,
                                                           monkeypatch):
    """Both CPU implementations against the single-tensor ``torch.optim.AdamW``. The fused CPU kernel
    computes ``beta1 * m + (1 - beta1) * g`` where the reference lerps, so the moments agree to fp32
    rounding of their own scale (a few ulps of ``max |m|``), not elementwise relative to entries
    that cancel to near zero."""
    monkeypatch.setattr(mixed_adamw, "_cpu_fused_ok", kernel == "fused CPU")
    monkeypatch.setattr(mixed_adamw, "CPU_CHUNK", 1 << 14)  # several fused chunks and a ragged end
    n = CHUNK + 1234  # more than one eager chunk, and a ragged end
    param, master, m, v = _state(n, 0)
    ref = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)
    opt.state[ref] = dict(step=torch.tensor(0.0), exp_avg=m.clone(), exp_avg_sq=v.clone())
    g = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        lr = 1e-3 * step  # a schedule: the rate changes every step
        grad = (torch.randn(n, generator=g) * loss_scale).to(grad_dtype)
        factor = clip / loss_scale
        adamw_16bit_(param, master, m, v, grad, lr, weight_decay, *BETAS, EPS, step, factor)
        ref.grad = grad.float() * factor
        opt.param_groups[0]["lr"] = lr
        opt.step()
        st = opt.state[ref]
        torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
        for ours, theirs in ((m, st["exp_avg"]), (v, st["exp_avg_sq"])):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=4e-7 * float(theirs.abs().max()))
        assert torch.equal(param, master.bfloat16())


def test_the_step_count_starts_at_one():
    param, master, m, v = _state(8, 0)
    with pytest.raises(ValueError, match="starts at 1"):
        adamw_16bit_(param, master, m, v, torch.zeros(8), 1e-3, 0.0, *BETAS, EPS, 0, 1.0)


def test_the_tracker_sees_one_operator_moving_its_arguments():
    n = 5000
    param, master, m, v = _state(n, 0)
    grad = torch.randn(n).bfloat16()
    tracker = StepTracker()
    with tracker, tracker.phase("optimizer") as ph:
        adamw_16bit_(param, master, m, v, grad, 1e-3, 0.1, *BETAS, EPS, 1, 0.5)
    assert [op.name for op in ph.ops] == ["adamw_16bit_"]
    assert ph.read == n * (2 + 4 * 3 + 2) and ph.written == n * (2 + 4 * 3)  # 30 bytes per element
    assert ph.peak == 0  # no temporary the tracker can see


def test_compiled_update_is_one_kernel_with_the_operators_bytes(monkeypatch):
    """Inductor (CPU) fuses the update into one kernel whose bytes, by Inductor's count, are the
    operator's: the compiled step moves no more memory than its arguments, and gives the eager result."""
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code
    n = 4096
    eager, compiled = _state(n, 0), _state(n, 0)
    grad = torch.randn(n).bfloat16()
    scalars = _scalars(2e-3, 0.1, *BETAS, EPS, 3, 0.5)
    adamw_update(*eager, grad, *scalars)
    torch._dynamo.reset()
    metrics.reset()
    torch._logging.set_logs(inductor_metrics=True)  # Inductor counts bytes only with its metrics log on
    try:
        with inductor_config.patch(fx_graph_cache=False):
            _, code = run_and_get_code(torch.compile(adamw_update, fullgraph=True), *compiled, grad, *scalars)
    finally:
        torch._logging.set_logs()
    assert metrics.generated_kernel_count == 1, code
    assert metrics.num_bytes_accessed == n * 30
    assert code[0].count('extern "C"') == 1  # one kernel in the generated module
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_fused_chunk_that_fails_hands_that_chunk_and_the_rest_to_the_composite(monkeypatch):
    """torch's fused CPU kernel refusing the third chunk: the chunks before it are updated once (by it),
    that one and the rest by the eager composite, with one warning; the result is the composite's alone."""
    monkeypatch.setattr(mixed_adamw, "_cpu_fused_ok", True)
    monkeypatch.setattr(mixed_adamw, "CPU_CHUNK", 1 << 12)
    n = 5 * (1 << 12) + 77
    ours, ref = _state(n, 0), _state(n, 0)
    grad = torch.randn(n).bfloat16()
    real, calls = torch._fused_adamw_, []

    def refusing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("not for this dtype")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_fused_adamw_", refusing)
    with pytest.warns(UserWarning, match="fused CPU AdamW failed"):
        adamw_16bit_(*ours, grad, 1e-3, 0.1, *BETAS, EPS, 2, 0.5)
    assert len(calls) == 3 and mixed_adamw._cpu_fused_ok is False
    adamw_update(*ref, grad, *_scalars(1e-3, 0.1, *BETAS, EPS, 2, 0.5))  # the reference: one eager update
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=4e-7 * float(b.float().abs().max()))
