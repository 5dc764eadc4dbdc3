"""The mixture-of-experts layer against independent references: megatron-core's own routing, token-dropping and
loss functions on the same router logits (they run on CPU), and a plain-torch loop over tokens and experts for
the layer's output; its configuration's bad values; the published parameter counts of the MoE presets."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tnlg.config import LLAMA, GPTConfig
from tnlg.model.forward import ForwardContext
from tnlg.model.moe import (aux_loss_scores, drop_to_capacity, grouped_matmul, load_balancing_loss, topk_routing,
                            z_loss)

mcore = pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _logits(T=24, E=6, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("pre_softmax,score,scale,bias", [(False, "softmax", None, False), (True, "softmax", None, False),
                                                          (False, "softmax", 2.5, False), (False, "sigmoid", None, True),
                                                          (False, "sigmoid", None, False)])
def test_routing_equals_megatron_core(pre_softmax, score, scale, bias):
    logits = _logits()
    eb = torch.randn(6, generator=torch.Generator().manual_seed(1)) * 0.1 if bias else None
    want_p, want_m = mcore.topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax,
                                                             scaling_factor=scale, score_function=score,
                                                             expert_bias=eb)
    got_p, got_m = topk_routing(logits, 2, pre_softmax, score, scale, eb)
    assert torch.equal(got_m, want_m)
    torch.testing.assert_close(got_p, want_p, rtol=0, atol=0)


@pytest.mark.parametrize("factor,policy,pad", [(1.0, "probs", False), (0.5, "probs", False), (0.75, "position", False),
                                               (1.0, "probs", True), (4.0, "probs", False)])
def test_the_capacity_drops_the_tokens_megatron_core_drops(factor, policy, pad):
    logits = _logits(T=32, E=4, seed=3)
    probs, rmap = mcore.topk_routing_with_score_function(logits, 2)
    want_p, want_m = mcore.apply_router_token_dropping(probs, rmap, router_topk=2, capacity_factor=factor,
                                                       drop_policy=policy, pad_to_capacity=pad)
    got_p, got_m = drop_to_capacity(*topk_routing(logits, 2), 2, factor, policy, pad)
    assert torch.equal(got_m, want_m)
    torch.testing.assert_close(got_p, want_p, rtol=0, atol=0)
    if factor < 1:
        assert int(got_m.sum()) < int(rmap.sum())  # (the case drops some)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_balancing_and_z_losses_equal_megatron_core(score):
    s, b, E, k = 8, 3, 6, 2
    logits = _logits(T=s * b, E=E, seed=5)
    want_map, want_scores = mcore.compute_routing_scores_for_aux_loss(logits, k, score)
    got_map, got_scores = aux_loss_scores(logits, k, score)
    assert torch.equal(got_map, want_map)
    torch.testing.assert_close(got_scores, want_scores, rtol=0, atol=0)
    want = mcore.switch_load_balancing_loss_func(want_scores, want_map.sum(0), s * b, k, E, 0.01)
    torch.testing.assert_close(load_balancing_loss(got_scores, got_map.sum(0), s * b, k, E, 0.01), want)
    # the sequence loss: megatron-core's reshape of [s b, E] to [s, b E] and its division by b (TopKRouter)
    want_seq = mcore.switch_load_balancing_loss_func(want_scores.reshape(s, -1), want_map.reshape(s, -1).sum(0), s,
                                                     k, E, 0.01) / b
    torch.testing.assert_close(load_balancing_loss(got_scores.reshape(s, -1), got_map.reshape(s, -1).sum(0), s, k,
                                                   E, 0.01) / b, want_seq)
    torch.testing.assert_close(z_loss(logits, 1e-3), mcore.z_loss_func(logits, 1e-3))


def _moe_config(**over):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100, num_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=16, **LLAMA)
    return GPTConfig(**{**base, **over})


def _reference_moe(layer, x):
    """A token-by-token loop: each token's top-k experts (plain softmax over the k logits), SwiGLU MLPs from the
    layer's weights, weighted and summed; plus the gated shared expert."""
    w = layer.router.weight
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top, idx = torch.topk(x[t] @ w.t(), 2)
        probs = torch.softmax(top, -1)
        for p, e in zip(probs, idx):
            gate, up = layer.experts.fc1[e]
            out[t] += p * (F.silu(x[t] @ gate.t()) * (x[t] @ up.t())) @ layer.experts.fc2[e].t()
    se = layer.shared_expert
    g, u = se.c_fc.weight
    shared = (F.silu(x @ g.t()) * (x @ u.t())) @ se.c_proj.weight.t()
    return out + torch.sigmoid(x @ layer.shared_expert_gate.weight.t()) * shared


