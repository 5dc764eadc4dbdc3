"""The optional DeepSpeed engine (``--zero-impl deepspeed``): DeepSpeed's ZeRO over our TP/DP groups.

With DeepSpeed installed, ``tnlg pretrain``'s loop on DeepSpeed ZeRO 1-3 gives
the single-process trajectory of our own engine (losses and gradient norms
within 1e-5 relative, parameters as in ``test_train``): the proof that
DeepSpeed shards only over DP and counts TP-replicated gradients once in the
norm. Without DeepSpeed those tests are skipped; the option checks still run.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist

from tnlg.errors import UserError
from tnlg.runtime.spawn import run_distributed
from tnlg.commands.pretrain_args import resolve

from .test_train import _assert_same, _reference_run, _run


needs_deepspeed = pytest.mark.needs_package("deepspeed")  # skipped without it, naming the install command


def _need_deepspeed():
    return pytest.importorskip("deepspeed", reason="DeepSpeed is not installed "
                                                   "(pip install --no-build-isolation \"deepspeed>=0.14\")")


DEEPSPEED_RTOL = 1e-5  # DeepSpeed sums its flattened fp32 gradient buckets in its own order


@pytest.fixture(scope="module")
def reference():
    """The independent reference of test_train (tests/reference_gpt.py and torch's AdamW, each global
    batch in one micro batch), its tolerances the measured noise floor but at least DEEPSPEED_RTOL
    relative for losses and gradient norms: DeepSpeed reduces and norms its gradients in its own
    bucket order, so its fp32 rounding differs from ours (1.09e-6 relative on the first step's norm
    on a 2-core AMD EPYC, 2026-12-02)."""
    _need_deepspeed()
    ref = _reference_run()
    tol = ref["tolerances"]
    ref["tolerances"] = dict(tol, loss=max(tol["loss"], DEEPSPEED_RTOL),
                             grad_norm=max(tol["grad_norm"], DEEPSPEED_RTOL))
    return ref


# ----------------------------------------------------------------------------- options (no DeepSpeed needed)
def test_options_refused_before_any_work(monkeypatch):
    import tnlg.optim.deepspeed_engine as dse
    monkeypatch.setattr(dse, "deepspeed_available", lambda: False)
    with pytest.raises(UserError, match=r'pip install --no-build-isolation "deepspeed>=0\.14"'):
        resolve(argparse.Namespace(zero_impl="deepspeed"), world_size=4)
    monkeypatch.setattr(dse, "deepspeed_available", lambda: True)
    with pytest.raises(UserError, match="stages 1, 2 and 3.*--zero-impl tnlg"):
        resolve(argparse.Namespace(zero_impl="deepspeed", zero_stage=0), world_size=4)
    with pytest.raises(UserError, match="--fp16.*not supported with --zero-impl deepspeed"):
        resolve(argparse.Namespace(zero_impl="deepspeed", fp16=True), world_size=4)
    with pytest.raises(UserError, match="--zero-impl must be tnlg or deepspeed"):
        resolve(argparse.Namespace(zero_impl="apex"), world_size=4)


def test_cli_lists_deepspeed():
    from tnlg.commands.pretrain_args import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--zero-impl", "deepspeed"]).zero_impl == "deepspeed"


# ----------------------------------------------------------------------------- layout invariance
@needs_deepspeed
@pytest.mark.parametrize("world,tp,zero", [(2, 1, 1), (4, 2, 1), (2, 1, 2)])
def test_deepspeed_layout_invariance(reference, world, tp, zero):
    got = _run(world, tp, zero, zero_impl="deepspeed")
    _assert_same(reference, got, f"DeepSpeed (tp={tp}, dp={world // tp}, zero={zero})")


@needs_deepspeed
@pytest.mark.slow
def test_deepspeed_gradient_accumulation(reference):
    # DP=2, micro batch 2 -> 2 accumulation micro steps per global batch of 8
    got = _run(2, 1, 1, zero_impl="deepspeed", micro_batch_size=2)
    _assert_same(reference, got, "DeepSpeed ZeRO-1, accumulation 2 x micro 2 x DP 2")


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_deepspeed_stage3_layout_invariance(reference, world, tp):
    got = _run(world, tp, 3, zero_impl="deepspeed")
    _assert_same(reference, got, f"DeepSpeed (tp={tp}, dp={world // tp}, zero=3)")


@needs_deepspeed
@pytest.mark.slow
def test_resume_from_our_engine_into_deepspeed(reference, tmp_path):
    """A checkpoint of our ZeRO-1 at TP=1 x DP=2 resumes on DeepSpeed ZeRO-3 at TP=2 x DP=2 exactly."""
    save = os.fspath(tmp_path / "run")
    first = _run(2, 1, 1, train_iters=3, lr_decay_iters=5, save=save)
    rest = _run(4, 2, 3, zero_impl="deepspeed", train_iters=5, lr_decay_iters=5, save=save)
    assert first["losses"] == pytest.approx(reference["losses"][:3], rel=1e-5)
    assert rest["losses"] == pytest.approx(reference["losses"][3:], rel=1e-5)
    assert rest["grad_norms"] == pytest.approx(reference["grad_norms"][3:], rel=1e-5)


# ----------------------------------------------------------------------------- memory and state exchange
def _memory_body(ps, stages):
    from tnlg.config import GPTConfig
    from tnlg.model import GPT
    from tnlg.optim import DataParallelBackend
    from tnlg.optim.deepspeed_engine import build_deepspeed_engine
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=256)
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        engine = build_deepspeed_engine(GPT(cfg, ps), ps, stage, lr=1e-3, weight_decay=0.1)
        gen = torch.Generator().manual_seed(ps.rank)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=gen)
        engine.zero_grad()
        engine.backward(engine.model(tokens[:, :-1], labels=tokens[:, 1:]))
        info = engine.step(1e-3)
        states = engine.optimizer_state_by_param()
        params = engine.model_state_by_param()
        engine.load_optimizer_state_by_param(states)   # round trip keeps the states
        again = engine.optimizer_state_by_param()
        out[stage] = dict(memory=engine.memory_report(), info=info, names=engine.param_names,
                          protocol=isinstance(engine.backend, DataParallelBackend),
                          hyper=engine.hyperparameters(),
                          same=all(torch.equal(states[n][k], again[n][k])
                                   for n in states for k in ("exp_avg", "exp_avg_sq")),
                          shapes={n: tuple(t.shape) for n, t in params.items()},
                          steps={d["step"] for d in states.values()})
        engine.close()
    dist.barrier()
    return out


@needs_deepspeed
def test_deepspeed_partitions_optimizer_state_over_dp_only():
    _need_deepspeed()
    per_rank = run_distributed(_memory_body, 2, 1, (1, 2, 3), timeout_s=120)
    for stage in (1, 2, 3):
        r = [pr[stage] for pr in per_rank]
        psi = r[0]["memory"]["numel"]
        for m in (x["memory"] for x in r):
            # Adam states 8 Psi / dp, DeepSpeed's fp32 master 4 Psi / dp (even for fp32 params), +- padding
            assert abs(m["adam_state_bytes"] - 8 * psi / 2) <= 0.1 * 8 * psi / 2, (stage, m)
            assert abs(m["master_bytes"] - 4 * psi / 2) <= 0.1 * 4 * psi / 2, (stage, m)
        assert sum(x["memory"]["owned_numel"] for x in r) >= psi
        assert r[0]["same"] and r[0]["steps"] == {1} and not r[0]["info"]["skipped"]
        assert r[0]["protocol"] and r[0]["hyper"]["weight_decay"] == 0.1 and r[0]["hyper"]["num_steps"] == 1
        assert r[0]["info"]["grad_norm"] == pytest.approx(r[1]["info"]["grad_norm"], rel=1e-6)
        assert "transformer.wte.weight" in r[0]["names"]
        assert r[0]["shapes"]["transformer.wpe.weight"] == (16, 64)  # full shape, also at stage 3
