"""Llama-family Megatron-LM checkpoints in and out, against megatron-core itself (tests/megatron_reference.py).

megatron-core's GPTModel (local spec) with rope (base 500000; half of each head rotated in the Llama
run), RMSNorm, SwiGLU, grouped-query attention (4 heads, 2 KV groups), no linear biases and an untied
output layer, at Megatron TP 2, and with Qwen2's QKV biases at Megatron TP 1, random weights, saved by Megatron's own code in both
formats. The converted tnlg checkpoints must give Megatron's logits at tnlg TP 1, 2 and 4 (TP 4 shares
each KV group between two ranks, which Megatron cannot run); a Transformer Engine spec's names import
alike; the checkpoint exported back to Megatron (torch_dist and legacy, TP 1 and 2) must load into
GPTModel and give the same logits, with the args a Megatron run of those flags saves. The Adam state
(``--with-optimizer``): the Llama run trained by megatron-core's two optimizers at TP 2 and saved in
every layout tnlg reads imports Megatron's moments bit for bit, and a tnlg step from it is Megatron's
next step. Bad input: a Megatron export at a TP that does not divide the groups, ``--with-optimizer``
on a checkpoint without Adam state, and a mixture of experts in torch_dist (not read yet).
"""

import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.needs_package("megatron.core")  # the reference: megatron-core itself

from tnlg.errors import UserError  # noqa: E402
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint  # noqa: E402
from .megatron_pool import run_distributed  # noqa: E402

from . import megatron_reference as R  # noqa: E402
from .test_megatron_checkpoint import _logits_at, _megatron_loads, _rewrite_legacy, _to_transformer_engine  # noqa: E402
from .test_megatron_optimizer import SAVES, STEPS, _imported, _tnlg_step  # noqa: E402

LLAMA = dict(groups=2, rotary_base=500000.0, rotary_percent=0.5, eps=1e-6, qkv_bias=False)
SPEC = dict(layers=2, hidden=32, heads=4, ffn=48, seq=16, vocab=100, divisible=8, pp=1, openai_gelu=False,
            untie=True, llama=LLAMA)
QWEN = dict(SPEC, llama=dict(LLAMA, qkv_bias=True, rotary_percent=1.0))  # Qwen2's biases on Q, K and V alone
TOL = dict(atol=1e-5, rtol=1e-5)
TNLG_TPS = (1, 2, 4)


