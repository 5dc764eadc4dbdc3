"""Megatron-LM mixture-of-experts checkpoints in and out, against megatron-core itself (tests/megatron_moe_reference.py).

Two megatron-core MoE runs (E 4, top-2, routers sharpened so that no top-k is a near tie), random weights, saved
in Megatron-LM's legacy per-rank layout by megatron-core's own state dicts: a Llama-style one (RMSNorm, SwiGLU
experts, grouped-query attention, rope, a gated shared expert, its second layer dense by ``moe_layer_freq``) at
TP 1 x EP 2 (``mp_rank_00_000`` and ``mp_rank_00_001``, two experts each), and a GPT-style one (LayerNorm, GELU
experts, learned positions, softmax before the top-k) at TP 2 x EP 1. Each in both expert layouts: ``SequentialMLP``
(``local_experts.<j>``) and the legacy ``GroupedMLP`` (``weight1`` / ``weight2``, filled by megatron-core from the
first's ``torch_dist`` save). The converted tnlg checkpoints give megatron-core's logits at tnlg TP 1 and 2; tnlg's
exports at another TP x EP load strictly into megatron-core's GPTModel with the same logits. Bad input: each MoE
option tnlg does not compute, a missing EP rank's file, a ``torch_dist`` MoE, and exports it cannot write, refused
in one paragraph naming the value.
"""

import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.needs_package("megatron.core")  # the reference: megatron-core itself

from tnlg.errors import UserError  # noqa: E402
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint  # noqa: E402
from .megatron_pool import run_distributed  # noqa: E402

