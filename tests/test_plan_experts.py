"""The planner's mixture-of-experts terms against independent counts: the experts per rank under expert
parallelism against the model built on the meta device at that layout, and one MoE training step's memory,
FLOPs and all-to-all bytes against the same step of tnlg's own code on fake tensors (the simulation, routed
evenly as the planner assumes), phase by phase; and bad layouts refused in one paragraph."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
import torch

from tnlg.config import LLAMA, GPTConfig
from tnlg.errors import UserError

# a small Llama-style mixture of experts
MOE = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=512, vocab_size=512, ffn_hidden_size=256,
           num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=192, **LLAMA)


def _flags(fields: dict) -> list[str]:
    """Flags of the (numeric, list or true boolean) fields ``fields``, by their declarations' spelling."""
    from tnlg.config import flag_of
    out = []
    for name, value in fields.items():
        if value is True:
            out.append(flag_of(name))
        else:
            out += [flag_of(name), *([str(v) for v in value] if isinstance(value, list) else [str(value)])]
    return out


def _plan(argv: list[str]) -> dict:
    from tnlg.commands.plan import add_arguments, run
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(parser.parse_args(argv + ["--json"]))
    return json.loads(out.getvalue())


def _virtual_expert_rank(cfg: GPTConfig, tp: int, tp_rank: int, ep: int):
    from tnlg.parallel.state import ParallelState, init_expert_parallel
    return init_expert_parallel(ParallelState.for_virtual_rank(tp, tp_rank, dp_size=ep), ep)


@pytest.mark.parametrize("name,over,tp,ep", [
    ("mixtral-8x7b", {}, 2, 8),
    ("qwen3-30b-a3b", {}, 4, 16),
    (None, dict(moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True, num_layers=3,
                moe_layer_freq=[0, 1, 1]), 3, 2),
    (None, dict(swiglu=False), 2, 4),
])
def test_the_experts_per_rank_are_what_the_meta_build_holds(name, over, tp, ep):
    """Every TP rank's dense and expert parameters at EP, as the planner splits them, are the parameters of that
    rank's model built on the meta device at that layout (gradient kind ``expert`` or not)."""
    from tnlg.model import GPT
    from tnlg.plan.counts import parameter_report
    from tnlg.plan.experts import expert_split
    cfg = GPTConfig.preset(name, **over) if name else GPTConfig(**{**MOE, **over})
    split = expert_split(cfg, parameter_report(cfg, tp, use_meta=False)["per_rank"], ep)
    for r in range(tp):
        model = GPT(cfg, _virtual_expert_rank(cfg, tp, r, ep), device="meta")
        expert = sum(p.numel() for p in model.parameters() if getattr(p, "gradient_kind", "dense") == "expert")
        dense = sum(p.numel() for p in model.parameters()) - expert
        assert (split["per_rank"][r]["dense"], split["per_rank"][r]["expert"]) == (dense, expert), r
    assert split["experts_per_rank"] == cfg.num_experts // ep


def test_even_routing_gives_every_expert_the_same_copies_and_each_token_k_experts():
    from tnlg.model.moe import even_routing_map
    rmap = even_routing_map(12, 3, 4)
    assert rmap.sum(0).tolist() == [9, 9, 9, 9] and rmap.sum(1).tolist() == [3] * 12
    capped = even_routing_map(12, 3, 4, capacity_factor=0.5)
    assert capped.sum(0).tolist() == [5, 5, 5, 5]  # (ceil(12 x 3 / 4 x 0.5))
    assert even_routing_map(12, 3, 4, capacity_factor=0.5, pad=True).sum(0).tolist() == [5, 5, 5, 5]


