"""Checkpoints of pipeline runs: saved at one (PP, TP, DP, ZeRO) layout, resumed at another.

What is checked, each against something the checkpoint code does not compute:

* the state a resumed rank holds (every parameter's full weight and Adam moments, gathered over TP with
  the model's own ``gather_full``, and the step count) is bit for bit the state the saving run held in
  memory at that iteration, on every stage; the last stage's tied copy of the word embedding included;
* the next 3 steps' losses and gradient norms are bit for bit those of a run at the new layout that was
  handed the saving run's state in memory (the model's ``shard_of`` and the engine's by-parameter state
  API, no file involved), and, at the same layout, those of the uninterrupted run itself;
* across layouts they equal the uninterrupted run's within 1e-6 relative, not bit for bit: another layout
  sums in another order (the TP all-reduces, the DP average, the two tied-embedding gradients).

And through the command: a pipeline worker SIGKILLed mid-run (dropout on) restarts and resumes from
``--save`` with the uninterrupted run's losses, and a checkpoint of another layer count is refused.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tnlg import checkpoint as ck
from tnlg.generation.loading import load_for_inference
from tnlg.model import GPT
from tnlg.optim import build_engine
from tnlg.model.stage import StageModel
from tnlg.parallel.pipeline import chunk_layers
from tnlg.parallel.pipeline_schedule import Pipeline
from tnlg.parallel.sharding import gather_full, shard_of
from tnlg.parallel.state import ParallelState, init_parallel
from .pool import run_distributed
from tnlg.training.step import train_step

from .test_pipeline import GLOBAL, LRS, MICRO, STEPS, TINY_BUCKET_MB, _config, _micro_batches, _reference, _samples

LAYERS, SAVED_AT, MORE = 4, 2, 3  # save after 2 steps, then 3 more
assert SAVED_AT + MORE == STEPS  # the plain reference's steps


def _build(layout):
    """``(ps, engine, pipeline)`` of a (PP, TP, ZeRO[, model chunks per rank]) layout of the 4 processes (DP:
    the rest); with 2 chunks per rank the interleaved schedule."""
    pp, tp, zero, virtual = (*layout, 1)[:4]
    ps = init_parallel(tp, pipeline_parallel_size=pp)
    cfg = _config(LAYERS)
    chunks = [r for c, r in enumerate(chunk_layers(LAYERS, pp, virtual)) if c % pp == ps.pp_rank]
    model = GPT(cfg, ps, device="meta") if pp == 1 else StageModel(cfg, ps, chunks, device="meta")
    m = GLOBAL // (MICRO * ps.dp_size)
    engine = build_engine(model, ps, zero, lr=1e-3, weight_decay=0.1, clip_grad=0.05, grad_accum_steps=m,
                          bucket_size_mb=TINY_BUCKET_MB)
    schedule = "interleaved" if virtual > 1 else "1f1b"
    return ps, cfg, engine, (Pipeline(engine.model, m, schedule) if pp > 1 else None)


def _steps(ps, engine, pipeline, first: int, count: int) -> list[float]:
    """Steps ``first .. first + count - 1`` of the fixed data; their losses then gradient norms."""
    samples, losses, norms = _samples(), [], []
    for step in range(first, first + count):
        loss, info = train_step(engine.model, engine, _micro_batches(samples, step, ps.dp_rank, ps.dp_size),
                                LRS[step], autocast=None, ps=ps, iteration=step + 1, pipeline=pipeline)
        losses.append(loss)
        norms.append(info["grad_norm"])
    return losses + norms


def _state(ps, engine) -> dict:
    """This rank's parameters as full tensors (weight, exp_avg, exp_avg_sq; gathered over TP) and the step."""
    params = dict(engine.model.named_parameters())
    states = engine.optimizer_state_by_param()  # (collective over DP)
    full = {n: [gather_full(t.detach().clone(), p, ps) for t in (p, states[n]["exp_avg"], states[n]["exp_avg_sq"])]
            for n, p in params.items()}
    return dict(step=engine.num_steps, tensors=full)