def test_the_layer_equals_a_token_by_token_loop_and_adds_its_losses():
    from tnlg.model import GPT
    cfg = _moe_config(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True, moe_aux_loss_coeff=0.01,
                      moe_z_loss_coeff=1e-3)
    model = GPT(cfg)
    layer = model.transformer.h[0].mlp
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(0))
    ctx = ForwardContext()
    with torch.no_grad():
        y = layer(x, ctx)
        want = _reference_moe(layer, x.reshape(-1, 32)).view_as(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert ctx.aux == {}  # (no loss outside training with gradients)
    layer(x, ctx)
    assert set(ctx.aux) == {"load_balancing_loss", "z_loss"}
    logits = (x @ layer.router.weight.t()).reshape(-1, 4).detach()
    torch.testing.assert_close(ctx.aux["z_loss"].detach(), mcore.z_loss_func(logits, 1e-3))
    assert int(layer.last_load.sum()) == 12 * 2


def test_the_grouped_matmul_equals_the_loop_forward_and_backward():
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    counts = torch.tensor([3, 0, 7])
    y = grouped_matmul(x, w, counts)
    want = torch.cat([x[:3] @ w[0].t(), x[3:] @ w[2].t()])
    torch.testing.assert_close(y, want)
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    wx, ww = torch.autograd.grad(want, (x, w), gy)
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gw, ww)


@pytest.mark.parametrize("over,words", [
    (dict(moe_router_topk=5), "Valid top-k: 1 to 4"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor must be a positive number"),
    (dict(moe_expert_capacity_factor=-1.0), "moe_expert_capacity_factor must be a positive number"),
    (dict(moe_layer_freq=[1, 0, 1]), "has 3 entries for num_layers=2"),
    (dict(moe_layer_freq=0), "must be a positive integer N"),
    (dict(moe_shared_expert_gate=True), "shared expert's width"),
    (dict(moe_pad_expert_input_to_capacity=True), "give the factor"),
    (dict(moe_router_enable_expert_bias=True), "--moe-router-score-function sigmoid"),
    (dict(moe_router_score_function="relu"), "be one of softmax, sigmoid"),
    (dict(num_experts=None, moe_aux_loss_coeff=0.01), "num_experts (--num-experts E) is not set"),
    (dict(add_bias_linear=True), "--disable-bias-linear"),
])
def test_bad_moe_values_are_one_paragraph_naming_them(over, words):
    with pytest.raises(ValueError) as e:
        _moe_config(**over)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_sizes_must_divide_the_experts():
    cfg = _moe_config()
    with pytest.raises(ValueError, match=r"Valid sizes: \[1, 2, 4\]"):
        cfg.check_expert_parallel(3)


def test_moe_layer_freq_picks_the_layers():
    assert [_moe_config(num_layers=4, moe_layer_freq=2).is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert [_moe_config(num_layers=3, moe_layer_freq=[0, 1, 1]).is_moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)])
