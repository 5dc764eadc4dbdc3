"""``--compile``: compiled blocks train exactly as eager ones (fp32, dropout on and off, TP 1 and 2), and a
broken compiler toolchain leaves the model eager with the reason.

The reference is the eager run of the same model from the same seed: five optimizer steps through the
ZeRO engine, losses equal within 1e-5. With dropout on, equality also shows that compiled dropout draws
the same masks as eager dropout (Inductor's fallback to eager random numbers, and this rank's dropout
generator inside the compiled blocks: attention dropout, and with sequence parallelism the hidden
dropout), and Dynamo's counters show that no graph broke at the generator (none broke at all without
sequence parallelism, whose collectives break graphs with dropout or without).
"""

from __future__ import annotations

import pytest
import torch

from tnlg.config import GPTConfig
from tnlg.model import GPT
from tnlg.optim import build_engine
from .pool import run_distributed
from tnlg.training import compile as compile_module
from tnlg.training.compile import compile_blocks

STEPS = 5


def _losses(ps, dropout: float, compiled: bool, sequence_parallel: bool = False) -> list[float]:
    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=96,
                    hidden_dropout=dropout, attention_dropout=dropout, sequence_parallel=sequence_parallel)
    engine = build_engine(GPT(cfg, ps, device="meta"), ps, 1, lr=1e-3)
    if compiled:
        assert compile_blocks(engine.model, ps.device) is None
    g = torch.Generator().manual_seed(1 + ps.dp_rank)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
        engine.zero_grad()
        loss = engine.model(tokens, labels=tokens)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    engine.close()
    return out


def _compare(ps, sequence_parallel: bool):
    from torch._dynamo.utils import counters
    out = []
    for d in (0.0, 0.1):
        eager = _losses(ps, d, False, sequence_parallel)
        counters.clear()
        compiled = _losses(ps, d, True, sequence_parallel)
        out.append((d, eager, compiled, dict(counters["graph_break"])))
    return out


@pytest.mark.parametrize("world,tp,sequence_parallel", [(1, 1, False), (2, 2, False), (2, 2, True)])
def test_compiled_blocks_give_eager_losses(world, tp, sequence_parallel):
    for rank in run_distributed(_compare, world, tp, sequence_parallel):
        for dropout, eager, compiled, _ in rank:
            assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6), (dropout, eager, compiled)
        _, (_, _, _, breaks) = rank  # with dropout
        # this rank's dropout generator breaks no graph: no break at all without sequence parallelism; with
        # it, the sequence-parallel collectives break graphs (dropout or not), none of them the generator
        assert not any(word in reason for reason in breaks for word in ("rng_state", "Generator", "seed")), breaks
        if not sequence_parallel:
            assert not breaks, breaks


def test_broken_toolchain_stays_eager_and_says_why(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no working C++ compiler found")
    monkeypatch.setattr(compile_module.torch, "compile", broken)
    model = GPT(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64))
    problem = compile_blocks(model, torch.device("cpu"))
    assert problem == "RuntimeError: no working C++ compiler found"
    assert not any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None)
                   for m in model.modules())


def test_16bit_layernorm_in_kernel_path_matches_the_fp32_path(monkeypatch):
    """The CUDA path of the 16-bit LayerNorm (16-bit tensors straight into the kernel) gives the fp32
    path's output and gradients within bf16 rounding; run here on the CPU's kernels by taking that path."""
    import tnlg.model.norms as model_module
    from tnlg.model import LayerNorm
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 8, 64, generator=g).bfloat16()
    ln = LayerNorm(64, 1e-5)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
        ln.bias.copy_(0.1 * torch.randn(64, generator=g))
    ln = ln.bfloat16()
    up = torch.randn(4, 8, 64, generator=g)

    def run():
        ln.zero_grad()
        x = x0.clone().requires_grad_()
        y = ln(x)
        (y.float() * up).sum().backward()
        return y.float(), x.grad.float(), ln.weight.grad.float(), ln.bias.grad.float()
    ref = run()
    taken = []
    monkeypatch.setattr(model_module, "_layer_norm_in_kernel", lambda x, w: taken.append(1) or w.dtype == x.dtype)
    fast = run()
    assert len(taken) == 2  # forward and backward took the in-kernel path
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), fast, ref):
        # bf16 results: a few units of bf16 rounding (2^-8) over the tensor
        assert float(((a - b).norm() / b.norm()).detach()) < 1e-2, name


@pytest.mark.parametrize("which", ["attention", "dropout"])
def test_compiler_operators_draw_the_eager_masks_and_gradients(which):
    """The operators compiled blocks call for this rank's dropout (no compiler here: the operators run
    eagerly) give the eager path's outputs, input gradients and the generator's next state exactly."""
    from tnlg.parallel.random import TPRandom
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 4, 16, 8, generator=g) for _ in range(3 if which == "attention" else 1)]
    up = torch.randn(2, 4, 16, 8, generator=g)

    def run(use_operator: bool):
        rng = TPRandom(seed=5, tp_rank=1, device=torch.device("cpu"))
        leaves = [t.clone().requires_grad_() for t in inputs]
        before = torch.get_rng_state()
        if not use_operator:
            out = rng.attention(*leaves, None, 0.3, True) if which == "attention" else rng.dropout(leaves[0], 0.3)
        elif which == "attention":
            out, rng.state = torch.ops.tnlg.tp_attention(*leaves, None, 0.3, True, rng.state)
        else:
            out, rng.state = torch.ops.tnlg.tp_dropout(leaves[0], 0.3, rng.state)
        (out * up).sum().backward()
        assert torch.equal(torch.get_rng_state(), before)  # the default (replicated) stream is untouched
        return out.detach(), [t.grad for t in leaves], rng.state

    (out_e, grads_e, state_e), (out_o, grads_o, state_o) = run(False), run(True)
    assert torch.equal(out_o, out_e) and (out_e == 0).any()  # some elements dropped: dropout ran
    assert all(torch.equal(a, b) for a, b in zip(grads_o, grads_e))
    assert torch.equal(state_o, state_e)