def _hand_over(ps, engine, saved: dict) -> None:
    """Give the engine the saved state in memory: this rank's TP slices of the full tensors."""
    params = dict(engine.model.named_parameters())
    engine.load_model_state_by_param({n: shard_of(saved[n][0], p, ps.tp_rank) for n, p in params.items()})
    engine.load_optimizer_state_by_param({n: dict(exp_avg=shard_of(saved[n][1], p, ps.tp_rank),
                                                  exp_avg_sq=shard_of(saved[n][2], p, ps.tp_rank),
                                                  step=saved["step"]) for n, p in params.items()})


def _merged(states: list) -> dict:
    """Every rank's full tensors by name (the first rank's copy; every copy is compared separately)."""
    out = {}
    for st in states:
        for n, t in st["tensors"].items():
            out.setdefault(n, t)
    out["step"] = states[0]["step"]
    return out


def _all_ranks(obj) -> list:
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _dir(root, layout) -> str:
    return os.path.join(str(root), "pp{}_tp{}_zero{}".format(*layout) + ("_v{}".format(*layout[3:])
                                                                        if len(layout) > 3 else ""))


def _body(_ps, root: str, sources: list, resumes: list):
    out = dict(runs={}, states={}, resumed={}, reference={}, loaded={})
    saved = {}
    for layout in sources:  # uninterrupted: 2 steps, save, 3 more
        ps, cfg, engine, pipe = _build(layout)
        first = _steps(ps, engine, pipe, 0, SAVED_AT)
        out["states"][layout] = mine = _state(ps, engine)
        saved[layout] = _merged(_all_ranks(mine))
        ck.save(_dir(root, layout), iteration=SAVED_AT, consumed_samples=SAVED_AT * GLOBAL,
                model=engine.model, engine=engine, ps=ps, config=cfg)
        out["runs"][layout] = (first, _steps(ps, engine, pipe, SAVED_AT, MORE))
    for source, target in resumes:
        ps, cfg, engine, pipe = _build(target)
        info = ck.load(_dir(root, source), model=engine.model, engine=engine, ps=ps, config=cfg)
        assert info["iteration"] == SAVED_AT
        out["loaded"][(source, target)] = _state(ps, engine)
        out["resumed"][(source, target)] = _steps(ps, engine, pipe, SAVED_AT, MORE)
        if source != target:  # the same state handed over in memory
            ps, cfg, engine, pipe = _build(target)
            _hand_over(ps, engine, saved[source])
            out["reference"][(source, target)] = _steps(ps, engine, pipe, SAVED_AT, MORE)
    return out


# (PP, TP, ZeRO[, chunks per rank]) on 4 processes: (2,2,1), (1,2,2), (2,1,2) with DP
SOURCES = [(2, 2, 0), (1, 2, 1), (2, 1, 1)]
RESUMES = [((2, 2, 0), (2, 2, 0)), ((2, 2, 0), (1, 2, 1)), ((2, 2, 0), (4, 1, 0)), ((1, 2, 1), (2, 1, 1)),
           ((2, 1, 1), (2, 1, 1)), ((2, 1, 1), (4, 1, 0)), ((2, 2, 0), (2, 1, 1, 2))]  # the last: interleaved


@pytest.fixture(scope="module")
def pipeline_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppckpt")
    return root, run_distributed(_body, 4, 1, str(root), SOURCES, RESUMES, timeout_s=400)


def test_a_resumed_rank_holds_exactly_the_saved_state_on_every_stage_tied_copy_included(pipeline_checkpoints):
    _, results = pipeline_checkpoints
    for source, target in RESUMES:
        saved = _merged([r["states"][source] for r in results])
        for rank, r in enumerate(results):
            got = r["loaded"][(source, target)]
            assert got["step"] == SAVED_AT
            for name, tensors in got["tensors"].items():  # the last stage's wte copy is compared too
                for kind, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), tensors, saved[name]):
                    assert torch.equal(a, b), (source, target, rank, name, kind)
        names = {n for r in results for n in r["loaded"][(source, target)]["tensors"]}
        assert names == set(saved) - {"step"}  # the stages hold the whole model