from . import megatron_moe_reference as M  # noqa: E402
from .test_megatron_checkpoint import _logits_at, _tokens  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)
LLAMA = dict(groups=2, rotary_base=10000.0, rotary_percent=1.0, eps=1e-6, qkv_bias=False)
BASE = dict(layers=2, hidden=32, heads=4, ffn=64, seq=8, vocab=100, divisible=8, pp=1, openai_gelu=False)
SPECS = {
    "llama-ep2": dict(BASE, untie=True, llama=LLAMA, tp=1, ep=2,
                      moe=dict(experts=4, topk=2, ffn=48, shared=40, gate=True, freq=[1, 0])),
    "gpt-tp2": dict(BASE, untie=False, tp=2, ep=1, moe=dict(experts=4, topk=2, ffn=48, pre_softmax=True)),
}
LAYOUTS = ("sequential", "grouped")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per run: ``(spec, root, megatron-core's logits, {layout: the tnlg checkpoint converted from it})``."""
    out = {}
    for name, spec in SPECS.items():
        root = tmp_path_factory.mktemp(f"megatron_{name}")
        ranks = run_distributed(M.save_reference, spec["tp"] * spec["ep"], 1, spec, str(root), _tokens(spec),
                                timeout_s=300)
        moe_layers = sum(spec["moe"].get("freq", [1] * spec["layers"]))
        assert [r["grouped_tensors"] for r in ranks] == [2 * moe_layers] * len(ranks)  # weight1, weight2 per MoE layer
        converted = {lay: megatron_to_checkpoint(str(root / lay), str(root / f"tnlg_{lay}")) for lay in LAYOUTS}
        out[name] = spec, root, ranks[0]["logits"], converted
    return out


def test_the_legacy_files_are_megatrons_expert_parallel_layout(runs):
    _, root, _, _ = runs["llama-ep2"]
    it = root / "sequential" / "iter_0000007"
    assert sorted(os.listdir(it)) == ["mp_rank_00_000", "mp_rank_00_001"]
    model = torch.load(it / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in model
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in model  # two local experts
    grouped = torch.load(root / "grouped" / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt",
                         weights_only=False)["model"]
    assert tuple(grouped["decoder.layers.0.mlp.experts.weight1"].shape) == (32, 2 * 2 * 48)


def test_import_gives_megatron_cores_logits(runs):
    for name, (spec, _, ref, converted) in runs.items():
        logits = _logits_at([converted[lay] for lay in LAYOUTS], spec, (1, 2))
        for tp, per_layout in logits.items():
            for lay, got in zip(LAYOUTS, per_layout):
                torch.testing.assert_close(got, ref, **TOL, msg=lambda m, k=(name, lay, tp): f"{k}: {m}")


def test_import_reads_the_experts_config(runs):
    from tnlg.generation.loading import load_for_inference
    model, _ = load_for_inference(runs["llama-ep2"][3]["grouped"])
    cfg = model.config
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.moe_shared_expert_intermediate_size,
            cfg.moe_shared_expert_gate, cfg.moe_layer_freq, cfg.moe_aux_loss_coeff) == (4, 2, 48, 40, True, [1, 0], 0.01)
    gpt = load_for_inference(runs["gpt-tp2"][3]["sequential"])[0].config
    assert (gpt.moe_router_pre_softmax, gpt.normalization, gpt.swiglu, gpt.moe_layer_freq) == (True, "LayerNorm", False,
                                                                                              None)


# (run, Megatron TP, EP of the export): each at another layout than the one it was saved at
EXPORTS = [("llama-ep2", 2, 1), ("gpt-tp2", 1, 2)]


def _megatron_loads(_ps, loads):
    from megatron.core import parallel_state
    out = []
    for load in loads:
        out.append(M.load_and_run(_ps, *load))
        parallel_state.destroy_model_parallel()
    return out


def test_export_loads_into_megatron_core_with_the_same_logits(runs, tmp_path):
    from tnlg.cli import main
    loads = []
    for name, tp, ep in EXPORTS:
        spec, _, _, converted = runs[name]
        dst = tmp_path / f"{name}_tp{tp}_ep{ep}"
        if ep == 1:
            checkpoint_to_megatron(converted["grouped"], str(dst), fmt="legacy", tp=tp, ep=ep)
        else:  # the command line
            assert main(["convert", "--from", converted["grouped"], "--to", "megatron", str(dst), "--format", "legacy",
                         "--tp", str(tp), "--ep", str(ep)]) == 0
        want = ["mp_rank_%02d" % t + ("_%03d" % e if ep > 1 else "") for t in range(tp) for e in range(ep)]
        assert sorted(os.listdir(dst / "iter_0000007")) == sorted(want)
        loads.append((dict(spec, tp=tp, ep=ep), str(dst), _tokens(spec)))
    results = run_distributed(_megatron_loads, 2, 1, loads, timeout_s=300)[0]
    for (name, tp, ep), got in zip(EXPORTS, results):
        torch.testing.assert_close(got["logits"], runs[name][2], **TOL, msg=lambda m, k=(name, tp, ep): f"{k}: {m}")
        moe = SPECS[name]["moe"]
        assert got["args"]["num_experts"] == 4 and got["args"]["expert_model_parallel_size"] == ep
        assert got["args"]["moe_layer_freq"] == moe.get("freq", 1)
        assert got["args"]["moe_router_pre_softmax"] == moe.get("pre_softmax", False)


# ------------------------------------------------------------------------------------------- bad input

def _with_args(runs, tmp_path, **changes):
    """A copy of the Llama run's SequentialMLP files with the saved args changed in every rank's file."""
    src = tmp_path / "src"
    shutil.copytree(runs["llama-ep2"][1] / "sequential", src)
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        path = src / "iter_0000007" / rank / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        for k, v in changes.items():
            setattr(state["args"], k, v)
        torch.save(state, path)
    return src


@pytest.mark.parametrize("changes,words", [
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
     "moe_router_enable_expert_bias=True: its routers' expert_bias picks each token's experts"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups=2, group-limited routing"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps=0.01, multiplicative noise"),
    (dict(moe_router_dtype="fp32"), "moe_router_dtype='fp32', a router computed in another precision"),
    (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size=2 with tensor_model_parallel_size=1"),
    (dict(num_moe_experts=8), "num_moe_experts=8 .* but num_experts=4"),
], ids=lambda v: str(v)[:40])
def test_an_moe_option_tnlg_does_not_compute_is_refused_by_name(runs, tmp_path, changes, words):
    src = _with_args(runs, tmp_path, **changes)
    with pytest.raises(UserError, match=words) as info:
        megatron_to_checkpoint(str(src), str(tmp_path / "out"))
    assert "Nothing was written" in str(info.value) and "\n" not in str(info.value)
    assert not os.path.exists(tmp_path / "out")


def test_a_missing_expert_parallel_rank_and_the_optimizer_are_refused(runs, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(runs["llama-ep2"][1] / "sequential", src)
    with pytest.raises(UserError, match="--with-optimizer: .* mixture of experts, whose Adam state"):
        megatron_to_checkpoint(str(src), str(tmp_path / "out"), with_optimizer=True)
    shutil.rmtree(src / "iter_0000007" / "mp_rank_00_001")
    with pytest.raises(UserError, match=r"TP=1 x PP=1 x EP=2 \(its args\) but .*mp_rank_00_001/model_optim_rng.pt' is missing"):
        megatron_to_checkpoint(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_exports_tnlg_cannot_write_are_refused(runs, tmp_path):
    ckpt = runs["llama-ep2"][3]["sequential"]
    with pytest.raises(UserError, match="legacy per-rank format only"):
        checkpoint_to_megatron(ckpt, str(tmp_path / "a"), fmt="torch_dist")
    with pytest.raises(UserError, match=r"--ep 3: .* 4 experts evenly .* valid sizes: \[1, 2, 4\]"):
        checkpoint_to_megatron(ckpt, str(tmp_path / "b"), fmt="legacy", ep=3)
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
