"""Checkpoints: commit protocol, bad input, uneven resharding, HF interop, exact resume, layout changes.

Distributed parts run as few spawns as possible (each spawn does several
training runs in-process): ``world4`` (TP=2 x DP=2: exact resume, save at (2,2)
then continue at (2,2), (4,1), (1,4)), ``killed`` (a rank SIGKILLed during a
save) and ``world2`` (exact resume at (1,2,ZeRO-3), resume after the kill, HF
round trip at TP=2).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
from torch.multiprocessing.spawn import ProcessException

from tests.tiny import tiny_options
from tnlg import checkpoint as ck
from tnlg.checkpoint import files as F
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.generation.loading import load_for_inference
from tnlg.model import GPT
from tnlg.runtime.hardware import bf16_skip_reason, fast_bf16_cpu
from tnlg.runtime.spawn import WorkerError
from .pool import run_distributed

# bf16 matmuls must run near the fp32 rate (AVX-512 BF16/AMX, or a GPU); on an AVX2-only CPU they are ~100x slower
needs_fast_bf16 = pytest.mark.skipif(not fast_bf16_cpu(), reason=bf16_skip_reason())

STEPS = 6


def _options(world, **over):
    flags = dict(global_batch_size=8, train_iters=STEPS, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                 lr_decay_iters=STEPS, log_interval=100, eval_iters=2, hidden_dropout=0.1, attention_dropout=0.1,
                 tensor_model_parallel_size=1)
    load = over.pop("load", None)
    flags.update(over)
    o = tiny_options(world, **flags)
    o.checkpoint.load = load  # set after resolve: the directory is created by an earlier run of the same spawn
    return o


# --------------------------------------------------------------------------- spawned bodies

def _valid_loss(ps_world, o, path, tp):
    """Validation loss of checkpoint ``path`` rebuilt at TP ``tp`` (collective over the world)."""
    import torch.distributed as dist

    from tnlg.data.gpt_dataset import build_train_valid_test_datasets
    from tnlg.parallel.state import init_parallel
    from tnlg.training.validation import evaluate
    ps = init_parallel(tp) if tp != ps_world.tp_size else ps_world
    model, tok = load_for_inference(path, ps)
    barrier = dist.barrier if dist.is_initialized() else None
    _, valid, _ = build_train_valid_test_datasets(
        o.data.data_path, o.data.split, o.model.seq_length,
        (o.schedule.global_batch_size, o.logging.eval_iters * o.schedule.global_batch_size, 0), o.data.seed,
        eod_id=tok.eod_id, vocab_size=tok.vocab_size, barrier=barrier)
    return evaluate(model, valid, o.logging, o.schedule, ps, None)


def _hf_logits(ps_world, path, tp, out_dir, tokens):
    from tnlg.interop.hf import to_hf
    from tnlg.parallel.state import init_parallel
    from tnlg.parallel.vocab import gather_logits
    ps = init_parallel(tp)
    model, _ = load_for_inference(path, ps)
    to_hf(model, out_dir)  # collective over TP; the first rank writes
    with torch.no_grad():
        return gather_logits(model(tokens), ps, model.config.vocab_size)


def _tasks(ps, tasks):
    from tnlg.training import train
    out = []
    for kind, *args in tasks:
        if kind == "train":
            s = train(args[0])
            out.append(dict(losses=s["losses"], last_valid_loss=s["last_valid_loss"]))
        elif kind == "valid":
            out.append(_valid_loss(ps, *args))
        elif kind == "hf":
            out.append(_hf_logits(ps, *args))
    return out


def _spawn(world, tasks, fresh=False):
    """``fresh``: new processes (the fault injection's sitecustomize is read when a process starts)."""
    return run_distributed(_tasks, world, 1, tasks, timeout_s=180, fresh=fresh)[0]


# --------------------------------------------------------------------------- fixtures (spawns)

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def world4(dirs):
    """TP=2 x DP=2 ZeRO-1 on 4 processes."""
    w, base = 4, dict(tensor_model_parallel_size=2, zero_stage=1)
    a, rs = str(dirs / "w4_resume"), str(dirs / "w4_reshard")
    nodrop = dict(hidden_dropout=0.0, attention_dropout=0.0, eval_interval=3)
    tasks = [
        ("train", _options(w, **base)),                                            # 0 uninterrupted
        ("train", _options(w, **base, train_iters=3, save=a)),                     # 1 first leg
        ("train", _options(w, **base, load=a, save=a)),                            # 2 resumed leg
        ("train", _options(w, **base, **nodrop, train_iters=3, save=rs)),          # 3 save at (2,2)
        ("train", _options(w, **base, **nodrop, load=rs)),                         # 4 continue at (2,2)
        ("train", _options(w, **nodrop, tensor_model_parallel_size=4, load=rs)),   # 5 continue at (4,1)
        ("train", _options(w, **nodrop, tensor_model_parallel_size=1, zero_stage=3, load=rs)),  # 6 (1,4) ZeRO-3
    ]
    o = _options(w, **base, **nodrop)
    tasks += [("valid", o, rs, tp) for tp in (2, 4, 1)]                          # 7, 8, 9
    return dict(results=_spawn(w, tasks), resume=a, reshard=rs, options=o)


@pytest.fixture(scope="module")
def killed(dirs):
    """(1, 2, ZeRO-3): rank 1 SIGKILLs itself after writing its files of iteration 6, before the commit."""
    d = str(dirs / "killed")
    o = _options(2, tensor_model_parallel_size=1, zero_stage=3, save=d, save_interval=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TNLG_TEST_KILL_DURING_SAVE", "6")  # tests/fault_injection/sitecustomize.py, in each worker
        mp.setenv("PYTHONPATH", os.pathsep.join([os.path.join(os.path.dirname(__file__), "fault_injection"),
                                                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                 os.environ.get("PYTHONPATH", "")]))
        with pytest.raises((WorkerError, ProcessException)):  # a worker's error, or one killed
            _spawn(2, [("train", o)], fresh=True)
    return dict(path=d, iterations=ck.list_iterations(d), latest=ck.read_latest(d),
                leftovers=sorted(n for n in os.listdir(d) if ".tmp" in n))


@pytest.fixture(scope="module")
def hf_model(dirs):
    transformers = pytest.importorskip("transformers")
    from tnlg.data.corpus import default_dataset
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=4096,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    path = str(dirs / "hf_in")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path, default_dataset()[1]


@pytest.fixture(scope="module")
def world2(dirs, killed, hf_model):
    """(1, 2, ZeRO-3) on 2 processes: exact resume, resume after the kill, and the HF model at TP=2."""
    from tnlg.cli import main
    w, base = 2, dict(tensor_model_parallel_size=1, zero_stage=3)
    a = str(dirs / "w2_resume")
    _, hf_dir, tok = hf_model
    ck_tp2 = str(dirs / "hf_ckpt_tp2")
    assert main(["convert", "--from", "hf", hf_dir, "--to", ck_tp2, "--tokenizer-model", tok,
                 "--tensor-model-parallel-size", "2"]) == 0
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    tasks = [
        ("train", _options(w, **base)),                                            # 0 uninterrupted
        ("train", _options(w, **base, train_iters=3, save=a)),                     # 1 first leg
        ("train", _options(w, **base, load=a, save=a)),                            # 2 resumed leg
        ("train", _options(w, **base, save=killed["path"], save_interval=3)),      # 3 restart (auto-resume)
        ("hf", ck_tp2, 2, str(dirs / "hf_out"), tokens),                           # 4 HF at TP=2
    ]
    return dict(results=_spawn(w, tasks), tokens=tokens, hf_out=str(dirs / "hf_out"), ck_tp2=ck_tp2)


@pytest.fixture(scope="module")
def world2_bf16(dirs):
    """16-bit ZeRO mixed precision on 2 processes (TP 1 x DP 2): exact resume at ZeRO-1
    (also with fp32 gradient accumulation over 2 micro batches) and ZeRO-3, and crossing precisions."""
    w = 2
    a, b, c, d, e = (str(dirs / f"bf16_{k}") for k in "abcde")
    z1 = dict(bf16=True, zero_stage=1)
    z3 = dict(bf16=True, zero_stage=3)
    acc = dict(bf16=True, zero_stage=1, accumulate_allreduce_grads_in_fp32=True, micro_batch_size=2)
    tasks = [
        ("train", _options(w, **z1)),                                  # 0 uninterrupted
        ("train", _options(w, **z1, train_iters=3, save=a)),           # 1 first leg
        ("train", _options(w, **z1, load=a, save=a)),                  # 2 resumed leg
        ("train", _options(w, **z3)),                                  # 3 ZeRO-3 uninterrupted
        ("train", _options(w, **z3, train_iters=3, save=b)),           # 4
        ("train", _options(w, **z3, load=b, save=b)),                  # 5
        ("train", _options(w, **acc)),                                 # 6 fp32 grads, 2 micro batches
        ("train", _options(w, **acc, train_iters=3, save=c)),          # 7
        ("train", _options(w, **acc, load=c, save=c)),                 # 8
        ("train", _options(w, zero_stage=1, load=os.path.join(b, "iter_0000003"), save=d)),  # 9 bf16 -> fp32
        ("train", _options(w, zero_stage=1, train_iters=3, save=e)),   # 10 fp32 first leg
        ("train", _options(w, **z3, load=e, save=e)),                  # 11 fp32 -> bf16 ZeRO-3
    ]
    return dict(results=_spawn(w, tasks), paths=(a, b, c, d, e))


@needs_fast_bf16
def test_bf16_resume_is_exact(world2_bf16):
    """The fp32 master and moments are in the checkpoint, so 16-bit runs resume bit for bit."""
    r = world2_bf16["results"]
    for full, first, second, what in ((0, 1, 2, "ZeRO-1"), (3, 4, 5, "ZeRO-3"), (6, 7, 8, "fp32 accumulation")):
        assert r[first]["losses"] + r[second]["losses"] == r[full]["losses"], what
    meta = ck.read_meta(ck.resolve(world2_bf16["paths"][0]))
    assert meta["layout"]["param_dtype"] == "bfloat16"
    assert all("master" in f["kinds"] for f in meta["optim_files"].values())
    # ZeRO-1: each DP rank wrote its own slice; together they cover every parameter exactly once
    assert sorted(meta["optim_files"]) == ["optim_tp00_dp000.safetensors", "optim_tp00_dp001.safetensors"]
    covered = {}
    for f in meta["optim_files"].values():
        for name, (lo, length) in f["pieces"].items():
            covered.setdefault(name, []).append((lo, lo + length))
    for name, rec in meta["params"].items():
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and spans[-1][1] == math.prod(rec["shape"]), name
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), name


@needs_fast_bf16
def test_precision_can_change_on_resume(world2_bf16):
    """A bf16 checkpoint resumes in fp32 from its exact fp32 master, and an fp32 one in bf16."""
    r = world2_bf16["results"]
    bf16_continued, fp32_from_bf16 = r[5]["losses"], r[9]["losses"]
    assert len(fp32_from_bf16) == 3
    assert max(abs(x - y) for x, y in zip(bf16_continued, fp32_from_bf16)) < 0.05
    fp32_first, bf16_from_fp32 = r[10]["losses"], r[11]["losses"]
    assert len(bf16_from_fp32) == 3 and all(math.isfinite(x) for x in bf16_from_fp32)
    assert abs(bf16_from_fp32[0] - fp32_first[-1]) < 0.5


# --------------------------------------------------------------------------- exact resume

def test_resume_is_exact_tp2_dp2_zero1(world4):
    full, first, second = world4["results"][:3]
    assert len(first["losses"]) == 3 and len(second["losses"]) == 3
    assert first["losses"] + second["losses"] == full["losses"]  # bit for bit, dropout on


def test_resume_is_exact_tp1_dp2_zero3(world2):
    full, first, second = world2["results"][:3]
    assert first["losses"] + second["losses"] == full["losses"]


def test_sigkill_during_save_keeps_previous_checkpoint_and_resumes(killed, world2):
    assert killed["iterations"] == [3] and killed["latest"] == 3  # iteration 6 was never committed
    assert killed["leftovers"] == ["iter_0000006.tmp"]
    # the restart resumed from --save automatically, saved 6 and removed the debris
    assert ck.list_iterations(killed["path"]) == [3, 6] and ck.read_latest(killed["path"]) == 6
    assert not any(".tmp" in n for n in os.listdir(killed["path"]))
    full, restarted = world2["results"][0], world2["results"][3]
    assert restarted["losses"] == full["losses"][3:]  # resumed at 3, continued exactly


def test_sigkill_leaves_latest_at_previous(tmp_path):
    """The state a kill during save leaves (a .tmp directory, latest unchanged) loads the previous one."""
    cfg, model, engine, ps = _tiny()
    ck.save(str(tmp_path), iteration=3, consumed_samples=24, model=model, engine=engine, ps=ps, config=cfg)
    shutil.copytree(tmp_path / "iter_0000003", tmp_path / "iter_0000006.tmp")
    os.remove(tmp_path / "iter_0000006.tmp" / "meta.json")
    assert ck.resolve(str(tmp_path)).endswith("iter_0000003")
    cfg2, model2, engine2, _ = _tiny(steps=0)
    assert ck.load(str(tmp_path), model=model2, engine=engine2, ps=ps, config=cfg2)["iteration"] == 3


# --------------------------------------------------------------------------- layout changes

def _close(a, b, rel=1e-5):
    return all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b)) and len(a) == len(b)


