"""Layout invariance of the whole training loop: every (tp, dp, zero) gives one process's trajectory."""

import argparse
import math

import pytest
import torch

from tnlg.runtime.hardware import bf16_skip_reason, fast_bf16_cpu
from tnlg.runtime.spawn import run_distributed
from tnlg.commands.pretrain_args import resolve

# bf16 matmuls must run near the fp32 rate (AVX-512 BF16/AMX, or a GPU); on an AVX2-only CPU they are ~100x slower
needs_fast_bf16 = pytest.mark.skipif(not fast_bf16_cpu(), reason=bf16_skip_reason())

STEPS = 5  # optimizer steps per layout run


def _options(world, **over):
    from tnlg.data.corpus import default_dataset
    prefix, tok = default_dataset()
    flags = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=4,
                 global_batch_size=8, train_iters=STEPS, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                 log_interval=100, eval_interval=0, data_path=[prefix], tokenizer_model=tok,
                 sample_prompt="", plot=False, weight_decay=0.1, clip_grad=0.5, peak_tflops=1.0,
                 hidden_dropout=0.0, attention_dropout=0.0)  # a run on --data-path defaults to Megatron's 0.1
    flags.update(over)
    return resolve(argparse.Namespace(**flags), world_size=world)


def _train_body(ps, o):
    from tests.training import train_with_params
    out = train_with_params(o)
    return dict(losses=out["losses"], grad_norms=out["grad_norms"], params=out["params"] if ps.rank == 0 else None)


def _run(world, tp, zero, **over):
    micro = over.pop("micro_batch_size", 8 // (world // tp))
    o = _options(world, tensor_model_parallel_size=tp, zero_stage=zero, micro_batch_size=micro, **over)
    return run_distributed(_train_body, world, tp, o, timeout_s=120)[0]


@pytest.fixture(scope="module")
def reference():
    """One process, plain AdamW path (TP=1, DP=1, ZeRO 0), whole global batch in one micro batch."""
    return _run(1, 1, 0)


def _assert_same(ref, got, what, rel=1e-5):
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert math.isclose(a, b, rel_tol=rel), f"{what}: loss at step {i + 1}: {b} vs reference {a}"
    for i, (a, b) in enumerate(zip(ref["grad_norms"], got["grad_norms"])):
        assert math.isclose(a, b, rel_tol=rel), f"{what}: grad norm at step {i + 1}: {b} vs reference {a}"
    for name, t in ref["params"].items():
        torch.testing.assert_close(got["params"][name], t, atol=1e-5, rtol=1e-4, msg=f"{what}: {name}")


@pytest.mark.parametrize("world,tp,zero", [(2, 2, 0), (2, 1, 1), (4, 2, 1), (4, 2, 2), (2, 1, 3)])
def test_layout_invariance(reference, world, tp, zero):
    _assert_same(reference, _run(world, tp, zero), f"(tp={tp}, dp={world // tp}, zero={zero})")


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,zero", [(4, 4, 0), (4, 1, 1)])
def test_layout_invariance_wide(reference, world, tp, zero):
    _assert_same(reference, _run(world, tp, zero), f"(tp={tp}, dp={world // tp}, zero={zero})")


def test_gradient_accumulation_equals_one_big_micro_batch(reference):
    # DP=2, micro batch 2 -> 2 accumulation steps per global batch of 8
    _assert_same(reference, _run(2, 1, 1, micro_batch_size=2), "accumulation 2 x micro 2 x DP 2")


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,zero", [(3, 3, 0), (6, 3, 1), (8, 8, 0)])
def test_28_heads_training_invariance(world, tp, zero):
    """Issue 8: T-NLG's 28 heads at TP 3 and 8 train exactly like TP 1."""
    over = dict(num_layers=1, hidden_size=56, num_attention_heads=28, global_batch_size=6)
    dp = world // tp
    ref = _run(1, 1, 0, micro_batch_size=6, **over)
    got = _run(world, tp, zero, micro_batch_size=6 // dp, **over)
    _assert_same(ref, got, f"28 heads (tp={tp}, dp={dp}, zero={zero})")


@needs_fast_bf16
def test_bf16_tracks_fp32_loss_curve():
    """20 steps in bf16 autocast stay within 0.05 nats of the fp32 curve (fp32 master weights)."""
    over = dict(train_iters=20, lr_warmup_iters=2, micro_batch_size=8)
    fp32 = _run(1, 1, 0, **over)
    bf16 = _run(1, 1, 0, bf16=True, **over)
    diffs = [abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])]
    print("step  fp32     bf16")
    for i, (a, b) in enumerate(zip(fp32["losses"], bf16["losses"])):
        print(f"{i + 1:4d}  {a:.4f}  {b:.4f}")
    assert max(diffs) < 0.05, f"bf16 drifted {max(diffs):.4f} nats from fp32"
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.3  # and it trains


