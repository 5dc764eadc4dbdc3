"""Megatron-LM checkpoints in and out, against megatron-core itself (tests/megatron_reference.py).

megatron-core's GPTModel (local spec) at TP 2 (and TP 2 x PP 2) with random weights is saved by
Megatron's own code in both formats; the converted tnlg checkpoint must give Megatron's logits
(fp32, 1e-5) at tnlg TP 1, 2 and 4 (and through tnlg's pipeline at PP 2); a tnlg checkpoint exported
to Megatron (also one saved by a tnlg pipeline run) must load into GPTModel (``load_state_dict`` per
rank, ``dist_checkpointing.load``) and give the same logits (at PP > 1 through the stages). Also: exact and
tanh GELU, tied and untied output layers, a vocabulary Megatron pads, pre-core (legacy) names with
every ``checkpoint_version`` QKV order, Transformer Engine names, and bad input.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.needs_package("megatron.core")  # the reference: megatron-core itself

from tnlg.generation.loading import load_for_inference  # noqa: E402
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint  # noqa: E402
from tnlg.parallel.vocab import gather_logits  # noqa: E402
from .megatron_pool import run_distributed  # noqa: E402

from . import megatron_reference as R  # noqa: E402

BASE = dict(layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=100, divisible=8, tp=2, pp=1)
EXACT_TIED = dict(BASE, openai_gelu=False, untie=False)    # Megatron's defaults; vocabulary 100 padded to 112
TANH_UNTIED = dict(BASE, openai_gelu=True, untie=True)
TOL = dict(atol=1e-5, rtol=1e-5)


def _tokens(spec):
    return torch.randint(0, spec["vocab"], (2, spec["seq"]), generator=torch.Generator().manual_seed(0))


def _reference(root, spec):
    """Megatron's logits, its checkpoints written by its own code under ``root`` (both formats)."""
    return run_distributed(R.save_reference, spec["tp"], 1, spec, str(root), _tokens(spec), timeout_s=180)[0]


def _tnlg_logits(_ps, ckpts, tokens, tps):
    """Each checkpoint loaded at each TP size of ``tps``, the processes regrouped per size (the rest of
    the world is data parallel): its logits over the real vocabulary, per TP size."""
    from tnlg.parallel.state import init_parallel
    out = {}
    for tp in tps:
        ps = init_parallel(tp)
        out[tp] = []
        for path in ckpts:
            model, _ = load_for_inference(path, ps)
            with torch.no_grad():
                out[tp].append(gather_logits(model(tokens), ps, model.config.vocab_size))
    return out


def _logits_at(ckpts, spec, tps=(1, 2, 4)):
    """tnlg's logits of each checkpoint at each TP size of ``tps``: one group of ``max(tps)`` processes."""
    return run_distributed(_tnlg_logits, max(tps), 1, ckpts, _tokens(spec), tps, timeout_s=180)[0]


def _check_tnlg_logits(ckpts, ref, spec, tps=(1, 2, 4)):
    for tp, per_checkpoint in _logits_at(ckpts, spec, tps).items():
        for logits in per_checkpoint:
            torch.testing.assert_close(logits, ref, **TOL, msg=lambda m, tp=tp: f"tnlg TP {tp}: {m}")


def _megatron_loads(_ps, loads):
    """Worker: :func:`megatron_reference.load_and_run` of each ``(spec, root, fmt, tokens)`` in turn,
    megatron-core's parallel state torn down between them (each may have its own TP x PP)."""
    from megatron.core import parallel_state
    out = []
    for load in loads:
        out.append(R.load_and_run(_ps, *load))
        parallel_state.destroy_model_parallel()
    return out


def _load_in_megatron(loads, world):
    """megatron-core's loaders on ``world`` processes, one load after the other: per rank, each load's result."""
    return run_distributed(_megatron_loads, world, 1, loads, timeout_s=300)


_RUNS: dict = {}


def _run(spec, factory):
    """Megatron's reference run of ``spec`` and its checkpoints converted to tnlg (once per module)."""
    key = tuple(sorted(spec.items()))
    if key not in _RUNS:
        root = factory.mktemp("megatron")
        ref = _reference(root, spec)
        converted = {fmt: megatron_to_checkpoint(str(root / fmt), str(root / f"tnlg_{fmt}"))
                     for fmt in ("legacy", "torch_dist")}
        _RUNS[key] = spec, root, ref, converted
    return _RUNS[key]