def test_reshard_same_validation_loss(world4):
    r = world4["results"]
    v22, v41, v14 = r[7], r[8], r[9]
    assert math.isclose(v41, v22, rel_tol=1e-5) and math.isclose(v14, v22, rel_tol=1e-5), (v22, v41, v14)
    # (1, 1): one process, here
    from tnlg.parallel.state import ParallelState
    v11 = _valid_loss(ParallelState.single(), world4["options"], world4["reshard"], 1)
    assert math.isclose(v11, v22, rel_tol=1e-5), (v22, v11)


def test_reshard_continue_training_matches(world4):
    r = world4["results"]
    ref = r[4]
    assert len(ref["losses"]) == 3
    for got, what in ((r[5], "(4,1)"), (r[6], "(1,4)")):
        assert _close(got["losses"], ref["losses"]), (what, got["losses"], ref["losses"])
        assert math.isclose(got["last_valid_loss"], ref["last_valid_loss"], rel_tol=1e-5)
    from tnlg.training import train
    o = _options(1, tensor_model_parallel_size=1, hidden_dropout=0.0, attention_dropout=0.0, eval_interval=3,
                 load=world4["reshard"])
    got = train(o)
    assert _close(got["losses"], ref["losses"]), ("(1,1)", got["losses"], ref["losses"])