def _tokens(spec):
    return torch.randint(0, spec["vocab"], (2, spec["seq"]), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Megatron's reference runs (Llama at Megatron TP 2, Qwen2 at TP 1), each saved by its own code in
    both formats (the Llama run also with ``singleton_local_shards``: SwiGLU's fc1 as ``_w``/``_v`` keys) and converted to tnlg: per name, ``(spec, root, logits, {fmt: tnlg checkpoint})``."""
    out = {}
    for name, spec in (("tp2", dict(SPEC, tp=2, singleton_shards=True)), ("qwen-tp1", dict(QWEN, tp=1))):
        root = tmp_path_factory.mktemp(f"megatron_{name}")
        ref = run_distributed(R.save_reference, spec["tp"], 1, spec, str(root), _tokens(spec), timeout_s=240)[0]
        fmts = ("legacy", "torch_dist") + (("torch_dist_singleton",) if spec.get("singleton_shards") else ())
        converted = {fmt: megatron_to_checkpoint(str(root / fmt), str(root / f"tnlg_{fmt}")) for fmt in fmts}
        out[name] = spec, root, ref, converted
    return out


@pytest.fixture(scope="module")
def imported(runs, tmp_path_factory):
    """tnlg's logits of every converted checkpoint (and of the TP 2 legacy files under the Transformer
    Engine spec's names) at each of TNLG_TPS, on one group of processes: per (run, format), per TP."""
    tmp = tmp_path_factory.mktemp("te_names")
    _rewrite_legacy(runs["tp2"][1] / "legacy", tmp / "megatron", _to_transformer_engine)
    keys, ckpts = [], []
    for name, (_, _, _, converted) in runs.items():
        for fmt, path in converted.items():
            keys.append((name, fmt))
            ckpts.append(path)
    keys.append(("tp2", "transformer-engine"))
    ckpts.append(megatron_to_checkpoint(str(tmp / "megatron"), str(tmp / "tnlg")))
    from tnlg.cli import main  # the command line, in this process: the Qwen2 legacy files to tnlg TP 2 files
    assert main(["convert", "--from", "megatron", str(runs["qwen-tp1"][1] / "legacy"), "--to", str(tmp / "cli"),
                 "--tp", "2"]) == 0
    keys.append(("qwen-tp1", "tnlg convert --tp 2"))
    ckpts.append(str(tmp / "cli"))
    logits = _logits_at(ckpts, SPEC, TNLG_TPS)
    return {key: {tp: logits[tp][i] for tp in TNLG_TPS} for i, key in enumerate(keys)}


def test_import_gives_megatrons_logits(runs, imported):
    for (name, fmt), per_tp in imported.items():
        for tp, logits in per_tp.items():
            torch.testing.assert_close(logits, runs[name][2], **TOL,
                                       msg=lambda m, k=(name, fmt, tp): f"Megatron {k[0]}, {k[1]}, tnlg TP {k[2]}: {m}")


def test_import_reads_the_llama_config(runs):
    from tnlg.generation.loading import load_for_inference
    model, _ = load_for_inference(runs["qwen-tp1"][3]["torch_dist"])
    cfg = model.config
    assert (cfg.position_embedding_type, cfg.rotary_base, cfg.rotary_percent, cfg.normalization, cfg.layernorm_epsilon,
            cfg.swiglu, cfg.num_query_groups, cfg.add_bias_linear, cfg.add_qkv_bias,
            cfg.untie_embeddings_and_output_weights, cfg.ffn_hidden_size) == (
        "rope", 500000.0, 1.0, "RMSNorm", 1e-6, True, 2, False, True, True, SPEC["ffn"])


# (run, format, Megatron TP): each run's checkpoint to the other TP in torch_dist, to its own in legacy
EXPORTS = [("tp2", "torch_dist", 1), ("tp2", "legacy", 2), ("qwen-tp1", "torch_dist", 2), ("qwen-tp1", "legacy", 1)]
_ARGS = ("position_embedding_type", "rotary_base", "rotary_percent", "normalization", "norm_epsilon", "swiglu",
         "group_query_attention", "num_query_groups", "add_bias_linear", "add_qkv_bias",
         "untie_embeddings_and_output_weights", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings")


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """The converted checkpoints exported to Megatron at each of EXPORTS (from the other format's import),
    each loaded by megatron-core (one group of 2 processes): per export, rank 0's result and the saved args."""
    loads, saved = [], []
    for name, fmt, tp in EXPORTS:
        spec, _, _, converted = runs[name]
        dst = tmp_path_factory.mktemp(f"export_{name}_{fmt}_tp{tp}")
        it_dir = checkpoint_to_megatron(converted["torch_dist" if fmt == "legacy" else "legacy"], str(dst), fmt=fmt,
                                        tp=tp)
        common = os.path.join(it_dir, "common.pt" if fmt == "torch_dist" else "mp_rank_00/model_optim_rng.pt")
        saved.append(vars(torch.load(common, weights_only=False)["args"]))
        loads.append((dict(spec, tp=tp), str(dst), fmt, _tokens(spec)))
    keys = EXPORTS
    results = run_distributed(_megatron_loads, 2, 1, loads, timeout_s=300)[0]
    return {k: (r, a) for k, r, a in zip(keys, results, saved)}


def test_export_loads_into_megatron_with_the_same_logits(runs, exported):
    for (name, fmt, tp), (out, args) in exported.items():
        spec = dict(runs[name][0], tp=tp)
        torch.testing.assert_close(out["logits"], runs[name][2], **TOL, msg=lambda m, k=(name, fmt, tp): f"{k}: {m}")
        want = vars(R.megatron_args(spec))  # the args a Megatron run of these flags saves
        assert {k: args[k] for k in _ARGS} == {k: want[k] for k in _ARGS}, (name, fmt, tp)
        assert args["padded_vocab_size"] == R.padded(spec)


def test_export_at_a_tp_megatron_cannot_split_the_groups(runs, tmp_path, capsys):
    from tnlg.cli import main
    with pytest.raises(UserError, match=r"num_query_groups \(2\).*valid TP sizes.*\[1, 2\]"):
        checkpoint_to_megatron(runs["tp2"][3]["torch_dist"], str(tmp_path / "out"), tp=4)
    assert main(["convert", "--from", runs["tp2"][3]["torch_dist"], "--to", "megatron", str(tmp_path / "out"),
                 "--tp", "4"]) == 2
    assert "valid TP sizes for a Megatron export of this model: [1, 2]" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


# --------------------------------------------------------------------------- the Adam state (--with-optimizer)

# the Llama run trained by megatron-core's Adam at Megatron TP 2: a vocabulary Megatron does not pad at TP 2
# (112 = 7 x 8 x 2; its padding rows would take part in its softmax and the steps would differ)
ADAM_SPEC = dict(SPEC, tp=2, vocab=112)


def _adam_tokens():
    return torch.randint(0, ADAM_SPEC["vocab"], (2, ADAM_SPEC["seq"]), generator=torch.Generator().manual_seed(0))


def _tnlg_steps(ps, paths: list, lr: float, tokens: torch.Tensor) -> list:
    """Worker (1 process): tnlg's step from each imported checkpoint (:func:`_tnlg_step`), one after the other."""
    return [_tnlg_step(ps, path, lr, tokens) for path in paths]


@pytest.fixture(scope="module")
def adam(tmp_path_factory):
    """megatron-core's Llama-spec GPTModel (4 heads, 2 KV groups, SwiGLU, RMSNorm, rope, no biases, untied)
    at Megatron TP 2 trained two Adam steps by each optimizer and saved in each layout (the
    non-distributed optimizer in torch_dist and the legacy files; the distributed one in fully_reshardable,
    dp_reshardable and distrib_optim.pt), then one step more; each save imported at tnlg TP 2 with its
    optimizer, and tnlg's step from each import (one process for all). Returns Megatron's per-rank
    results, the imports and tnlg's steps by save."""
    root = tmp_path_factory.mktemp("megatron_llama_adam")
    ref = run_distributed(R.train_and_save, 2, 1, ADAM_SPEC, str(root), _adam_tokens(), STEPS, timeout_s=600)
    converted = {k: megatron_to_checkpoint(str(root / k), str(root / f"tnlg_{k}"), tp_size=2, with_optimizer=True)
                 for k, _ in SAVES}
    steps = run_distributed(_tnlg_steps, 1, 1, [converted[k] for k, _ in SAVES], ref[0]["distributed"]["lr"],
                            _adam_tokens(), timeout_s=600)[0]
    return ref, converted, dict(zip((k for k, _ in SAVES), steps))


def _from_megatron(ranks: list) -> dict:
    """tnlg name -> the tensor in tnlg's layout, from Megatron's TP ranks' tensors by local-spec name
    (``ranks[t][name]``), laid out here from megatron-core's own layouts: ``linear_qkv`` rows are per KV
    group ``[its q query heads; its key; its value]`` (tnlg: the queries ``c_q [H hn, h]``, the keys and
    values ``c_kv [G, 2, hn, h]``); a rank's SwiGLU ``linear_fc1`` is ``[gate_r; up_r]`` (tnlg: ``c_fc
    [2, f, h]``, all gates then all ups); the vocabulary is split by rows, row-parallel layers by columns."""
    heads, groups, hn = ADAM_SPEC["heads"], LLAMA["groups"], ADAM_SPEC["hidden"] // ADAM_SPEC["heads"]
    cat = lambda name, dim: torch.cat([r[name] for r in ranks], dim=dim)  # noqa: E731
    out = {"transformer.wte.weight": cat("embedding.word_embeddings.weight", 0),
           "lm_head.weight": cat("output_layer.weight", 0),
           "transformer.ln_f.weight": ranks[0]["decoder.final_layernorm.weight"]}
    for i in range(ADAM_SPEC["layers"]):
        meg, ours = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv = cat(meg + "self_attention.linear_qkv.weight", 0).reshape(groups, heads // groups + 2, hn, -1)
        fc1 = [r[meg + "mlp.linear_fc1.weight"].reshape(2, -1, ADAM_SPEC["hidden"]) for r in ranks]
        out.update({ours + "ln_1.weight": ranks[0][meg + "input_layernorm.weight"],
                    ours + "attn.c_q.weight": qkv[:, :-2].reshape(heads * hn, -1),
                    ours + "attn.c_kv.weight": qkv[:, -2:],
                    ours + "attn.c_proj.weight": cat(meg + "self_attention.linear_proj.weight", 1),
                    ours + "ln_2.weight": ranks[0][meg + "pre_mlp_layernorm.weight"],
                    ours + "mlp.c_fc.weight": torch.cat(fc1, dim=1),
                    ours + "mlp.c_proj.weight": cat(meg + "mlp.linear_fc2.weight", 1)})
    return out


@pytest.mark.parametrize("save,kind", SAVES)
def test_the_adam_state_of_a_llama_checkpoint_is_megatrons_parameter_by_parameter(adam, save, kind):
    """Every layout's import holds, for every parameter, the moments of Megatron's optimizer object (in
    tnlg's layout: grouped QKV and SwiGLU's fc1 rearranged as the weights are), bit for bit, and Adam's step."""
    ref, converted, _ = adam
    meta, (_, states) = _imported(converted[save])
    assert meta["optimizer"]["present"] and meta["optimizer"]["num_steps"] == STEPS
    assert meta["schedule"]["num_steps"] == STEPS
    for k in ("exp_avg", "exp_avg_sq"):
        want = _from_megatron([{n: m[k] for n, m in r[kind]["moments"].items()} for r in ref])
        assert set(states) == set(want)
        for name, t in want.items():
            assert states[name][k].dtype == torch.float32 and torch.equal(states[name][k], t), (save, name, k)
    assert all("master" not in st for st in states.values())  # an fp32 run: its master is its weights


@pytest.mark.parametrize("save,kind", SAVES)
def test_a_tnlg_step_from_a_llama_import_is_megatrons_next_step(adam, save, kind):
    ref, _, steps = adam
    assert ref[0][kind]["lr"] == ref[0]["distributed"]["lr"]  # both optimizers' schedules at the same point
    before, after, params = steps[save]
    assert (before, after) == (STEPS, STEPS + 1)
    want = _from_megatron([r[kind]["params"] for r in ref])
    assert set(params) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(params[name], t, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{save}, {n}: {m}")


def test_a_llama_checkpoint_without_adam_state_is_refused_with_optimizer(runs, tmp_path):
    with pytest.raises(UserError, match="holds no optimizer state .* Convert without --with-optimizer"):
        megatron_to_checkpoint(str(runs["tp2"][1] / "torch_dist"), str(tmp_path / "out"), with_optimizer=True)
    assert not os.path.exists(tmp_path / "out")


def test_a_torch_dist_store_whose_args_say_experts_but_hold_none_is_refused(runs, tmp_path):
    """A torch_dist mixture of experts is read (tests/test_megatron_moe.py); args that say experts over a dense
    model's tensors name the first missing expert tensor."""
    src = tmp_path / "moe"
    shutil.copytree(runs["tp2"][1] / "torch_dist", src)
    common = src / "iter_0000007" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].num_experts = 4
    torch.save(state, common)
    with pytest.raises(UserError, match=r"has no tensor for mlp.router.weight of layer 0; it does not match its args "
                                        r"\(torch_dist format"):
        megatron_to_checkpoint(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
