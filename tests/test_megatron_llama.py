"""Llama-family Megatron-LM checkpoints in and out, against megatron-core itself (tests/megatron_reference.py).

megatron-core's GPTModel (local spec) with rope (base 500000; half of each head rotated in the Llama
run), RMSNorm, SwiGLU, grouped-query attention (4 heads, 2 KV groups), no linear biases and an untied
output layer, at Megatron TP 2, and with Qwen2's QKV biases at Megatron TP 1, random weights, saved by Megatron's own code in both
formats. The converted tnlg checkpoints must give Megatron's logits at tnlg TP 1, 2 and 4 (TP 4 shares
each KV group between two ranks, which Megatron cannot run); a Transformer Engine spec's names import
alike; the checkpoint exported back to Megatron (torch_dist and legacy, TP 1 and 2) must load into
GPTModel and give the same logits, with the args a Megatron run of those flags saves. Bad input: a
Megatron export at a TP that does not divide the groups, the Adam state of such a checkpoint, and an
architecture still unsupported (experts).
"""

import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.needs_package("megatron.core")  # the reference: megatron-core itself

from tnlg.errors import UserError  # noqa: E402
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint  # noqa: E402
from tnlg.runtime.spawn import run_distributed  # noqa: E402

from . import megatron_reference as R  # noqa: E402
from .test_megatron_checkpoint import _logits_at, _megatron_loads, _rewrite_legacy, _to_transformer_engine  # noqa: E402

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
    from tnlg.checkpoint.loading import load_for_inference
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


def test_adam_state_of_a_llama_checkpoint_is_refused(runs, tmp_path):
    with pytest.raises(UserError, match="--with-optimizer.*--swiglu.*without --with-optimizer"):
        megatron_to_checkpoint(str(runs["tp2"][1] / "torch_dist"), str(tmp_path / "out"), with_optimizer=True)
    assert not os.path.exists(tmp_path / "out")


def test_mixture_of_experts_is_refused(runs, tmp_path):
    src = tmp_path / "moe"
    shutil.copytree(runs["tp2"][1] / "torch_dist", src)
    common = src / "iter_0000007" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].num_experts = 4
    torch.save(state, common)
    with pytest.raises(UserError, match="num_experts=4, a mixture of experts, which tnlg does not model"):
        megatron_to_checkpoint(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