# --------------------------------------------------------------------------- HF interop

def test_hf_round_trip_bit_identical_and_logits(world2, hf_model, tmp_path):
    from safetensors.torch import load_file

    from tnlg.cli import main
    hf, hf_dir, _ = hf_model
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    back = load_file(os.path.join(world2["hf_out"], "model.safetensors"))  # HF -> tnlg TP=2 (2 procs) -> HF
    assert set(back) == set(original)
    for k in original:
        assert torch.equal(back[k], original[k]), k
    assert main(["convert", "--from", world2["ck_tp2"], "--to", "hf", str(tmp_path / "hf2")]) == 0  # offline
    offline = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert all(torch.equal(offline[k], original[k]) for k in original)
    with torch.no_grad():
        ref = hf(world2["tokens"]).logits
    torch.testing.assert_close(world2["results"][4], ref, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- single process: protocol

def _tiny(steps=2, heads=4, hidden=32, layers=2, vocab=100):
    from tnlg.optim import build_engine
    from tnlg.parallel.state import ParallelState
    ps = ParallelState.single()
    cfg = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=8, vocab_size=vocab,
                    hidden_dropout=0.1, attention_dropout=0.1)
    model = GPT(cfg, ps)
    engine = build_engine(model, ps, 1, lr=1e-2)
    x = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        engine.zero_grad()
        engine.backward(engine.model(x, labels=x))
        engine.step()
    return cfg, model, engine, ps