@pytest.fixture(scope="module", params=[EXACT_TIED, TANH_UNTIED], ids=["exact-gelu-tied", "tanh-gelu-untied"])
def megatron_run(request, tmp_path_factory):
    return _run(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    """Megatron's defaults (exact GELU, tied output layer), for the checks of other namings."""
    return _run(EXACT_TIED, tmp_path_factory)


def test_import_gives_megatrons_logits_at_tnlg_tp_1_2_4(megatron_run):
    spec, root, ref, converted = megatron_run
    _check_tnlg_logits([converted["legacy"], converted["torch_dist"]], ref, spec)
    model, _ = load_for_inference(converted["torch_dist"])
    cfg = model.config
    assert (cfg.vocab_size, cfg.openai_gelu, cfg.untie_embeddings_and_output_weights) == (
        spec["vocab"], spec["openai_gelu"], spec["untie"])  # the padding rows of Megatron's TP 2 are gone


def test_import_keeps_the_iteration_and_consumed_samples(megatron_run):
    from tnlg.checkpoint.files import read_meta
    _, _, _, converted = megatron_run
    for path in converted.values():
        meta = read_meta(path)
        assert (meta["iteration"], meta["consumed_samples"], meta["optimizer"]["present"]) == (7, 56, False)
        assert os.path.basename(path) == "iter_0000007"


EXPORTS = [("torch_dist", 2), ("legacy", 2), ("torch_dist", 1)]  # (format, Megatron TP)


@pytest.fixture(scope="module")
def exported(megatron_run, tmp_path_factory):
    """The converted checkpoint exported to Megatron at each of EXPORTS, each loaded by megatron-core
    (``load_and_run`` at that TP, all on one group of 2 processes): per export, rank 0's result."""
    spec, _, _, converted = megatron_run
    loads = []
    for fmt, tp in EXPORTS:
        dst = tmp_path_factory.mktemp(f"megatron_{fmt}_tp{tp}")
        checkpoint_to_megatron(converted["torch_dist"], str(dst), fmt=fmt, tp=tp)
        loads.append((dict(spec, tp=tp), str(dst), fmt, _tokens(spec)))
    return dict(zip(EXPORTS, _load_in_megatron(loads, 2)[0]))


@pytest.mark.parametrize("fmt,tp", EXPORTS)
def test_export_loads_into_megatron_with_the_same_logits(megatron_run, exported, fmt, tp):
    spec, _, ref, _ = megatron_run
    out = exported[fmt, tp]
    torch.testing.assert_close(out["logits"], ref, **TOL)
    assert out["args"]["padded_vocab_size"] == R.padded(dict(spec, tp=tp))
    assert out["iteration"] == 7


# --------------------------------------------------------------------------- pipeline parallelism

@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """TP 2 x PP 2, 4 layers: each stage's GPTModel takes its layers from the PP 1 model (whose forward
    is the reference) and is saved by Megatron's code as its stage of a PP 2 checkpoint; its pipelined
    forward (stage after stage, :func:`megatron_reference.logits_of`) must give the PP 1 logits."""
    spec = dict(EXACT_TIED, layers=4)
    flat = tmp_path_factory.mktemp("megatron_pp1")
    ref = _reference(flat, spec)
    root = tmp_path_factory.mktemp("megatron_pp2")
    out = run_distributed(R.save_pipeline, 4, 1, dict(spec, pp=2), str(root), str(flat), _tokens(spec),
                          timeout_s=180)
    torch.testing.assert_close(out[-1]["logits"], ref, **TOL)  # the last stage's (rank 3: stage 1, TP rank 1)
    return dict(spec, pp=2), root, ref, [o["state"] for o in out]


@pytest.mark.slow
def test_import_of_a_pipeline_parallel_checkpoint(pipeline_run):
    spec, root, ref, _ = pipeline_run
    assert sorted(os.listdir(root / "legacy" / "iter_0000007")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    ckpts = [megatron_to_checkpoint(str(root / fmt), str(root / f"tnlg_{fmt}"), tp_size=2)
             for fmt in ("legacy", "torch_dist")]
    _check_tnlg_logits(ckpts, ref, spec, tps=(1, 2))


def _check_stage_states(loaded, stages, spec):
    """Every stage's loaded state equals the one Megatron built from the same weights, except the
    vocabulary's padding rows, which are zeros (tnlg keeps no padding rows; Megatron's hold random
    values no token ever uses)."""
    for rank, res in enumerate(loaded):
        assert set(res["state"]) == set(stages[rank])
        for key, value in stages[rank].items():
            got = res["state"][key]
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                real = max(0, min(value.shape[0], spec["vocab"] - res["tp_rank"] * value.shape[0]))
                assert not got[real:].any(), key
                got, value = got[:real], value[:real]
            torch.testing.assert_close(got, value, atol=0, rtol=0, msg=key)


@pytest.fixture(scope="module")
def exported_at_pp_2(pipeline_run, tmp_path_factory):
    """The PP 2 checkpoint imported, exported at TP 2 x PP 2 in each format and loaded by each stage's
    GPTModel (both loads on one group of 4 processes): per format, every rank's result."""
    spec, root, _, _ = pipeline_run
    tmp = tmp_path_factory.mktemp("export_pp2")
    tnlg_ckpt = megatron_to_checkpoint(str(root / "torch_dist"), str(tmp / "tnlg"))
    formats = ("legacy", "torch_dist")
    for fmt in formats:
        checkpoint_to_megatron(tnlg_ckpt, str(tmp / fmt), fmt=fmt, tp=2, pp=2)
    per_rank = _load_in_megatron([(spec, str(tmp / fmt), fmt, _tokens(spec)) for fmt in formats], 4)
    return {fmt: [rank[i] for rank in per_rank] for i, fmt in enumerate(formats)}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_export_at_pp_2_loads_every_stage(pipeline_run, exported_at_pp_2, fmt):
    """Exported at TP 2 x PP 2 and loaded by each stage's GPTModel: the stages' states are Megatron's
    own, and the pipelined forward gives Megatron's logits."""
    spec, _, ref, stages = pipeline_run
    loaded = exported_at_pp_2[fmt]
    _check_stage_states(loaded, stages, spec)
    torch.testing.assert_close(loaded[-1]["logits"], ref, **TOL)


def _pipeline_logits(model, ps, tokens):
    """tnlg's logits through its pipeline (the last stage's, full vocabulary; ``None`` on the others)."""
    from tnlg.model.inference import forward_logits
    model.eval()
    with torch.no_grad():
        local = forward_logits(model, tokens)
    model.train()
    return None if local is None else gather_logits(local, ps, model.config.vocab_size)


def _resume_train_save_at_pp_2(_ps, imported: str, save_root: str, tokens: torch.Tensor):
    """Worker (4 processes: tnlg PP 2 x TP 2): the imported checkpoint loaded by ``tnlg eval --pp 2``'s
    loader (``load_for_inference``); then what ``tnlg pretrain --pp 2 --tp 2 --load`` runs: the stages
    built, the checkpoint loaded by name (``checkpoint.load``), one training step through the 1F1B
    pipeline (2 micro batches), saved at PP 2 (``checkpoint.save``). Returns the pipelines' logits (the
    evaluation's, the training run's before and after the step) and the saved folder."""
    from tnlg import checkpoint as ck
    from tnlg.config import GPTConfig
    from tnlg.optim import build_engine
    from tnlg.model.stage import StageModel
    from tnlg.parallel.pipeline import chunk_layers
    from tnlg.parallel.pipeline_schedule import Pipeline
    from tnlg.parallel.state import init_parallel
    from tnlg.training.step import train_step
    ps = init_parallel(2, pipeline_parallel_size=2)
    evaluated = _pipeline_logits(load_for_inference(imported, ps)[0], ps, tokens)
    cfg = GPTConfig.from_dict(ck.read_meta(ck.resolve(imported))["config"])
    model = StageModel(cfg, ps, [chunk_layers(cfg.num_layers, 2)[ps.pp_rank]], device="meta")
    engine = build_engine(model, ps, 0, lr=1e-2, weight_decay=0.1, clip_grad=1.0, grad_accum_steps=2)
    info = ck.load(imported, model=engine.model, engine=engine, ps=ps, config=cfg)
    before = _pipeline_logits(engine.model, ps, tokens)
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(0, cfg.vocab_size, (2, 2, tokens.shape[1] + 1), generator=g)
    micro = [dict(tokens=s[:, :-1], labels=s[:, 1:], loss_mask=torch.ones(2, tokens.shape[1])) for s in seqs]
    train_step(engine.model, engine, micro, 1e-2, autocast=None, ps=ps, iteration=info["iteration"] + 1,
               pipeline=Pipeline(engine.model, 2, "1f1b"))
    path = ck.save(save_root, iteration=info["iteration"] + 1, consumed_samples=info["consumed_samples"] + 4,
                   model=engine.model, engine=engine, ps=ps, config=cfg)
    return dict(evaluated=evaluated, before=before, after=_pipeline_logits(engine.model, ps, tokens), path=path)


@pytest.mark.slow
def test_pipeline_round_trip_megatron_tnlg_pp_2_training_megatron(pipeline_run, tmp_path):
    """Megatron TP 2 x PP 2 -> tnlg (the import writes one PP-independent checkpoint) -> tnlg at PP 2 x TP 2
    loads it by name, for evaluation and for training: Megatron's logits; one training step there, saved
    at PP 2 (each stage its own files) -> exported at Megatron TP 2 x PP 2 in both formats, and by the
    command at TP 1 x PP 4 -> megatron-core's pipelined forward gives the logits tnlg's pipeline computed
    after the step."""
    from tnlg.checkpoint.files import read_meta
    spec, root, ref, _ = pipeline_run
    imported = megatron_to_checkpoint(str(root / "legacy"), str(tmp_path / "imported"), tp_size=2)
    out = run_distributed(_resume_train_save_at_pp_2, 4, 1, imported, str(tmp_path / "trained"), _tokens(spec),
                          timeout_s=300)
    for hop in ("evaluated", "before"):  # the last stage's: rank 3 (stage 1, TP rank 1)
        torch.testing.assert_close(out[-1][hop], ref, **TOL)
        assert all(o[hop] is None for o in out[:2])
    trained = out[0]["path"]
    meta = read_meta(trained)
    assert (meta["layout"]["pp"], meta["iteration"]) == (2, 8)
    assert sorted(n for n in meta["files"] if n.startswith("model")) == [
        f"model_pp{p:02d}_tp{t:02d}.safetensors" for p in (0, 1) for t in (0, 1)]
    after = out[-1]["after"]
    assert (after - ref).abs().max() > 1e-3  # the step changed the model
    # the command, at another Megatron layout: TP 1 x PP 4 (one layer per stage)
    r = subprocess.run([sys.executable, "-m", "tnlg", "convert", "--from", trained, "--to", "megatron",
                        str(tmp_path / "tp1pp4"), "--tp", "1", "--pp", "4"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=300)
    assert r.returncode == 0, r.stderr
    loads = []
    for fmt in ("legacy", "torch_dist"):
        checkpoint_to_megatron(trained, str(tmp_path / fmt), fmt=fmt, tp=2, pp=2)
        loads.append((spec, str(tmp_path / fmt), fmt, _tokens(spec)))
    loads.append((dict(spec, tp=1, pp=4), str(tmp_path / "tp1pp4"), "torch_dist", _tokens(spec)))
    per_rank = _load_in_megatron(loads, 4)  # the last stage's logits: rank 3's
    for (_, _, fmt, _), first, last in zip(loads, per_rank[0], per_rank[-1]):
        torch.testing.assert_close(last["logits"], after, **TOL, msg=lambda m, fmt=fmt: f"{fmt}: {m}")
        assert first["iteration"] == 8, fmt


# --------------------------------------------------------------------------- other namings

def _transpose_to_version(t, version, heads):
    """A core-layout ``[np, 3, hn]`` QKV shard in the order of an older checkpoint_version: the
    inverse of Megatron-LM's ``fix_query_key_value_ordering`` (``_transpose_first_dim``)."""
    rest = t.shape[1:]
    if version == 0:  # stored [3, np, hn]
        return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)
    if version == 1.0:  # stored [np, hn, 3]
        return t.reshape(heads, 3, -1, *rest).transpose(1, 2).reshape(t.shape)
    return t


_LEGACY_LAYER = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
                 "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
                 "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}


def _to_pre_core(model, version, heads_per_rank, old_names):
    """A megatron-core state dict renamed to the legacy model's nested layout
    (``language_model.{embedding, encoder}``; ``transformer``/``attention.`` when ``old_names``)."""
    encoder = {}
    lm = {"embedding": {"word_embeddings": {}, "position_embeddings": {}}, "transformer" if old_names else "encoder":
          encoder}
    for key, value in model.items():
        if key.endswith("_extra_state"):
            continue
        if key.startswith("embedding."):
            _, table, leaf = key.split(".")
            lm["embedding"][table][leaf] = value
        elif key.startswith("decoder.final_layernorm."):
            encoder["final_layernorm." + key.rsplit(".", 1)[1]] = value
        elif key == "output_layer.weight":
            lm["output_layer"] = {"weight": value}
        else:
            j, rest = key[len("decoder.layers."):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            name = _LEGACY_LAYER[module]
            if old_names:
                name = name.replace("self_attention.", "attention.")
            if module == "self_attention.linear_qkv":
                value = _transpose_to_version(value, version, heads_per_rank)
            encoder[f"layers.{j}.{name}.{leaf}"] = value
    return {"language_model": lm}


def _rewrite_legacy(src_root, dst_root, rewrite_model, version=3.0):
    shutil.copytree(src_root, dst_root)
    for dirpath, _, names in os.walk(dst_root):
        for n in names:
            if n == "model_optim_rng.pt":
                path = os.path.join(dirpath, n)
                state = torch.load(path, weights_only=False)
                state["model"], state["checkpoint_version"] = rewrite_model(state["model"]), version
                torch.save(state, path)


def _to_transformer_engine(model):
    """The TE spec's state dict: LayerNorms fused into the next linear layer, FP8 extra state as BytesIO."""
    import io
    out = {}
    for key, value in model.items():
        key = key.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_").replace(
            "pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
        out[key] = io.BytesIO(b"fp8 state") if key.endswith("_extra_state") else value
    return out


PRE_CORE = [(0, True), (1.0, False), (2.0, False)]  # (checkpoint_version, the oldest "transformer"/"attention" names)


@pytest.fixture(scope="module")
def other_namings(tied_run, tmp_path_factory):
    """Megatron's legacy checkpoint rewritten with the names of every pre-core ``checkpoint_version``
    (their QKV orders) and of the Transformer Engine spec, each imported by tnlg and loaded at TP 2
    (all on one group of 2 processes): per naming, its logits."""
    spec, root, _, _ = tied_run
    tmp = tmp_path_factory.mktemp("namings")
    heads = spec["heads"] // spec["tp"]
    rewrites = {("pre-core", v, old): (lambda m, v=v, old=old: _to_pre_core(m, v, heads, old), v)
                for v, old in PRE_CORE}
    rewrites["transformer-engine"] = (_to_transformer_engine, 3.0)
    ckpts = []
    for i, (rewrite, version) in enumerate(rewrites.values()):
        _rewrite_legacy(root / "legacy", tmp / f"megatron_{i}", rewrite, version)
        ckpts.append(megatron_to_checkpoint(str(tmp / f"megatron_{i}"), str(tmp / f"tnlg_{i}")))
    return dict(zip(rewrites, _logits_at(ckpts, spec, tps=(2,))[2]))


@pytest.mark.parametrize("version,old_names", PRE_CORE)
def test_pre_core_names_and_qkv_orders(tied_run, other_namings, version, old_names):
    torch.testing.assert_close(other_namings["pre-core", version, old_names], tied_run[2], **TOL)


def test_transformer_engine_names(tied_run, other_namings):
    torch.testing.assert_close(other_namings["transformer-engine"], tied_run[2], **TOL)


@pytest.mark.slow
def test_cli_both_ways_without_megatron_imported(tied_run, tmp_path):
    """``tnlg convert`` in a fresh process (megatron-core not imported, so its enums and paths in the
    saved args are read as inert records), and back."""
    spec, root, ref, _ = tied_run
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = [sys.executable, "-m", "tnlg", "convert"]
    r = subprocess.run(run + ["--from", "megatron", str(root / "torch_dist"), "--to", str(tmp_path / "t"), "--tp", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(run + ["--from", str(tmp_path / "t"), "--to", "megatron", str(tmp_path / "m"), "--format",
                              "legacy", "--tp", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = run_distributed(R.load_and_run, 2, 1, spec, str(tmp_path / "m"), "legacy", _tokens(spec), timeout_s=180)
    torch.testing.assert_close(out[0]["logits"], ref, **TOL)