def test_the_moe_presets_have_the_published_total_and_active_counts(name, total, active):
    """Published (one decimal, rounded or cut): Mixtral 8x7B 46.7B total / 12.9B active (Mistral AI),
    Qwen3-30B-A3B 30.5B / 3.3B (Qwen's card; 29.9B without the embeddings); the formula, the layers'
    description and the meta build agree."""
    import tnlg
    from tnlg.model import GPT
    cfg = GPTConfig.preset(name)
    n = cfg.num_parameters_formula()
    assert abs(n - total) < 0.06e9 and abs(cfg.active_parameters() - active) < 0.06e9
    assert tnlg.parameter_counts(cfg)["total"] == n
    model = GPT(cfg, device="meta")
    padding = 2 * (cfg.padded_vocab_size(1) - cfg.vocab_size) * cfg.hidden_size  # (embedding and output rows)
    assert sum(p.numel() for p in model.parameters()) == n + padding


@pytest.mark.parametrize("over,words", [
    (dict(context_parallel_size=2, moe_expert_capacity_factor=1.0), "--context-parallel-size 2 and --moe-expert"),
    (dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), "--expert-tensor-parallel-size 1: tnlg splits"),
])
def test_pretrain_refuses_the_moe_layouts_not_built_yet(over, words):
    from tests.tiny import tiny_options
    from tnlg.errors import UserError
    moe = dict(num_experts=4, add_bias_linear=False, train_iters=5, attention_dropout=0.0)
    with pytest.raises(UserError) as e:
        tiny_options(2, **moe, **over)
    assert words in str(e.value) and "--num-experts 4" in str(e.value)
    tiny_options(2, **moe)  # (TP x DP runs, CP when dropless, and pipelines)
    tiny_options(2, **moe, context_parallel_size=2)
    tiny_options(2, **moe, pipeline_model_parallel_size=2)
    tiny_options(2, **moe, tensor_model_parallel_size=2, expert_tensor_parallel_size=2)  # (expert TP = TP)


def test_moe_models_no_hf_class_computes_and_megatron_exports_without_the_expert_bias_are_refused_by_name():
    from tnlg.errors import UserError
    from tnlg.interop.families import family_of
    from tnlg.interop.megatron.args import args_for
    with pytest.raises(UserError, match="mixture of experts .* has no Hugging Face class.*capacity factor"):
        family_of(_moe_config(moe_expert_capacity_factor=1.0))
    assert family_of(_moe_config(moe_ffn_hidden_size=None)).model_class == "MixtralForCausalLM"
    args = args_for(_moe_config(moe_layer_freq=[1, 0]), 1, 1, 0)  # Megatron-LM's arguments of the same names
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_layer_freq) == (4, 2, 16, [1, 0])
    with pytest.raises(UserError, match="expert bias .* which tnlg checkpoints do not hold yet"):
        args_for(_moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), 1, 1, 0)


def test_the_engine_refuses_fsdp_of_experts_held_by_one_rank_each_by_name():
    from tnlg.errors import UserError
    from tnlg.model import GPT
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.state import ParallelState
    ps = ParallelState(dp_size=2, ep_size=2, virtual=True)
    model = GPT(_moe_config(), ParallelState.single())
    with pytest.raises(UserError, match=r"--zero-stage 2 with expert parallelism EP 2 = DP x CP: .* nothing to shard"):
        build_engine(model, ps, zero_stage=2)  # (EP 2 of DP 2: an expert-DP group of one rank)


def test_the_expert_bias_moves_towards_the_less_loaded_experts_outside_the_gradient():
    """DeepSeek-V3's rule on one process: after a training forward, b += rate * sign(mean(n) - n) for the
    tokens n each expert got (the routing map's column sums, read here from the layer's load), then the
    counts restart; the bias is not a parameter (no gradient) and is saved with the model."""
    from tnlg.model import GPT
    from tnlg.model.moe import update_expert_bias
    from tnlg.parallel.state import ParallelState
    cfg = _moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate=0.01)
    model = GPT(cfg).train()
    tok = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tok, labels=tok).backward()
    layer = model.transformer.h[0].mlp
    n = layer.last_load.float()
    update_expert_bias(model, ParallelState.single())
    want = torch.where(n < n.mean(), 0.01, torch.where(n > n.mean(), -0.01, 0.0))
    torch.testing.assert_close(layer.router.expert_bias, want)
    assert not layer.router.local_tokens_per_expert.any()
    assert "transformer.h.0.mlp.router.expert_bias" in model.state_dict()
    assert all("expert_bias" not in name for name, _ in model.named_parameters())