def _snapshot(root):
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            st = os.stat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_save_layout_same_iteration_twice_and_keep_last(tmp_path):
    cfg, model, engine, ps = _tiny()
    root = str(tmp_path / "c")
    d = ck.save(root, iteration=2, consumed_samples=16, model=model, engine=engine, ps=ps, config=cfg)
    assert sorted(os.listdir(d)) == ["meta.json", "model_tp00.safetensors", "optim_tp00_dp000.safetensors",
                                     "rng_dp000_tp00.pt"]
    assert open(os.path.join(root, ck.LATEST)).read().strip() == "2"
    os.makedirs(os.path.join(root, "iter_0000009.tmp"))  # a user's folder that looks like debris
    F.make_save_dir(os.path.join(root, "iter_0000008.tmp"))  # debris of a crashed save (has the marker)
    for it in (3, 4, 5):
        ck.save(root, iteration=it, consumed_samples=8 * it, model=model, engine=engine, ps=ps, config=cfg,
                keep_last=2)
    assert ck.list_iterations(root) == [4, 5] and ck.read_latest(root) == 5
    assert not os.path.exists(os.path.join(root, "iter_0000008.tmp"))
    assert os.path.isdir(os.path.join(root, "iter_0000009.tmp")), "a folder the save did not write was deleted"