# --- sequence parallelism through the whole loop (issue 14) ------------------------------------------
def _sp_train_body(ps, o):
    """The loop's summary, plus every rank's own copy of the replicated parameters."""
    from tests.training import train_with_params
    out = train_with_params(o)
    replicated = None
    if ps.tp_size > 1:
        from tnlg.data.tokenizer import load_tokenizer
        from tnlg.model import GPT
        from tnlg.parallel.state import ParallelState
        from tnlg.commands.pretrain_args import model_config
        cfg = model_config(o, load_tokenizer(o.data.tokenizer_model).vocab_size)
        with torch.device("meta"):
            shard = GPT(cfg, ParallelState.for_virtual_rank(ps.tp_size))
        flags = {n: p.tp_sharded for n, p in shard.named_parameters()}
        replicated = {n: t for n, t in out["params"].items() if not flags[n]}
    return dict(losses=out["losses"], grad_norms=out["grad_norms"], params=out["params"] if ps.rank == 0 else None,
                replicated=replicated, tp_rank=ps.tp_rank, dp_rank=ps.dp_rank)


@pytest.mark.parametrize("world,tp,zero,recompute,micro", [
    (4, 2, 1, "selective", 4), (2, 2, 0, None, 4),
    pytest.param(4, 4, 0, "full", 8, marks=pytest.mark.slow), pytest.param(4, 2, 3, None, 4, marks=pytest.mark.slow)])
def test_sequence_parallel_training_invariance(reference, world, tp, zero, recompute, micro):
    """(TP, DP, ZeRO) = (2, 2, 1) and (4, 1, 0) with --sequence-parallel (and a recomputation granularity)
    follow one process's trajectory, as do ZeRO-3 (FSDP2) and 2 accumulation steps at TP 2; replicated
    parameters end bit-identical on every TP rank."""
    dp = world // tp
    o = _options(world, tensor_model_parallel_size=tp, zero_stage=zero, micro_batch_size=micro,
                 sequence_parallel=True, recompute_granularity=recompute, hidden_dropout=0.0,
                 attention_dropout=0.0)
    results = run_distributed(_sp_train_body, world, tp, o, timeout_s=180)
    _assert_same(reference, results[0], f"sequence-parallel (tp={tp}, dp={dp}, zero={zero}, {recompute})")
    for res in results:
        peer = next(r for r in results if r["dp_rank"] == res["dp_rank"] and r["tp_rank"] == 0)
        for name, t in res["replicated"].items():
            assert torch.equal(t, peer["replicated"][name]), f"{name} differs across TP ranks after training"


def _losses_body(ps, o):
    from tnlg.training import train
    return train(o)["losses"]


def test_resume_turning_sequence_parallelism_on(tmp_path):
    """A checkpoint saved without --sequence-parallel resumes with it (and with selective recomputation):
    the resumed iterations equal an uninterrupted run's."""
    common = dict(tensor_model_parallel_size=2, zero_stage=1, micro_batch_size=4, lr_decay_iters=4,
                  hidden_dropout=0.0, attention_dropout=0.0)
    full = run_distributed(_losses_body, 2, 2, _options(2, train_iters=4, **common), timeout_s=120)[0]
    save = str(tmp_path / "ckpt")
    first = run_distributed(_losses_body, 2, 2, _options(2, train_iters=2, save=save, **common), timeout_s=120)[0]
    resumed = run_distributed(_losses_body, 2, 2, _options(2, train_iters=4, load=save, save=save,
                                                           sequence_parallel=True, recompute_granularity="selective",
                                                           **common), timeout_s=120)[0]
    assert len(first) == 2 and len(resumed) == 2
    for i, (a, b) in enumerate(zip(full, first + resumed)):
        assert math.isclose(a, b, rel_tol=1e-5), f"loss at iteration {i + 1}: {b} vs uninterrupted {a}"