def test_the_next_steps_after_a_resume_at_another_layout_are_bit_exact(pipeline_checkpoints):
    _, results = pipeline_checkpoints
    for source, target in RESUMES:
        uninterrupted = results[0]["runs"][source][1]
        for rank, r in enumerate(results):
            resumed = r["resumed"][(source, target)]
            if source == target:
                assert resumed == uninterrupted, (source, rank, resumed, uninterrupted)
                continue
            # the run at the new layout handed the same state in memory: bit for bit
            assert resumed == r["reference"][(source, target)], (source, target, rank)
            for a, b in zip(resumed, uninterrupted):  # the other layout's arithmetic (measured: 6.1e-8 at most)
                assert math.isclose(a, b, rel_tol=1e-6), (source, target, rank, resumed, uninterrupted)


def test_the_uninterrupted_runs_train_as_the_plain_gpt_in_one_process(pipeline_checkpoints):
    _, results = pipeline_checkpoints
    losses, norms, _ = _reference(LAYERS, ())  # no pipeline, no process group
    for source in SOURCES:
        first, more = results[0]["runs"][source]
        got = first[:SAVED_AT] + more[:MORE] + first[SAVED_AT:] + more[MORE:]  # losses, then norms
        for a, b in zip(got, losses + norms):
            assert math.isclose(a, b, rel_tol=1e-5), (source, got, losses + norms)


