"""``tnlg plan --context-parallel-size``: the CP terms against their definitions, written out here.

* the ring moves, per layer and micro batch, K and V of a rank's ``s / C`` positions (G K/V heads of
  ``d``): ``C - 1`` hops forward; backward ``C - 1`` hops of K/V and ``C`` of fp32 dK/dV;
* ZeRO partitions over DP x CP (the ZeRO paper's ``4 Psi + 12 Psi / N`` at stage 1, ``N = dp * cp``);
* a CP rank's activations are the per-token terms of Korthikanti et al. at ``s / C`` positions, so they
  shrink ``C``-fold (the ring's buffers aside) and CP 1 is the plan without CP;
* with pipelines (``--cp C --pp P``) each stage's activations are one CP rank's, the world TP x CP x PP x DP, and
  at PP 1 the stage is the CP plan's rank exactly;
* against the simulation (a CP rank on fake tensors, the ring's sends to a fake group): the ring's bytes exactly,
  and the simulated peak beyond the model states between the planner's activations without and with its
  one-layer ring buffers;
* bad sizes: one paragraph each.
"""

from __future__ import annotations

import json
import re

import pytest

from tnlg.cli import main
from tnlg.config import GPTConfig
from tnlg.plan.context import context_activation_bytes, context_plan, ring_traffic
from tnlg.plan.planner import Hardware, Layout, Model, plan_layout

CFG = GPTConfig.preset("tnlg-17b", seq_length=32768)
HW = Hardware(gpu_memory=80 * 10**9, gpu_tflops=989.0, intra_node_gbps=450.0, inter_node_gbps=50.0)