def test_expert_parallelism_splits_the_expert_states_and_adds_the_all_to_all():
    """Mixtral 8x7B at TP 2 x DP 64 (ZeRO 1, bf16, micro batch 1, seq 4096): EP 8 keeps one expert per rank, whose
    16-bit parameters and gradients drop by 8 and whose optimizer states are over DP 64 / EP 8 = 8 ranks; the
    all-to-all sends T k h x (EP - 1) / EP elements per dispatch and per combine, in forward and backward, both in
    bf16 (the tokens cast to the autocast dtype before the dispatch); counted here by hand."""
    base = ["--preset", "mixtral-8x7b", "--seq-length", "4096", "--tp", "2", "--dp", "64", "--zero-stage", "1",
            "--bf16", "--micro-batch-size", "1", "--global-batch-size", "128"]
    one, eight = _plan(base), _plan(base + ["--ep", "8"])
    cfg = GPTConfig.preset("mixtral-8x7b")
    f_r, h = cfg.expert_ffn_hidden_size // 2, cfg.hidden_size
    per_expert = 3 * f_r * h * cfg.num_moe_layers  # one expert's columns on a TP rank, every layer
    psi_one = one["memory"]["psi"]
    dense = psi_one - 8 * per_expert
    assert eight["memory"]["psi"] == dense + per_expert
    want = 2 * dense + 2 * dense + 12 * dense / 64 + 2 * per_expert + 2 * per_expert + 12 * per_expert / 8
    assert eight["memory"]["model_states"] == pytest.approx(want, abs=4)
    assert eight["experts"]["expert_data_parallel_ranks"] == 8 and eight["experts"]["experts_per_rank"] == 1
    T, k = 4096, 2
    a2a = eight["experts"]["all_to_all"]
    assert a2a["bytes_per_layer"] == pytest.approx(2 * (2 + 2) * T * k * h * 7 / 8, abs=1)
    assert a2a["bytes_per_iteration"] == pytest.approx(a2a["bytes_per_layer"] * 32 * 2, abs=64)  # 2 micro batches
    assert one["experts"]["all_to_all"]["bytes_per_iteration"] == 0
    assert eight["compute"]["time"]["ep_comm_s"] > 0 and one["compute"]["time"]["ep_comm_s"] == 0
    # the FLOPs (from the active parameters) do not depend on EP, nor the activations kept (even routing); the
    # dispatch holds one more bf16 copy of the routed tokens for a moment (received beside sent)
    assert eight["compute"]["flops_per_iteration"] == one["compute"]["flops_per_iteration"]
    kept = [p["memory"]["activations_no_recompute"] for p in (one, eight)]
    assert kept[0]["layers"] == kept[1]["layers"] and kept[0]["outside"] == kept[1]["outside"]
    assert kept[1]["moe_working"] - kept[0]["moe_working"] == T * k * h * 2


