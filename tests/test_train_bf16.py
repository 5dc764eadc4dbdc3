"""ZeRO mixed precision (16-bit parameters and gradients, fp32 master of the owned slice)
at the 8 layouts of the invariance test follows the fp32 loss curve within 0.05 nats over 20 steps."""

import pytest

from .test_train import _run, needs_fast_bf16

LAYOUTS = [(1, 1, 0), (2, 2, 0), (4, 4, 0), (2, 1, 1), (4, 2, 1), (4, 1, 1), (4, 2, 2), (2, 1, 3)]  # (world, tp, zero)
OVER = dict(train_iters=20, lr_warmup_iters=2, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.fixture(scope="module")
def fp32_curve():
    return _run(1, 1, 0, micro_batch_size=8, **OVER)["losses"]


@needs_fast_bf16
@pytest.mark.slow
@pytest.mark.parametrize("world,tp,zero", LAYOUTS)
def test_bf16_layouts_track_fp32(fp32_curve, world, tp, zero):
    got = _run(world, tp, zero, bf16=True, **OVER)["losses"]
    gap = max(abs(a - b) for a, b in zip(fp32_curve, got))
    assert len(got) == 20 and gap < 0.05, f"(tp={tp}, dp={world // tp}, zero={zero}) bf16 drifted {gap:.4f} nats"
    assert got[-1] < got[0] - 0.3  # and it trains


@needs_fast_bf16
@pytest.mark.parametrize("world,tp,zero", [(4, 2, 1)])
def test_bf16_fp32_grad_accumulation_tracks_fp32(fp32_curve, world, tp, zero):
    """--accumulate-allreduce-grads-in-fp32 with 2 accumulation micro steps."""
    got = _run(world, tp, zero, bf16=True, accumulate_allreduce_grads_in_fp32=True, micro_batch_size=2,
               **OVER)["losses"]
    assert max(abs(a - b) for a, b in zip(fp32_curve, got)) < 0.05


def test_bf16_parameters_run_without_autocast():
    """The sample printed after a --bf16 run (and any inference on the trained model) runs outside
    autocast on 16-bit parameters: every layer must compute in its parameters' dtype."""
    import torch

    from tnlg.config import GPTConfig
    from tnlg.generation import generate_ids
    from tnlg.model import GPT
    from tnlg.optim import build_engine
    from tnlg.parallel.state import ParallelState
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    ps = ParallelState.single()
    engine = build_engine(GPT(cfg, ps, device="meta"), ps, 0, param_dtype=torch.bfloat16)
    model = engine.model.eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape[-1] >= 64 and torch.isfinite(logits.float()).all()
    out = generate_ids(model, ids.tolist(), 4, greedy=True)
    assert len(out) == 2
