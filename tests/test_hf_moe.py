"""Hugging Face mixtures of experts in and out: tiny random Mixtral, Qwen2-MoE (a sigmoid-gated shared expert,
the k weights not renormalised, a dense layer among the MoE ones), Qwen3-MoE (QK norm, norm_topk_prob) and OLMoE
(QK norm over every head at once, the k weights not renormalised) folders written by transformers' ``save_pretrained`` (its published per-expert names) and its in-memory models
(fused 3-D experts) give transformers' logits through ``from_hf`` at TP 1 and 2, through ``tnlg convert --from
hf`` and a checkpoint at TP 2, and back out (``to_hf``, then transformers' class of the same model_type)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from .pool import run_distributed

transformers = pytest.importorskip("transformers")
VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0)


def random_moe(kind: str):
    """A random fp32 model of ``kind``; routers sharpened (x 20) so that no top-k choice is a near tie, norms
    away from ones so that a swapped one would show."""
    torch.manual_seed({"mixtral": 0, "qwen2_moe": 1, "qwen3_moe": 2, "olmoe": 3}[kind])
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1],
                                          use_sliding_window=False, **COMMON)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          norm_topk_prob=True, **COMMON)
    else:
        cfg = transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn_like(p) * 0.02 * 20)
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def _tokens():
    return torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for kind in KINDS:
        model, folder = random_moe(kind), tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        with torch.no_grad():
            out[kind] = (str(folder), model(_tokens()).logits, model)
    return out


def test_the_saved_folders_hold_the_published_per_expert_names(folders):
    from safetensors import safe_open
    names = {}
    for kind, (folder, _, _) in folders.items():
        with safe_open(f"{folder}/model.safetensors", "pt") as f:
            names[kind] = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names["mixtral"]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names["qwen3_moe"]
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names["qwen2_moe"]
    assert "model.layers.1.mlp.gate_proj.weight" in names["qwen2_moe"]  # (the dense layer)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names["olmoe"]
    with safe_open(f"{folders['olmoe'][0]}/model.safetensors", "pt") as f:  # (the norms over the whole projections)
        assert [f.get_slice(f"model.layers.0.self_attn.{x}_norm.weight").get_shape() for x in "qk"] == [[32], [16]]


def _logits(ps, paths: dict, tokens: torch.Tensor) -> dict:
    from tnlg.interop.hf import from_hf
    from tnlg.parallel.vocab import gather_logits
    out = {}
    for kind, folder in paths.items():
        model = from_hf(folder, ps).eval()
        with torch.no_grad():
            out[kind] = gather_logits(model(tokens), ps, VOCAB)
    return out


def test_moe_folders_give_transformers_logits_at_tp_1_2_and_4(folders):
    paths = {kind: folder for kind, (folder, _, _) in folders.items()}
    for tp in (1, 2, 4):
        got = run_distributed(_logits, tp, tp, paths, _tokens())[0]
        for kind, (_, ref, _) in folders.items():
            torch.testing.assert_close(got[kind], ref, rtol=1e-5, atol=1e-5, msg=lambda m, k=(kind, tp): f"{k}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_the_in_memory_model_converts_to_a_checkpoint_and_back_out(folders, tmp_path, kind):
    from tnlg.generation.loading import load_for_inference
    from tnlg.interop.hf import from_hf, to_hf
    from tnlg.interop.hf_checkpoint import checkpoint_to_hf, hf_to_checkpoint
    from tnlg.parallel.state import ParallelState
    folder, ref, hf = folders[kind]
    with torch.no_grad():  # the fused 3-D experts of the in-memory model
        torch.testing.assert_close(from_hf(hf).eval()(_tokens())[..., :VOCAB], ref, rtol=1e-5, atol=1e-5)
    hf_to_checkpoint(folder, str(tmp_path / "ck"), tp_size=2)
    model, _ = load_for_inference(str(tmp_path / "ck"), ParallelState.single())
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens())[..., :VOCAB], ref, rtol=1e-5, atol=1e-5)
    checkpoint_to_hf(str(tmp_path / "ck"), str(tmp_path / "out"), with_tokenizer=False)
    to_hf(from_hf(folder), str(tmp_path / "out2"))
    if kind == "olmoe":  # (every honoured field written back as it was read)
        from tnlg.interop.families import FAMILIES
        before, after = (json.load(open(f"{d}/config.json")) for d in (folder, tmp_path / "out"))
        read = sorted(f for f in FAMILIES[kind].honoured if f in before)
        assert len(read) >= 15 and {f: after.get(f) for f in read} == {f: before[f] for f in read}
    for out in ("out", "out2"):
        assert json.load(open(tmp_path / out / "config.json"))["model_type"] == kind
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        assert type(back) is type(hf)
        with torch.no_grad():
            torch.testing.assert_close(back(_tokens()).logits, ref, rtol=1e-5, atol=1e-5)


def test_a_moe_config_with_a_bad_expert_count_is_refused_in_one_paragraph(folders, tmp_path):
    from tnlg.errors import UserError
    from tnlg.interop.hf import from_hf
    folder = folders["qwen3_moe"][0]
    raw = json.load(open(f"{folder}/config.json"))
    raw["num_experts_per_tok"] = 9
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(raw))
    shutil.copy(f"{folder}/model.safetensors", tmp_path / "bad" / "model.safetensors")
    with pytest.raises(UserError) as e:
        from_hf(str(tmp_path / "bad"))
    assert "moe_router_topk=9" in str(e.value) and "\n" not in str(e.value)


def _ep_logits(ps, ep: int, paths: dict, tokens: torch.Tensor, out_dir: str):
    from tnlg.interop.hf import from_hf, to_hf
    from tnlg.parallel.state import init_expert_parallel
    from tnlg.parallel.vocab import gather_logits
    ps = init_expert_parallel(ps, ep)
    out = {}
    for kind, folder in paths.items():
        model = from_hf(folder, ps).eval()
        assert model.transformer.h[0].mlp.experts.fc1.shape[0] == 4 // ep  # (this rank's experts only)
        with torch.no_grad():
            out[kind] = gather_logits(model(tokens), ps, VOCAB)
        to_hf(model, f"{out_dir}/{kind}" if ps.rank == 0 else None)  # (the experts gathered over EP)
    return out


@pytest.mark.parametrize("world,tp,ep", [(2, 1, 2), (4, 2, 2), (4, 1, 4)])
def test_moe_folders_load_split_over_expert_parallel_ranks_with_transformers_logits(folders, tmp_path, world, tp, ep):
    """EP 2, EP 2 x TP 2 and EP 4: each rank holds its share of the experts; the logits are transformers', and the
    model gathered back (over TP and EP) writes a folder transformers computes the same logits from."""
    paths = {kind: folder for kind, (folder, _, _) in folders.items()}
    got = run_distributed(_ep_logits, world, tp, ep, paths, _tokens(), str(tmp_path))
    for kind, (_, ref, _) in folders.items():
        for rank_out in got:
            torch.testing.assert_close(rank_out[kind], ref, rtol=1e-5, atol=1e-5, msg=lambda m, k=kind: f"{k}: {m}")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(_tokens()).logits, ref, rtol=1e-5, atol=1e-5)


def _olmoe_tp(ps, folder: str, tokens: torch.Tensor):
    """The logits of an OLMoE folder, and the gradients of the norms and the key/value weights of a loss of them
    (gathered to full tensors)."""
    from tnlg.interop.hf import from_hf
    from tnlg.parallel.sharding import full_state_dict
    from tnlg.parallel.vocab import gather_logits
    model = from_hf(folder, ps)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    with torch.no_grad():
        logits = gather_logits(model(tokens), ps, VOCAB)
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads = {k: v for k, v in full_state_dict(model, ps).items() if ".attn." in k}
    return logits, loss.item(), grads


def test_the_olmoe_norm_over_every_head_splits_over_ranks_that_share_key_value_groups(tmp_path):
    """6 heads and 2 key/value groups at TP 4 (heads 2, 2, 1, 1: group 0 on two ranks, group 1 on three): the
    norms' sums of squares count a shared group once, so the logits are transformers' and the loss, the norms'
    and the attention weights' gradients are TP 1's."""
    torch.manual_seed(4)
    cfg = transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **{**COMMON, "hidden_size": 48,
                                   "num_attention_heads": 6})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = model.eval()(_tokens()).logits
    from tnlg.interop.hf import from_hf
    ours = from_hf(model)
    assert ours.config.qk_layernorm_across_heads and ours.config.num_parameters_formula() == sum(
        p.numel() for p in model.parameters())  # (the norms' widths in the one parameter count)
    one = run_distributed(_olmoe_tp, 1, 1, str(tmp_path), _tokens())[0]
    for logits, loss, grads in run_distributed(_olmoe_tp, 4, 4, str(tmp_path), _tokens()):
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
        assert loss == pytest.approx(one[1], rel=1e-5)
        assert any(k.endswith("k_norm.weight") for k in grads) and set(grads) == set(one[2])
        for k, g in grads.items():
            torch.testing.assert_close(g, one[2][k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