def _cli_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("cp,tp", [(2, 4), (4, 2), (8, 1)])
def test_ring_bytes_are_k_and_v_of_the_chunk_round_the_ring(cp, tp):
    heads_r = max(CFG.heads_per_rank(tp))
    kv_elems = 2 * (32768 // cp) * 1 * heads_r * 152  # K and V, micro batch 1, no GQA
    ring = ring_traffic(CFG, tp, cp, 1, "bf16", False, micro_batches=3, hw=HW)
    assert ring["forward_bytes_per_layer"] == (cp - 1) * kv_elems * 2
    assert ring["backward_bytes_per_layer"] == (cp - 1) * kv_elems * 2 + cp * kv_elems * 4
    per_iteration = 78 * 3 * ((cp - 1) * kv_elems * 4 + cp * kv_elems * 4)
    assert ring["bytes_per_iteration"] == per_iteration
    bw = 450e9 if tp * cp <= 8 else 50e9
    assert ring["time_s"] == pytest.approx(per_iteration / bw)
    assert 0 <= ring["exposed_s"] <= ring["time_s"] + 1e-12


def test_full_recomputation_sends_k_and_v_once_more_in_its_recomputed_forward():
    plain, rc = (ring_traffic(CFG, 4, 4, 1, "bf16", r, 1, HW) for r in (False, True))
    assert rc["forward_bytes_per_layer"] == 2 * plain["forward_bytes_per_layer"]


def test_zero_partitions_over_dp_times_cp():
    layout = Layout(tp=4, dp=8, zero_stage=1, micro_batch=1, global_batch=64, precision="bf16")
    plan = context_plan(Model("tnlg-17b", CFG), layout, HW, 4)
    psi = plan["parameters"]["largest_rank"]["params"]
    assert plan["layout"]["world_size"] == 4 * 4 * 8
    assert plan["memory"]["model_states"] == pytest.approx(4 * psi + 12 * psi / 32, abs=2)


def test_activations_per_rank_shrink_with_cp():
    whole = context_activation_bytes(CFG, 4, 1, 1, False, "bf16")
    for cp in (2, 4, 8):
        part = context_activation_bytes(CFG, 4, cp, 1, False, "bf16")
        assert part["total"] - part["ring_working"] == pytest.approx(whole["total"] / cp, rel=1e-6)
        assert 0 < part["ring_working"] < 0.05 * part["total"]


def test_cp_1_is_the_plan_without_cp():
    layout = Layout(tp=4, dp=2, zero_stage=1, micro_batch=1, global_batch=8, precision="bf16")
    model = Model("tnlg-17b", CFG)
    assert context_plan(model, layout, HW, 1) == plan_layout(model, layout, HW, use_meta=False)


def test_the_cli_plans_one_cp_rank_and_searches_cp(capsys):
    args = ["--preset", "tnlg-17b", "--seq-length", "32768", "--gpu-memory", "80GB", "--gpu-tflops", "989",
            "--precision", "bf16", "--global-batch-size", "64"]
    plan = _cli_json(capsys, *args, "--cp", "4", "--tp", "2", "--world-size", "256", "--zero-stage", "3",
                     "--micro-batch-size", "1")
    assert (plan["layout"]["cp"], plan["layout"]["dp"], plan["layout"]["world_size"]) == (4, 32, 256)
    assert plan["memory"]["fits"] and plan["compute"]["ring"]["bytes_per_iteration"] > 0
    found = _cli_json(capsys, *args, "--search", "--world-size", "256", "--pp", "1")
    cps = {r["cp"] for r in found["context_parallel"]["layouts"]}
    assert {2, 4, 8} <= cps
    assert all(r["tp"] * r["cp"] * r["dp"] == 256 for r in found["context_parallel"]["layouts"])


@pytest.mark.parametrize("argv,match", [
    (["--cp", "3", "--world-size", "16", "--tp", "1"], r"--context-parallel-size 3 does not divide --world-size 16"),
    (["--cp", "3", "--seq-length", "1000"], r"2 x CP must divide --seq-length 1000.*Valid CP sizes"),
    (["--cp", "4", "--pp", "4", "--world-size", "8"], r"--context-parallel-size 4 does not divide --world-size 8 / "
                                                      r"\(TP 1 x PP 4\) = 2: .* Valid context-parallel sizes .*: \[1, 2\]"),
    (["--cp", "4", "--pp", "2", "--world-size", "16", "--dp", "4"], r"is not --world-size 16.*\(DP = 2\)"),
    (["--cp", "3", "--search", "--world-size", "12", "--pp", "2"], r"2 x CP must divide --seq-length 1024"),
])
def test_bad_cp_sizes_are_one_paragraph(capsys, argv, match):
    assert main(["plan", "--preset", "gpt2-small", *argv]) != 0
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------ CP with pipelines, and the simulation
def test_a_pipeline_stage_at_pp_1_is_the_cp_plans_rank():
    """pipeline_plan / pipeline_time with ``cp`` at one stage: the CP plan of the same layout (memory and time)."""
    from tnlg.plan.pipeline import pipeline_plan, pipeline_time
    for cp, tp, dp, zero, rc in ((2, 4, 32, 1, False), (4, 2, 32, 3, False), (8, 1, 32, 1, True)):
        layout = Layout(tp=tp, dp=dp, zero_stage=zero, micro_batch=1, global_batch=64, precision="bf16", recompute=rc)
        ours = context_plan(Model("tnlg-17b", CFG), layout, HW, cp)
        plan = pipeline_plan(CFG, tp, 1, dp, zero, "bf16", 1, 2, rc, cp=cp)
        if zero < 2:  # (ZeRO 2/3: the pipeline counts FSDP2's shards by Psi / N, the CP plan by FSDP2's rows)
            assert plan["stages"][0]["total"] == ours["memory"]["total"]
        assert plan["stages"][0]["activations"] == ours["memory"]["activations"]
        t = pipeline_time(CFG, plan, HW, tp, dp, zero, "bf16", 1, rc)
        assert t["model_flops_utilization"] == pytest.approx(ours["compute"]["model_flops_utilization"], rel=1e-9)


def test_cp_with_pp_splits_each_stages_activations_and_the_world(capsys):
    from tnlg.plan.pipeline import pipeline_plan
    whole = pipeline_plan(CFG, 4, 4, 8, 1, "bf16", 1, 8, True, cp=1)
    for cp in (2, 4):
        part = pipeline_plan(CFG, 4, 4, 8, 1, "bf16", 1, 8, True, cp=cp)
        ring = context_activation_bytes(CFG, 4, cp, 1, True, "bf16")["ring_working"]
        for a, b in zip(whole["stages"], part["stages"]):
            assert b["in_flight"] == a["in_flight"] and b["params"] == a["params"]
            # the attention core of the CP rank is the ring's (fused at any precision, as bf16 plans already)
            assert b["activations"] - ring == pytest.approx(a["activations"] / cp, rel=1e-6)
            assert b["buffers"] == a["buffers"] // cp
    args = ["--preset", "tnlg-17b", "--seq-length", "32768", "--gpu-memory", "80GB", "--bf16",
            "--global-batch-size", "64", "--world-size", "256", "--tp", "2", "--zero-stage", "1"]
    plan = _cli_json(capsys, *args, "--cp", "4", "--pp", "2")
    assert plan["pipeline"]["gpus"] == 256 and plan["layout"]["dp"] == 16 and plan["pipeline"]["cp"] == 4
    found = _cli_json(capsys, *args[:-4], "--search", "--cp", "4", "--pp", "2")
    rows = found["pipelines"]["layouts"]
    assert rows and {r["cp"] for r in rows} == {4} and all(r["tp"] * 4 * 2 * r["dp"] == 256 for r in rows)


SIM_CFG = GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=1024, vocab_size=512)