def test_the_flops_of_a_mixture_of_experts_count_its_active_experts_and_router():
    """A MoE layer's FLOPs are a dense MLP's of width top-k x expert width, plus the router's 2 s h E per
    sequence and layer (x 3 for forward and backward)."""
    from tnlg.plan.flops import flops_per_iteration
    moe = _moe_config(num_layers=2, moe_ffn_hidden_size=16, moe_router_topk=2)
    dense = GPTConfig(**{**{f: getattr(moe, f) for f in ("num_layers", "hidden_size", "num_attention_heads",
                                                          "seq_length", "vocab_size")}, **LLAMA, "ffn_hidden_size": 32})
    router = 3 * 2 * moe.seq_length * moe.hidden_size * moe.num_experts * moe.num_layers
    assert flops_per_iteration(moe, 8, None, 100) == flops_per_iteration(dense, 8, None, 100) + 8 * router


def test_the_training_step_logs_the_moe_losses_apart_from_the_language_model_loss():
    """The step's loss is the LM loss plus the logged auxiliary terms: the LM loss alone is what the same
    weights give with the coefficients 0 (before the update)."""
    import dataclasses
    from tnlg.model import GPT
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.state import ParallelState
    from tnlg.training.step import train_step
    cfg = _moe_config(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    model = GPT(cfg)
    plain = GPT(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None))
    plain.load_state_dict(model.state_dict())
    tok = torch.randint(0, 100, (2, 2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lm = sum(plain(t, labels=t).item() for t in tok) / 2
    engine = build_engine(model, ParallelState.single(), zero_stage=0, lr=1e-3, grad_accum_steps=2)
    batches = [dict(tokens=t, labels=t) for t in tok]
    loss, info = train_step(engine.model, engine, batches, 1e-3, autocast=None, ps=ParallelState.single(), iteration=1)
    assert set(info["aux"]) == {"load_balancing_loss", "z_loss"}
    assert loss == pytest.approx(lm + sum(info["aux"].values()), rel=1e-6)


def test_the_layer_spec_puts_experts_in_the_mlp_slot_of_the_layers_moe_layer_freq_names():
    from tnlg.model.spec import block_spec, dense_mlp, moe_mlp
    from tnlg.parallel.state import ParallelState
    cfg = _moe_config(num_layers=3, moe_layer_freq=[0, 1, 1])
    assert [block_spec(cfg, ParallelState.single(), i).mlp for i in range(3)] == [dense_mlp, moe_mlp, moe_mlp]


def test_tnlg_plan_reports_the_active_parameters_of_a_mixture_of_experts(capsys):
    from tnlg.cli import main
    main(["plan", "--preset", "mixtral-8x7b", "--world-size", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"]["total"] == 46_702_792_704 and out["parameters"]["active"] == 12_879_925_248


def test_under_bf16_autocast_the_experts_run_in_bf16_and_the_loss_stays_near_fp32():
    from tnlg.model import GPT
    from tnlg.model.moe import grouped_matmul
    x, w = torch.randn(10, 16), torch.randn(3, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_matmul(x, w, torch.tensor([3, 0, 7])).dtype == torch.bfloat16
    model = GPT(_moe_config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                            moe_aux_loss_coeff=0.01))
    tok = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    want = model(tok, labels=tok).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tok, labels=tok)
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=2e-2)
