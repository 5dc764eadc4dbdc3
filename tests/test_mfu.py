"""MFU and HFU of the training log: the planner's FLOPs (any ffn width), a robust matmul peak."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny import tiny_options
from tnlg.config import GPTConfig
from tnlg.plan.flops import flops_per_iteration, reference_flops
from .pool import run_distributed
from tnlg.training.throughput import iteration_flops, measure_peak_tflops


def test_iteration_flops_honour_ffn_hidden_size():
    """Training FLOPs follow --ffn-hidden-size (they used to assume ffn = 4h)."""
    four = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100)
    three = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100,
                      ffn_hidden_size=192)
    for recompute in (False, True):
        assert iteration_flops(four, 8, recompute, 128) == pytest.approx(reference_flops(8, 32, 2, 64, 128, recompute))
        assert iteration_flops(three, 8, recompute, 128) == flops_per_iteration(three, 8, recompute, 128)
        assert iteration_flops(three, 8, recompute, 128) < iteration_flops(four, 8, recompute, 128)


def test_hfu_counts_selective_recomputation():
    """Under --recompute-granularity selective the executed FLOPs (HFU) include one more forward of the
    attention core, 2 matmuls of 2*B*s^2*h each per layer (Korthikanti et al. 2022); MFU's do not."""
    B, s, l, h, V = 8, 32, 2, 64, 128
    cfg = GPTConfig(num_layers=l, hidden_size=h, num_attention_heads=4, seq_length=s, vocab_size=100)
    model = reference_flops(B, s, l, h, V, False)
    assert iteration_flops(cfg, B, None, V) == pytest.approx(model)
    assert iteration_flops(cfg, B, "selective", V) == pytest.approx(model + l * 2 * (2 * B * s * s * h))
    assert iteration_flops(cfg, B, "full", V) == pytest.approx(reference_flops(B, s, l, h, V, True))


def _peak_body(ps):
    state = torch.get_rng_state()
    peak = measure_peak_tflops(torch.float32, ps.device, n=256, trials=3, min_seconds=0.02)
    return peak, torch.equal(state, torch.get_rng_state())


def test_peak_is_one_figure_for_all_ranks_and_leaves_the_rng_alone():
    """All ranks use one measured matmul peak and leave the training RNG alone (each rank used to time one
    short matmul on its own: figures 4x apart between ranks and runs, taken while other ranks were busy or
    idle by chance, drawing from the training RNG)."""
    out = run_distributed(_peak_body, 2, 1)
    (p0, rng0), (p1, rng1) = out
    assert p0 == p1 > 0 and rng0 and rng1


def _train_body(ps, o):
    from tnlg.training import train
    return train(o)["losses"]


def test_log_reports_model_tflops_mfu_and_hfu(tmp_path, capfd):
    """With recomputation the log line shows model TFLOP/s first, MFU and HFU apart, and the peak they divide
    by (the logged "MFU" used to count the recomputed forward, which is HFU)."""
    metrics = tmp_path / "metrics.jsonl"
    o = tiny_options(1, ffn_hidden_size=96, micro_batch_size=4, train_iters=2, peak_tflops=0.5,
                     recompute_activations=True, metrics_file=str(metrics), tensor_model_parallel_size=1)
    run_distributed(_train_body, 1, 1, o, timeout_s=120)
    out = capfd.readouterr().out
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                    ffn_hidden_size=96)
    vocab = 4096  # the built-in tokenizer's, padded (a multiple of 128)
    ratio = flops_per_iteration(cfg, 4, True, vocab) / flops_per_iteration(cfg, 4, False, vocab)
    for r in recs:
        assert r["peak_tflops"] == 0.5
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5)
        assert r["hfu"] == pytest.approx(r["mfu"] * ratio)
        assert r["tflops"] == pytest.approx(flops_per_iteration(cfg, 4, False, vocab) / (r["ms_per_iter"] / 1e3) / 1e12,
                                            rel=1e-6)
    line = next(ln for ln in out.splitlines() if ln.startswith("iter "))
    assert "model TFLOP/s/rank | MFU " in line and " HFU " in line and " of 0.500 |" in line
    assert "peak 0.500 TFLOP/s per rank (--peak-tflops)" in out