def _ring_sends(sim: dict) -> int:
    return sum(op.comm_bytes for ops in sim["ops"] for op in ops if op.group == "cp" and op.name.startswith("send"))


@pytest.mark.parametrize("cp", [2, 4])
def test_planner_against_the_simulation_of_a_cp_rank(cp):
    """One CP rank on fake tensors (bf16, TP 1, DP 1, PP 1 and the first stage of PP 2): the ring's K/V and
    dK/dV sends are the planner's bytes; the peak beyond the model states holds every layer's saved
    activations and, at the backward of a layer, part of its ring buffers: it lies between the planner's
    activations without and with its one-layer ring buffers (measured at hidden 256, seq 2048: -7% / +13% at
    PP 1, -15% / +4% on stage 0 of PP 2)."""
    from tnlg.plan.pipeline import pipeline_plan
    from tnlg.training.simulate import simulate
    from tnlg.training.simulate_pipeline import simulate_stage
    sim = simulate(SIM_CFG, 1, 1, cp=cp, zero_stage=0, precision="bf16", micro_batch=1, accum=1)
    ring = ring_traffic(SIM_CFG, 1, cp, 1, "bf16", False, 1, HW)
    assert _ring_sends(sim) == ring["bytes_per_iteration"]
    acts = context_activation_bytes(SIM_CFG, 1, cp, 1, False, "bf16")
    beyond = sim["peak_bytes"] - sim["phases"][0]["peak_bytes"]
    assert acts["total"] - acts["ring_working"] < beyond < acts["total"], (beyond, acts["total"])
    stage = simulate_stage(SIM_CFG, 1, 2, 1, 0, zero_stage=1, precision="bf16", micro_batch=1, micro_batches=4, cp=cp)
    planned = pipeline_plan(SIM_CFG, 1, 2, 1, 1, "bf16", 1, 4, cp=cp)["stages"][0]
    beyond = stage["peak_bytes"] - stage["setup_peak_bytes"]
    assert planned["total"] - planned["model_states"] - acts["ring_working"] < beyond
    assert beyond < planned["total"] - planned["model_states"]


@pytest.mark.parametrize("heads,groups,tp", [(8, 2, 3), (28, 4, 8)])
def test_ring_kv_heads_are_what_the_largest_rank_of_the_model_holds(heads, groups, tp):
    """Grouped-query attention on an uneven split: a rank holds every key/value group one of its query heads
    reads (8 heads, 2 groups, TP 3: groups [0], [0, 1], [1]). Each TP rank's model is built on the meta device
    and its K/V projection read; the ring's K/V bytes are those of the largest rank's groups."""
    import torch

    from tnlg.model import GPT
    from tnlg.parallel.state import ParallelState
    d, cp, seq = 8, 2, 64
    cfg = GPTConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, group_query_attention=True,
                    num_query_groups=groups, seq_length=seq, vocab_size=64)
    held = []
    for rank in range(tp):
        with torch.device("meta"):
            model = GPT(cfg, ParallelState(tp_rank=rank, tp_size=tp, virtual=True))
        kv = dict(model.named_parameters())["transformer.h.0.attn.c_kv.weight"]  # [groups held, K and V, d, h]
        assert tuple(kv.shape[1:]) == (2, d, heads * d)
        held.append(kv.shape[0])
    assert max(held) == 2
    ring = ring_traffic(cfg, tp, cp, 1, "bf16", False, micro_batches=1, hw=HW)
    assert ring["forward_bytes_per_layer"] == (cp - 1) * 2 * (seq // cp) * max(held) * d * 2