def test_parameters_that_are_not_finite_are_not_saved(tmp_path):
    """A parameter holding NaN (or inf) is found as the weights stream: the save is refused naming it, its
    folder is removed and the previous checkpoint stays the latest."""
    cfg, model, engine, ps = _tiny()
    root = str(tmp_path / "c")
    ck.save(root, iteration=2, consumed_samples=16, model=model, engine=engine, ps=ps, config=cfg)
    for bad in (float("nan"), float("inf")):
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.view(-1)[5] = bad
        with pytest.raises(ck.NonFiniteParameters, match="parameter transformer.h.1.mlp.c_fc.weight .*holds NaN or "
                                                         "infinite values; the checkpoint of iteration 3 was not "
                                                         "written"):
            ck.save(root, iteration=3, consumed_samples=24, model=model, engine=engine, ps=ps, config=cfg)
        assert ck.read_latest(root) == 2 and sorted(os.listdir(root)) == sorted([ck.LATEST, ck.iter_dir_name(2)])


def test_saving_an_iteration_again_replaces_the_older_save(tmp_path, capsys):
    """A run rolled back to an earlier checkpoint that reaches an iteration again
    replaces the older save of that iteration (atomically, with a log line), never discards the new one."""
    cfg, model, engine, ps = _tiny()
    root = str(tmp_path / "c")
    ck.save(root, iteration=2, consumed_samples=16, model=model, engine=engine, ps=ps, config=cfg)
    old = ck.read_meta(os.path.join(root, ck.iter_dir_name(2)))
    with torch.no_grad():  # the "diverged" run: other weights
        for p in engine.backend.params:
            p.add_(1.0)
    capsys.readouterr()
    ck.save(root, iteration=2, consumed_samples=99, model=model, engine=engine, ps=ps, config=cfg)
    assert "replaced an older save of iteration 2" in capsys.readouterr().out
    new = ck.read_meta(os.path.join(root, ck.iter_dir_name(2)))
    assert new["consumed_samples"] == 99 and new["sha256"] != old["sha256"]
    assert ck.read_latest(root) == 2 and ck.list_iterations(root) == [2]
    assert sorted(os.listdir(root)) == sorted([ck.LATEST, ck.iter_dir_name(2)])