def test_a_pipeline_checkpoint_records_each_parameter_once_with_its_stage(pipeline_checkpoints):
    root, _ = pipeline_checkpoints
    meta = ck.read_meta(ck.resolve(_dir(root, (2, 2, 0))))
    assert meta["layout"] == dict(tp=2, dp=1, world=4, param_dtype="float32", pp=2)
    assert meta["pipeline"] == dict(pp=2, stages=[[[0, 1]], [[2, 3]]])
    stage = {n: rec["pp_rank"] for n, rec in meta["params"].items()}
    assert stage["transformer.wte.weight"] == 0 and stage["transformer.h.1.ln_1.weight"] == 0
    assert stage["transformer.h.2.ln_1.weight"] == 1 and stage["transformer.ln_f.weight"] == 1
    assert sorted(n for n in meta["files"] if n.startswith("model")) == [
        "model_pp00_tp00.safetensors", "model_pp00_tp01.safetensors",
        "model_pp01_tp00.safetensors", "model_pp01_tp01.safetensors"]
    from safetensors import safe_open  # the files themselves: the tied copy is in the first stage's only
    with safe_open(os.path.join(_dir(root, (2, 2, 0)), "iter_0000002", "model_pp01_tp00.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" not in keys and "transformer.ln_f.weight" in keys
    zero1 = ck.read_meta(ck.resolve(_dir(root, (2, 1, 1))))  # ZeRO-1: each (stage, DP rank) its own file
    assert {n for n in zero1["files"] if n.startswith("optim")} == {
        f"optim_pp{p:02d}_tp00_dp{d:03d}.safetensors" for p in (0, 1) for d in (0, 1)}
    plain = ck.read_meta(ck.resolve(_dir(root, (1, 2, 1))))  # PP 1: the names and sections of before
    assert "pipeline" not in plain and "pp" not in plain["layout"] and "pp_rank" not in plain["params"][
        "transformer.wte.weight"]
    assert "model_tp00.safetensors" in plain["files"] and "rng_dp001_tp01.pt" in plain["files"]


def test_checkpoint_info_shows_the_pipeline_layout(pipeline_checkpoints):
    root, _ = pipeline_checkpoints
    out = subprocess.run([sys.executable, "-m", "tnlg", "checkpoint", "info", _dir(root, (2, 2, 0))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"layout\s+PP=2 x TP=2 x DP=1 \(4 processes\)", out.stdout), out.stdout
    assert "pipeline     PP=2: stage 0 layers 0-1 (+ embedding); stage 1 layers 2-3 (+ LM head)" in out.stdout


def test_a_pipeline_checkpoint_builds_the_plain_gpt_and_converts_to_pp1(pipeline_checkpoints, tmp_path):
    root, results = pipeline_checkpoints
    saved = _merged([r["states"][(2, 2, 0)] for r in results])
    model, _ = load_for_inference(_dir(root, (2, 2, 0)))  # one process, the whole GPT at TP 1
    for name, p in model.named_parameters():  # (the vocabulary padding dropped)
        assert torch.equal(gather_full(p.detach(), p, ParallelState.single()), saved[name][0]), name
    from tnlg.checkpoint.offline import reshard_checkpoint
    out = reshard_checkpoint(_dir(root, (2, 2, 0)), str(tmp_path / "tp1"), tp_size=1, describe=GPT.describe)
    meta = ck.read_meta(out)
    assert "pipeline" not in meta and sorted(n for n in meta["files"] if n.startswith("model")) == [
        "model_tp00.safetensors"]
    states = ck.read_states(out, meta, GPT.describe(model.config, 1), 0)[1]
    for name, p in model.named_parameters():
        for i, kind in ((1, "exp_avg"), (2, "exp_avg_sq")):
            assert torch.equal(gather_full(states[name][kind], p, ParallelState.single()), saved[name][i]), name


def test_resuming_a_pipeline_checkpoint_with_another_layer_count_is_refused_before_any_worker(pipeline_checkpoints):
    from tnlg.errors import UserError
    from tnlg.training.checkpointing import check_resume
    from tests.tiny import resolve_flags as _resolved

    from .test_resume import _argv
    root, _ = pipeline_checkpoints
    before = sorted(os.listdir(_dir(root, (2, 2, 0))))
    o = _resolved(_argv(root, tp=1, iters=4, load=_dir(root, (2, 2, 0)), pipeline_model_parallel_size=2), 2)
    with pytest.raises(UserError, match=r"num_layers 4 in the checkpoint vs 2 now.*Nothing was loaded or "
                                        r"overwritten"):
        check_resume(o)  # what tnlg pretrain runs in the launching process
    assert sorted(os.listdir(_dir(root, (2, 2, 0)))) == before


# ------------------------------------------------------------ the command: elastic restart, bad input
@pytest.mark.slow
def test_a_pipeline_worker_killed_mid_run_restarts_and_resumes_from_save_then_a_mismatch_is_refused(tmp_path):
    from .test_resume import ROOT, _argv, _env, _losses, _reference
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = _argv(tmp_path, tp=1, iters=6, save=save, save_interval=3, metrics_file=metrics,
                 pipeline_model_parallel_size=2)  # dropout 0.1: each rank's own RNG streams come back
    # the last stage's rank SIGKILLs itself at the end of iteration 4 of the first attempt (checkpoint at 3)
    env = _env(TNLG_TEST_KILL_AT_ITERATION="4:1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    env["PYTHONPATH"] = os.path.join(ROOT, "tests", "fault_injection") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "2", "--max-restarts",
                           "1", *argv], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "at iteration 3 (24 samples consumed)" in log, log[-4000:]  # the restarted group resumed from --save
    assert ck.read_latest(str(save)) == 6 and ck.read_meta(ck.resolve(str(save)))["layout"]["pp"] == 2
    assert _losses(metrics) == _reference(argv, 2)  # the uninterrupted run's, bit for bit

    # the same --save with another layer count: refused in the launching process, before any worker
    before = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in save.rglob("*"))
    bad = [a if a != "2" or argv[i - 1] != "--num-layers" else "4" for i, a in enumerate(argv)]
    proc = subprocess.run([sys.executable, "-m", "tnlg", "pretrain", "--nproc-per-node", "2", *bad], env=_env(),
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "num_layers 2 in the checkpoint vs 4 now" in err and "Nothing was loaded or overwritten" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "rank" not in proc.stdout, err
    assert sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in save.rglob("*")) == before
