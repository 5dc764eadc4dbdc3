"""Megatron-LM mixture-of-experts checkpoints in and out, against megatron-core itself (tests/megatron_moe_reference.py).

Two megatron-core MoE runs (E 4, top-2, routers sharpened so that no top-k is a near tie), random weights, saved
in Megatron-LM's legacy per-rank layout by megatron-core's own state dicts: a Llama-style one (RMSNorm, SwiGLU
experts, grouped-query attention, rope, a gated shared expert, its second layer dense by ``moe_layer_freq``) at
TP 1 x EP 2 (``mp_rank_00_000`` and ``mp_rank_00_001``, two experts each), and a GPT-style one (LayerNorm, GELU
experts, learned positions, softmax before the top-k) at TP 2 x EP 1. Each in both legacy expert layouts:
``SequentialMLP`` (``local_experts.<j>``) and the legacy ``GroupedMLP`` (``weight1`` / ``weight2``, filled by
megatron-core from the first's ``torch_dist`` save), and in megatron-core's own ``torch_dist`` save (``dist_checkpointing``:
the experts stacked, per layer for the Llama run's mix of dense and MoE layers; and with its ``singleton_local_shards``
metadata, one key per expert). The converted tnlg checkpoints
give megatron-core's logits at tnlg TP 1 and 2; tnlg's exports at another TP x EP, legacy (both expert layouts) and
``torch_dist``, load into megatron-core's GPTModel (``load_state_dict`` strict, ``dist_checkpointing.load``) with the
same logits; a ``GroupedMLP`` export, which megatron-core cannot run on the CPU, is loaded strictly into its
``GroupedMLP`` model and converted by megatron-core to the ``SequentialMLP`` model that runs, and at the saved
layout its tensors are megatron-core's own. Bad input: each MoE option tnlg does not compute, a missing EP rank's
file, and exports it cannot write, refused in one paragraph naming the value.
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
LAYOUTS = ("sequential", "grouped", "torch_dist", "torch_dist_singleton")


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


# (run, Megatron TP, EP of the export, its format, GroupedMLP weights): each at another layout than the one it was
# saved at
EXPORTS = [("llama-ep2", 2, 1, "legacy", False), ("gpt-tp2", 1, 2, "legacy", False),
           ("llama-ep2", 2, 1, "torch_dist", False), ("gpt-tp2", 1, 2, "torch_dist", False),
           ("llama-ep2", 2, 1, "legacy", True), ("gpt-tp2", 1, 2, "legacy", True)]


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
    for name, tp, ep, fmt, grouped in EXPORTS:
        spec, _, _, converted = runs[name]
        src = converted["torch_dist" if fmt == "torch_dist" else "grouped"]
        dst = tmp_path / f"{name}_tp{tp}_ep{ep}_{fmt}{'_grouped' if grouped else ''}"
        if ep == 1:
            checkpoint_to_megatron(src, str(dst), fmt=fmt, tp=tp, ep=ep, grouped_gemm=grouped)
        else:  # the command line
            assert main(["convert", "--from", src, "--to", "megatron", str(dst), "--format", fmt, "--tp", str(tp),
                         "--ep", str(ep)] + (["--moe-grouped-gemm"] if grouped else [])) == 0
        want = ["mp_rank_%02d" % t + ("_%03d" % e if ep > 1 else "") for t in range(tp) for e in range(ep)]
        if fmt == "torch_dist":  # one store for every TP x EP
            want = [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
        assert sorted(os.listdir(dst / "iter_0000007")) == sorted(want)
        loads.append((dict(spec, tp=tp, ep=ep), str(dst), _tokens(spec), fmt, grouped))
    results = run_distributed(_megatron_loads, 2, 1, loads, timeout_s=300)[0]
    for (name, tp, ep, fmt, grouped), got in zip(EXPORTS, results):
        where = (name, tp, ep, fmt, grouped)
        torch.testing.assert_close(got["logits"], runs[name][2], **TOL, msg=lambda m, k=where: f"{k}: {m}")
        moe = SPECS[name]["moe"]
        assert got["args"]["num_experts"] == 4 and got["args"]["expert_model_parallel_size"] == ep, where
        assert got["args"]["moe_layer_freq"] == moe.get("freq", 1), where
        assert got["args"]["moe_router_pre_softmax"] == moe.get("pre_softmax", False), where
        assert got["args"]["moe_grouped_gemm"] is grouped and got["args"]["moe_use_legacy_grouped_gemm"] is grouped


def test_a_grouped_gemm_export_holds_megatron_cores_own_grouped_tensors(runs, tmp_path):
    """At the layout megatron-core saved its GroupedMLP model (TP 1 x EP 2), the export's rank files hold the same
    tensors under the same names as megatron-core's own (each rank's experts.weight1 / weight2 included)."""
    spec, root, _, converted = runs["llama-ep2"]
    dst = tmp_path / "grouped"
    checkpoint_to_megatron(converted["sequential"], str(dst), fmt="legacy", tp=1, ep=2, grouped_gemm=True)
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        ours = torch.load(dst / "iter_0000007" / rank / "model_optim_rng.pt", weights_only=False)["model"]
        theirs = torch.load(root / "grouped" / "iter_0000007" / rank / "model_optim_rng.pt", weights_only=False)["model"]
        assert sorted(ours) == sorted(theirs)
        assert "decoder.layers.0.mlp.experts.weight2" in ours
        for key, value in theirs.items():
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):  # Megatron's padding rows
                assert not ours[key][spec["vocab"]:].any()  # tnlg's: zeros; megatron-core's random
                ours[key], value = ours[key][:spec["vocab"]], value[:spec["vocab"]]
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(ours[key], value, atol=0, rtol=0, msg=lambda m, k=(rank, key): f"{k}: {m}")
            else:
                assert ours[key] is None and value is None, key


def test_a_torch_dist_export_has_megatron_cores_own_index(runs, tmp_path):
    """The exported store's keys and global shapes are those of megatron-core's own save of the model (the Llama run's
    per layer, the GPT run's stacked over the layers), its objects (``_extra_state``) included."""
    from tnlg.interop.megatron.safe_load import load_dcp_metadata
    experts = {"llama-ep2": ("decoder.layers.0.mlp.experts.experts.linear_fc1.weight", (4, 96, 32)),
               "gpt-tp2": ("decoder.layers.mlp.experts.experts.linear_fc2.weight", (2, 4, 32, 48))}
    for name, (spec, root, _, converted) in runs.items():
        dst = tmp_path / name
        checkpoint_to_megatron(converted["torch_dist"], str(dst), fmt="torch_dist", tp=spec["tp"], ep=spec["ep"])
        index = {}
        for which in ("theirs", "ours"):
            folder = root / "torch_dist" if which == "theirs" else dst
            meta = load_dcp_metadata(str(folder / "iter_0000007" / ".metadata")).state_dict_metadata
            index[which] = {k: tuple(getattr(md, "size", ())) for k, md in meta.items()}
        assert index["ours"] == index["theirs"], name
        key, shape = experts[name]
        assert index["ours"][key] == shape


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
    for which in (src, runs["llama-ep2"][1] / "torch_dist"):
        with pytest.raises(UserError, match="--with-optimizer: .* mixture of experts, whose Adam state"):
            megatron_to_checkpoint(str(which), str(tmp_path / "out"), with_optimizer=True)
    shutil.rmtree(src / "iter_0000007" / "mp_rank_00_001")
    with pytest.raises(UserError, match=r"TP=1 x PP=1 x EP=2 \(its args\) but .*mp_rank_00_001/model_optim_rng.pt' is missing"):
        megatron_to_checkpoint(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_exports_tnlg_cannot_write_are_refused(runs, tmp_path, capsys):
    from tnlg.cli import main
    assert main(["convert", "--from", runs["llama-ep2"][3]["sequential"], "--to", str(tmp_path / "c"),
                 "--moe-grouped-gemm"]) == 2
    assert "--moe-grouped-gemm applies to --to megatron only" in capsys.readouterr().err
    ckpt = runs["llama-ep2"][3]["sequential"]
    with pytest.raises(UserError, match="--moe-grouped-gemm with --format torch_dist: .*GroupedMLP alike.*--format legacy"):
        checkpoint_to_megatron(ckpt, str(tmp_path / "a"), fmt="torch_dist", grouped_gemm=True)
    with pytest.raises(UserError, match=r"--ep 3: .* 4 experts evenly .* valid sizes: \[1, 2, 4\]"):
        checkpoint_to_megatron(ckpt, str(tmp_path / "b"), fmt="legacy", ep=3)
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