def test_the_search_lays_expert_parallelism_with_tp_and_dp():
    out = _plan(["--preset", "mixtral-8x7b", "--seq-length", "4096", "--search", "--world-size", "64", "--pp", "1",
                 "--gpu-memory", "80GB", "--global-batch-size", "64", "--bf16"])
    eps = {(r["tp"], r["ep"]) for r in out["layouts"]}
    assert {ep for _, ep in eps} >= {1, 2, 4, 8}
    for r in out["layouts"] + out["not_fitting"]:
        assert 8 % r["ep"] == 0 and r["dp"] % r["ep"] == 0
        assert r["ep"] == 1 or r["zero_stage"] <= 1
    # at TP 2, DP 32, ZeRO 1 EP 8 needs less memory than EP 1 (the experts are 90% of Mixtral)
    by = {(r["tp"], r["ep"], r["zero_stage"]): r for r in out["layouts"] + out["not_fitting"]}
    assert by[(2, 8, 1)]["model_states"] < by[(2, 1, 1)]["model_states"] / 3


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "mixtral-8x7b", "--world-size", "64", "--ep", "3"],
     "does not divide num_experts=8"),
    (["--preset", "mixtral-8x7b", "--world-size", "12", "--ep", "8"],
     "--expert-model-parallel-size 8 does not divide the data-parallel x context-parallel size 12"),
    (["--preset", "mixtral-8x7b", "--world-size", "64", "--ep", "2", "--zero-stage", "3"],
     "trains with --zero-stage 0 or 1"),
    (["--preset", "llama3-8b", "--world-size", "8", "--ep", "2"], "the model has none"),
    (["--preset", "mixtral-8x7b", "--world-size", "64", "--ep", "2", "--pp", "2"], "with EP 1"),
])
def test_bad_expert_layouts_are_one_paragraph(argv, needle):
    with pytest.raises(UserError) as e:
        _plan(argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


# (preset, its fields changed, tp, cp, dp, ep, micro batch, accumulation steps, full recomputation): the published MoE
# shapes cut to a few layers (a fake-tensor step takes seconds per layer), Qwen3's vocabulary cut so that its
# logits do not outweigh four layers
SIM_CASES = [
    pytest.param("mixtral-8x7b", dict(num_layers=4, seq_length=4096), 1, 1, 8, 8, 1, 2, False, id="mixtral-ep8"),
    pytest.param("qwen3-30b-a3b", dict(num_layers=4, seq_length=4096, vocab_size=32000), 2, 1, 4, 4, 1, 1, False,
                 id="qwen3-tp2-ep4"),
    pytest.param("mixtral-8x7b", dict(num_layers=2, seq_length=4096), 1, 2, 2, 4, 1, 1, False, id="mixtral-cp2-ep4"),
    pytest.param("mixtral-8x7b", dict(num_layers=3, seq_length=2048, moe_layer_freq=[0, 1, 1],
                                      moe_shared_expert_intermediate_size=2048, moe_shared_expert_gate=True,
                                      moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001), 1, 1, 4, 2, 2, 1, True,
                 id="mixtral-dense-first-shared-aux-recompute-ep2"),
]


@pytest.mark.parametrize("preset,over,tp,cp,dp,ep,micro,accum,recompute", SIM_CASES)
def test_planner_agrees_with_the_simulated_moe_step_phase_by_phase(preset, over, tp, cp, dp, ep, micro, accum,
                                                                    recompute):
    """`tnlg plan --simulate` of a MoE step (bf16, ZeRO 1): in every phase the simulated peak is the planner's
    (model states in setup, grad sync, norm and optimizer; states + activations in forward and backward) within
    5%, and so are the activations kept for backward; with full recomputation the planner's total is the
    backward's peak (a layer recomputed whole) and the forward, which keeps only each layer's input, peaks below
    it. The all-to-all bytes of each forward and backward are the planner's exactly, and the forward's FLOPs
    are the planner's (from the active parameters)."""
    argv = ["--preset", preset, *_flags(over), "--tp", str(tp), "--cp", str(cp), "--dp", str(dp), "--ep", str(ep),
            "--zero-stage", "1",
            "--bf16", "--micro-batch-size", str(micro), "--global-batch-size", str(micro * dp * accum), "--simulate",
            "--gpu", "h100", "--gpu-memory", "80GB"] + (["--recompute-activations"] if recompute else [])
    plan = _plan(argv)
    sim, mem = plan["simulation"], plan["memory"]
    phases = {p["name"]: p for p in sim["phases"]}
    states, total = mem["model_states"], mem["total"]
    got = sim["model_states"]
    assert got["param_bytes"] + got["grad_bytes"] + got["optim_bytes"] == pytest.approx(states, rel=2e-3)
    for name in ("setup", "grad sync", "norm", "optimizer"):
        assert phases[name]["peak_bytes"] == pytest.approx(states, rel=0.05), name
    for name in ("backward",) if recompute else ("forward", "backward"):
        assert phases[name]["peak_bytes"] == pytest.approx(total, rel=0.05), (name, phases[name]["peak_bytes"], total)
    if recompute:
        assert states < phases["forward"]["peak_bytes"] < total
    else:
        acts = mem["activations_no_recompute"]
        kept = phases["backward"]["live_start"]["activations"]
        assert kept == pytest.approx(acts["layers"] + acts["outside"], rel=0.05)
    a2a = plan["experts"]["all_to_all"]
    for name in ("forward", "backward"):
        sent = phases[name]["comm_bytes"].get("ep", 0) * (ep - 1) / ep
        passes = 2 if name == "forward" else a2a["all_to_alls_per_layer"] - 2
        assert sent == pytest.approx(a2a["bytes_per_iteration"] / accum * passes / a2a["all_to_alls_per_layer"],
                                     rel=1e-9), name
    if tp == cp == 1:
        from tnlg.plan.flops import flops_per_iteration
        cfg = GPTConfig.preset(preset, **over)
        model = flops_per_iteration(cfg, micro, None, cfg.padded_vocab_size(1))
        assert phases["forward"]["flops"] == pytest.approx(model / 3, rel=1e-12)


def test_the_even_routing_simulation_counts_what_a_real_run_counts():
    """The simulation of a MoE step on fake tensors (even routing, counts as the fake mode's constants) counts
    what the same step on real CPU tensors counts when they are routed evenly as well: phase by phase the same
    bytes live at the start and at the peak, by kind, and the same operators with the same FLOPs and bytes."""
    from tnlg.parallel.state import ParallelState
    from tnlg.training.simulate import even_routing, simulate, tracked_iteration
    cfg = GPTConfig(**{**MOE, "seq_length": 64})
    torch.manual_seed(0)
    with even_routing(real_tensors=True):
        tracker, _ = tracked_iteration(cfg, ParallelState.single(), zero_stage=1, precision="bf16", micro_batch=2,
                                       accum=1)
    sim = simulate(cfg, 1, 1, zero_stage=1, precision="bf16", micro_batch=2, accum=1, gpu="h100", gpu_kernels=False)
    fake = {ph["name"]: (ph, ops) for ph, ops in zip(sim["phases"], sim["ops"])}
    assert [ph.name for ph in tracker.phases] == ["setup", "forward", "backward", "grad sync", "norm", "optimizer"]
    assert any(o.name == "_grouped_mm" and o.flops for o in tracker.phases[1].ops)  # (the experts ran, grouped)
    host_reads = {"aminmax", "_local_scalar_dense"}  # what only real tensors read back
    for ph in tracker.phases:
        real, (faked, fake_ops) = ph.as_dict(), fake[ph.name]
        for f in ("live_start", "peak_bytes", "peak_by_kind"):
            assert real[f] == faked[f], (ph.name, f, real[f], faked[f])
        assert [(o.name, o.flops, o.bytes) for o in ph.ops if o.name not in host_reads] == \
            [(o.name, o.flops, o.bytes) for o in fake_ops if o.name not in host_reads], ph.name