def test_missing_pointer_resumes_from_newest_complete_iteration(tmp_path):
    """A crash between the rename of a new iteration and the write of ``latest``
    (here: no pointer at all, and a pointer naming a damaged directory) resumes from the newest
    complete iteration and says so."""
    cfg, model, engine, ps = _tiny()
    root = str(tmp_path / "c")
    for it in (2, 4):
        ck.save(root, iteration=it, consumed_samples=8 * it, model=model, engine=engine, ps=ps, config=cfg)
    os.remove(os.path.join(root, ck.LATEST))
    notes = []
    assert ck.resolve(root, "--load", notes) == os.path.join(root, ck.iter_dir_name(4))
    assert "newest complete iteration, 4" in notes[0]
    F.write_latest(root, 6)  # names a directory that never got committed
    with open(os.path.join(root, ck.iter_dir_name(4), "model_tp00.safetensors"), "ab") as f:
        f.write(b"x")  # and the newest one is damaged
    notes = []
    assert ck.resolve(root, "--load", notes) == os.path.join(root, ck.iter_dir_name(2))
    assert "iteration 6" in notes[0]


def test_load_restores_weights_optimizer_and_rng_exactly(tmp_path):
    cfg, model, engine, ps = _tiny()
    ck.save(str(tmp_path), iteration=2, consumed_samples=16, model=model, engine=engine, ps=ps, config=cfg)
    expect_rand = torch.rand(4)  # the stream after the save
    torch.manual_seed(123)
    cfg2, model2, engine2, _ = _tiny(steps=0)
    state = ck.load(str(tmp_path), model=model2, engine=engine2, ps=ps, config=cfg2)
    assert state["iteration"] == 2 and state["consumed_samples"] == 16 and engine2.num_steps == 2
    assert torch.equal(torch.rand(4), expect_rand)
    x = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(5))
    after_load = torch.get_rng_state()
    for e in (engine, engine2):  # one more step each from the same stream (dropout on): identical
        torch.set_rng_state(after_load)
        e.zero_grad()
        e.backward(e.model(x, labels=x))
        e.step()
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a, b), n


def test_uneven_reshard_28_heads(tmp_path):
    """Shards of a 28-head model re-slice exactly between TP 1, 8, 3, 4 (weights and Adam moments)."""
    from tnlg.checkpoint.reshard import full_targets, slice_full, targets_for
    from tnlg.checkpoint.offline import reshard_checkpoint
    cfg, model, engine, ps = _tiny(heads=28, hidden=56, layers=1)
    src = str(tmp_path / "tp1")
    ck.save(src, iteration=2, consumed_samples=0, model=model, engine=engine, ps=ps, config=cfg)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = engine.optimizer_state_by_param()
    tp8 = reshard_checkpoint(src, str(tmp_path / "tp8"), 8, describe=GPT.describe)
    meta8 = ck.read_meta(tp8)
    assert meta8["params"]["transformer.h.0.attn.c_attn.weight"]["sizes"] == [3 * 2 * n for n in
                                                                               [4, 4, 4, 4, 3, 3, 3, 3]]
    for tp in (3, 4, 8):
        for r in range(tp):
            params, states = ck.read_states(tp8, meta8, GPT.describe(cfg, tp), r)
            for n, t in targets_for(GPT.describe(cfg, tp), r).items():
                assert torch.equal(params[n], slice_full(full[n][:cfg.vocab_size] if "wte" in n else full[n], t)), n
                want = slice_full(moments[n]["exp_avg_sq"][:cfg.vocab_size] if "wte" in n
                                  else moments[n]["exp_avg_sq"], t)
                assert torch.equal(states[n]["exp_avg_sq"], want), n
    # back to full tensors (what `convert --to hf` reads)
    from tnlg.checkpoint import files as F
    from tnlg.checkpoint.reshard import ShardReader
    reader = ShardReader(tp8, meta8, F.model_file)
    for n, t in full_targets(meta8).items():
        assert torch.equal(reader.tensor(n, n, t), full[n][:cfg.vocab_size] if "wte" in n else full[n])


def test_checkpoint_info_cli(tmp_path, capsys):
    from tnlg.cli import main
    cfg, model, engine, ps = _tiny()
    ck.save(str(tmp_path), iteration=2, consumed_samples=16, model=model, engine=engine, ps=ps, config=cfg)
    assert main(["checkpoint", "info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "iteration    2 (16 samples consumed)" in out and "TP=1 x DP=1" in out and "num_layers=2" in out
    assert main(["checkpoint", "info", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration"] == 2


# --------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def trained(dirs):
    """A checkpoint written by the real training loop (one process), with its options recorded."""
    from tnlg.training import train
    root = str(dirs / "trained")
    train(_options(1, train_iters=2, save=root))
    return root


def _expect_error(o, root, match):
    from tnlg.training import train
    before = _snapshot(root)
    with pytest.raises(UserError, match=match):
        train(o)
    assert _snapshot(root) == before, "nothing may be written or overwritten"


def test_config_conflict_is_clear_error(trained, tmp_path):
    root = str(tmp_path / "c")
    shutil.copytree(trained, root)
    _expect_error(_options(1, seed=7, split="90,9,1", load=root, save=root), root,
                  re.escape("--split '969,30,1' in the checkpoint vs '90,9,1' now; --seed 1234 in the checkpoint vs 7"))
    _expect_error(_options(1, num_layers=3, load=root, save=root), root,
                  "num_layers 2 in the checkpoint vs 3 now.*different architecture")
    # auto-resume from --save: the same check, naming --save
    _expect_error(_options(1, hidden_size=64, save=root), root,
                  "found in --save.*hidden_size 32 in the checkpoint vs 64")
    # a dropout rate is a training setting, not the architecture: named with the flag that resumes
    _expect_error(_options(1, hidden_dropout=0.0, load=root, save=root), root,
                  r"hidden_dropout 0.1 in the checkpoint vs 0.0 now \(a training setting, not the architecture.*"
                  r"give --hidden-dropout 0.1, or --use-checkpoint-args[^.]*\)\. Flags that define")


@pytest.mark.parametrize("damage,match", [
    ("missing_shard", "missing 'optim_tp00_dp000.safetensors'"),
    ("truncated_shard", "truncated"),
    ("bit_flip", "does not match the SHA-256"),
    ("latest_nowhere_nothing_complete", "none of the iteration directories"),
    ("latest_garbage", "not an iteration number"),
    ("no_meta", "has no meta.json"),
])
def test_damaged_checkpoint_is_clear_error(trained, tmp_path, damage, match):
    """Each damage is one paragraph naming it; a damaged shard's also names the earlier complete iterations
    beside it and the ``--load`` that resumes from the newest (an intact copy here stands for iteration 1)."""
    root = str(tmp_path / "c")
    shutil.copytree(trained, root)
    it = os.path.join(root, "iter_0000002")
    if damage in ("missing_shard", "truncated_shard", "bit_flip"):
        shutil.copytree(it, os.path.join(root, "iter_0000001"))
        match += (".*Earlier complete iterations in .*: iter_0000001; --load " + re.escape(os.path.join(root, "iter_0000001"))
                  + " resumes from the newest of them")
    if damage == "missing_shard":
        os.remove(os.path.join(it, "optim_tp00_dp000.safetensors"))
    elif damage == "bit_flip":  # same size: only the checksum can tell
        path = os.path.join(it, "optim_tp00_dp000.safetensors")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 5)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
    elif damage == "truncated_shard":
        path = os.path.join(it, "model_tp00.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    elif damage == "latest_nowhere_nothing_complete":
        with open(os.path.join(root, ck.LATEST), "w") as f:
            f.write("99\n")
        os.remove(os.path.join(it, "model_tp00.safetensors"))
    elif damage == "latest_garbage":
        with open(os.path.join(root, ck.LATEST), "w") as f:
            f.write("<html>\n")
    elif damage == "no_meta":
        os.remove(os.path.join(it, "meta.json"))
    _expect_error(_options(1, load=root, save=root), root, match)


def test_inference_load_errors(tmp_path):
    with pytest.raises(UserError, match="holds no checkpoint"):
        load_for_inference(str(tmp_path))
    cfg, model, engine, ps = _tiny()
    ck.save(str(tmp_path), iteration=1, consumed_samples=0, model=model, engine=engine, ps=ps, config=cfg)
    from tnlg.parallel.state import ParallelState
    with pytest.raises(UserError, match="largest valid tensor-parallel size for attention is 4"):
        load_for_inference(str(tmp_path), ParallelState.for_virtual_rank(5, 0))
    m, tok = load_for_inference(os.path.join(str(tmp_path), "iter_0000001"))
    assert tok is None and not m.training
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), model.parameters()))


# --------------------------------------------------------------------------- 28 heads, TP 8 -> 4, 3

@pytest.mark.slow
def test_28_heads_saved_at_tp8_loads_at_tp4_and_tp3(tmp_path):
    heads = dict(num_layers=1, hidden_size=56, num_attention_heads=28, hidden_dropout=0.0, attention_dropout=0.0)
    root = str(tmp_path / "tp8")
    o8 = _options(8, tensor_model_parallel_size=8, train_iters=2, save=root, **heads)
    v8, v4 = _spawn(8, [("train", o8), ("valid", o8, root, 8), ("valid", o8, root, 4)])[1:]
    meta = ck.read_meta(ck.resolve(root))
    assert meta["layout"]["tp"] == 8
    assert meta["params"]["transformer.h.0.attn.c_proj.weight"]["sizes"] == [2 * n for n in [4] * 4 + [3] * 4]
    (v3,) = _spawn(3, [("valid", _options(3, tensor_model_parallel_size=3, **heads), root, 3)])
    from tnlg.parallel.state import ParallelState
    v1 = _valid_loss(ParallelState.single(), _options(1, **heads), root, 1)
    for v, what in ((v4, "TP=4"), (v3, "TP=3"), (v1, "TP=1")):
        assert math.isclose(v, v8, rel_tol=1e-5), (what, v, v8)


def test_convert_cli_errors(tmp_path, capsys):
    from tnlg.cli import main
    cfg, model, engine, ps = _tiny()
    ck.save(str(tmp_path / "c"), iteration=1, consumed_samples=0, model=model, engine=engine, ps=ps, config=cfg)
    os.makedirs(tmp_path / "full")
    (tmp_path / "full" / "x").write_text("keep me")
    for argv, match in (
            (["convert", "--from", "hf", "a", "--to", "hf", "b"], "converts nothing"),
            (["convert", "--from", "x", "y", "--to", str(tmp_path / "n")], "takes 'hf DIR'"),
            (["convert", "--from", str(tmp_path / "c"), "--to", str(tmp_path / "full")], "not empty"),
            (["convert", "--from", str(tmp_path / "c"), "--to", str(tmp_path / "n"), "--tp", "5"],
             "largest valid tensor-parallel size for attention is 4"),
            (["convert", "--from", str(tmp_path / "empty"), "--to", str(tmp_path / "n")], "not a directory"),
            (["checkpoint", "info", str(tmp_path / "full")], "holds no tnlg checkpoint")):
        assert main(argv) == 2, argv
        assert re.search(match, capsys.readouterr().err), (argv, match)
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    assert not (tmp_path / "n").exists() or not os.listdir(tmp_path / "n")
    # resharding to the same TP is a plain copy that loads identically
    assert main(["convert", "--from", str(tmp_path / "c"), "--to", str(tmp_path / "same")]) == 0
    m, _ = load_for_inference(str(tmp_path / "same"))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), model.parameters()))
