"""``tnlg plan --pp``: per-stage parameters against the stage modules tnlg builds; the micro batches in
flight and the bubble of 1F1B and interleaved 1F1B against the schedules' own order of forwards and
backwards (torch's for the interleaved one), replayed; ``--world-size`` and ``--search`` with pipelines."""

from __future__ import annotations

import argparse

import pytest
import torch

from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.model.stage import StageModel
from tnlg.parallel.pipeline import chunk_layers
from tnlg.parallel.state import ParallelState
from tnlg.commands.plan import add_arguments, run
from tnlg.plan.counts import parameter_counts
from tnlg.plan.pipeline import bubble_fraction, chunks_in_flight, pipeline_plan, pipeline_time
from .pool import run_distributed


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1_and_interleaving_divides_its_time_by_v():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    # v chunks: the idle time is (P - 1) / v of a micro batch's forward + backward, the busy time m of them
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx((3 / 2) / (8 + 3 / 2))
    assert bubble_fraction(1, 8) == 0.0


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 3), (4, 4)])
def test_stage_parameters_are_those_of_the_stage_modules_and_add_up_to_the_model(tp, pp):
    cfg = GPTConfig(num_layers=7, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=300)
    plan = pipeline_plan(cfg, tp, pp, dp=2, zero_stage=1, precision="fp16", micro_batch=1, micro_batches=8)
    chunks = chunk_layers(7, pp)
    for i, stage in enumerate(plan["stages"]):
        ps = ParallelState(tp_rank=0, tp_size=tp, pp_rank=i, pp_size=pp, device=torch.device("meta"), virtual=True)
        built = StageModel(cfg, ps, [chunks[i]], device="meta")
        assert stage["params"] == sum(p.numel() for p in built.parameters())
        assert stage["in_flight"] == pp - i  # 1F1B: stage i holds P - i micro batches (m = 8 >= P)
    whole = parameter_counts(cfg, tp)["per_rank"][0]["params"]
    wte = cfg.padded_vocab_size(tp) // tp * cfg.hidden_size  # the last stage's copy of the tied embedding
    assert sum(s["params"] for s in plan["stages"]) == whole + wte


def _plan(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args(argv))


def test_plan_with_pp_prints_a_row_per_stage_takes_the_world_size_and_refuses_too_few_micro_batches(capsys):
    assert _plan(["--preset", "gpt2-small", "--pp", "4", "--dp", "2", "--global-batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "bubble 27.3% of each step" in out  # (4 - 1) / (8 + 4 - 1)
    assert out.count(" GB (") == 4
    assert "PP 4 x TP 1 x DP 2 = 8 GPUs" in out
    # the world is PP x TP x DP: 8 GPUs at PP 4 are DP 2
    assert _plan(["--preset", "gpt2-small", "--pp", "4", "--world-size", "8", "--global-batch-size", "16"]) == 0
    assert capsys.readouterr().out == out
    with pytest.raises(UserError, match="1 micro batch.* fewer than the 4 pipeline stages"):
        _plan(["--preset", "gpt2-small", "--pp", "4", "--dp", "2", "--global-batch-size", "2"])


# ------------------------------------------------------------ in flight and bubble, from the schedules' order
def _torch_interleaved_orders(_ps, cases):
    """torch's ``ScheduleInterleaved1F1B`` order of every rank, for each ``(P, v, m)``: built in this spawned
    process on a fake process group of ``P`` ranks (the order of all ranks is computed on each)."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _ComputationType
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.destroy_process_group()
    orders = {}
    for pp, v, m in cases:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
        stages = [PipelineStage(nn.Linear(2, 2), k * pp, pp * v, torch.device("cpu")) for k in range(v)]
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda out, target: out.sum())
        kind = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
        orders[(pp, v, m)] = {rank: [(kind[a.computation_type], a.stage_index, a.microbatch_index)
                                     for a in ops if a is not None and a.computation_type in kind]
                              for rank, ops in schedule.pipeline_order.items()}
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # for the harness's teardown
    return orders


def _one_f_one_b_order(pp: int, m: int) -> dict:
    """Non-interleaved 1F1B as torch's ``Schedule1F1B`` runs it on stage ``i``: ``min(m, P - i)`` forwards,
    then a backward and a forward in turn, then the remaining backwards."""
    orders = {}
    for i in range(pp):
        warmup = min(m, pp - i)
        ops = [("F", i, j) for j in range(warmup)]
        for j in range(m):
            ops.append(("B", i, j))
            if warmup + j < m:
                ops.append(("F", i, warmup + j))
        orders[i] = ops
    return orders


def _peak_in_flight(ops) -> int:
    live = peak = 0
    for kind, _, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def _replayed_bubble(orders: dict, chunks: int) -> float:
    """Every rank runs its ops in order, a forward of a chunk lasting 1 and a backward 2, a forward after the
    previous chunk's forward of that micro batch, a backward after the next chunk's backward (the last chunk's
    after its own forward): the idle fraction of the makespan, averaged over the ranks."""
    done, clock = {}, dict.fromkeys(orders, 0.0)
    pending = {r: list(ops) for r, ops in orders.items()}
    while any(pending.values()):
        moved = False
        for r, ops in pending.items():
            while ops:
                kind, c, j = ops[0]
                dep = ("F", c - 1, j) if kind == "F" else ("B", c + 1, j) if c < chunks - 1 else ("F", c, j)
                if dep in done or (kind == "F" and c == 0):
                    done[ops.pop(0)] = clock[r] = max(clock[r], done.get(dep, 0.0)) + (1 if kind == "F" else 2)
                    moved = True
                else:
                    break
        assert moved, "the order deadlocks"
    makespan = max(clock.values())
    return sum(1 - 3 * len(ops) / 2 / makespan for ops in orders.values()) / len(orders)


INTERLEAVED = [(2, 2, 4), (2, 2, 6), (4, 2, 4), (4, 2, 8), (4, 2, 10), (4, 3, 12), (3, 2, 6), (4, 2, 16)]


def test_interleaved_chunks_in_flight_and_bubble_are_those_of_torchs_schedule():
    orders = run_distributed(_torch_interleaved_orders, 1, 1, INTERLEAVED, timeout_s=120)[0]
    for (pp, v, m), by_rank in orders.items():
        for rank, ops in by_rank.items():
            assert chunks_in_flight("interleaved", pp, m, rank, v) == _peak_in_flight(ops), (pp, v, m, rank)
            last = [(k, c, j) for k, c, j in ops if c == pp * v - 1]  # the logits: one micro batch at a time
            assert _peak_in_flight(last) <= 1
        assert bubble_fraction(pp, m, v) == pytest.approx(_replayed_bubble(by_rank, pp * v), abs=1e-12), (pp, v, m)
    # Korthikanti et al.: the first rank holds L (1 + (P - 1) / (P v)) layers' worth when P divides m
    plan = pipeline_plan(CFG8, 1, 4, 1, 0, "fp32", 1, 8, schedule="interleaved", virtual=2, attention="fused")
    assert plan["stages"][0]["in_flight"] * plan["chunk_layers"] == 8 * (1 + 3 / 8)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (4, 16), (3, 7)])
def test_one_f_one_b_in_flight_and_bubble_replayed(pp, m):
    orders = _one_f_one_b_order(pp, m)
    assert [chunks_in_flight("1f1b", pp, m, i) for i in range(pp)] == [_peak_in_flight(orders[i]) for i in range(pp)]
    assert bubble_fraction(pp, m) == pytest.approx(_replayed_bubble(orders, pp), abs=1e-12)


CFG8 = GPTConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=300)


def test_interleaved_stage_holds_its_chunks_and_the_buffers_torch_allocates():
    plan = pipeline_plan(CFG8, 1, 2, 1, 0, "fp32", 2, 4, schedule="interleaved", virtual=2)
    boundary = 32 * 2 * 64 * 4  # one [b, s, h] fp32 activation
    for i, stage in enumerate(plan["stages"]):
        built = StageModel(CFG8, ParallelState(pp_rank=i, pp_size=2, device=torch.device("meta"), virtual=True),
                           chunk_layers(8, 2, virtual=2)[i::2], device="meta")
        assert stage["params"] == sum(p.numel() for p in built.parameters())
        # receive buffers: m activations per chunk but the model's first, m gradients per chunk but the last
        assert stage["buffers"] == 4 * boundary * (2 * 2 - 1)
    assert plan["p2p_bytes_per_step"] == 2 * boundary * 4 * (2 * 2 - 1)  # 3 chunk boundaries, both ways


# ------------------------------------------------------------ --search with pipelines
def _search(capsys, *argv):
    import json
    capsys.readouterr()
    assert _plan(["--search", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_search_ranks_only_pipeline_layouts_whose_heaviest_stage_fits(capsys):
    mem = 6e9
    res = _search(capsys, "--preset", "gpt2-xl", "--world-size", "8", "--global-batch-size", "16",
                  "--gpu-memory", "6GB")
    pipes = res["pipelines"]
    rows, unfit = pipes["layouts"], pipes["not_fitting"]
    assert rows and unfit
    assert [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows), reverse=True)
    c = GPTConfig.preset("gpt2-xl")
    for r in rows:
        assert r["tp"] * r["cp"] * r["pp"] * r["dp"] == 8 and r["pp"] > 1 and r["zero_stage"] in (0, 1, 2, 3)
        assert r["micro_batch"] * r["micro_batches"] * r["dp"] == 16 and r["micro_batches"] >= r["pp"]
        assert r["total"] <= mem
        # the heaviest stage's model states by hand: its parameters from the stage module tnlg builds,
        # 2 + 2 + 12 bytes each (fp16 with fp32 master weights and Adam), the 12 split over DP at ZeRO 1; at
        # ZeRO 2/3 over DP > 1 torch's schedule keeps the unsharded parameters and gradients beside the
        # 16-bit shard (one DP rank: the flat stage-0 path); with context parallelism ZeRO spans DP x CP
        i, zero, dp = r["heaviest_stage"], r["zero_stage"], r["dp"] * r["cp"]
        ps = ParallelState(tp_size=r["tp"], pp_rank=i, pp_size=r["pp"], device=torch.device("meta"), virtual=True)
        params = sum(p.numel() for p in StageModel(c, ps, [chunk_layers(48, r["pp"])[i]], device="meta").parameters())
        per = 4 + 12 / (dp if zero else 1) + (2 / dp if zero >= 2 and dp > 1 else 0)
        assert r["model_states"] == round(per * params)
    ranked = {(r["tp"], r["cp"], r["pp"]) for r in rows}
    for r in unfit:  # nothing fits at this (TP, CP, PP): its smallest footprint is over the GPU, and it is not ranked
        assert (r["tp"], r["cp"], r["pp"]) not in ranked and r["total"] > mem and "does NOT fit" not in r["reason"]
        assert (r["zero_stage"], r["recompute"], r["micro_batch"]) == (1, True, 1)
    capsys.readouterr()
    assert _plan(["--search", "--preset", "gpt2-xl", "--world-size", "8", "--global-batch-size", "16",
                  "--gpu-memory", "6GB"]) == 0
    text = capsys.readouterr().out
    cp = "CP %d x " % rows[0]["cp"] if rows[0]["cp"] > 1 else ""
    assert "fastest with a pipeline: TP %d x %sPP %d x DP %d" % (rows[0]["tp"], cp, rows[0]["pp"], rows[0]["dp"]) in text
    assert text.count("does NOT fit: model states alone") + text.count("even at micro batch 1") >= len(unfit)


def test_search_at_one_pipeline_size_and_interleaved(capsys):
    res = _search(capsys, "--preset", "gpt2-medium", "--world-size", "8", "--global-batch-size", "32",
                  "--gpu-memory", "80GB", "--pp", "4", "--pipeline-schedule", "interleaved",
                  "--num-layers-per-virtual-pipeline-stage", "2")
    rows = res["pipelines"]["layouts"]
    assert rows and {r["pp"] for r in rows} == {4} and {r["virtual"] for r in rows} == {3}  # 24 / (4 x 2)
    assert all(r["bubble"] == pytest.approx(3 / (3 * r["micro_batches"] + 3)) for r in rows)


@pytest.mark.parametrize("argv,needle", [
    (["--search", "--world-size", "8", "--pp", "3"], "Valid pipeline sizes for 8 GPUs and 12 layers: [1, 2, 4, 8]"),
    (["--search", "--world-size", "32", "--pp", "16"], "every stage needs at least one layer"),
    (["--pp", "3", "--tp", "2", "--world-size", "8"], "--pipeline-model-parallel-size 3 does not divide --world-size "
                                                      "8 / TP 2 = 4: every pipeline must be complete (the world is TP "
                                                      "x CP x DP x PP). Valid pipeline-parallel sizes at TP 2 on 8 GPUs: "
                                                      "[1, 2, 4]"),
    (["--pp", "2", "--tp", "2", "--dp", "4", "--world-size", "8"], "(DP = 2)"),
    (["--pp", "13", "--dp", "1", "--global-batch-size", "16"], "more stages than the model's 12 layers"),
    (["--pp", "4", "--dp", "1", "--global-batch-size", "16", "--pipeline-schedule", "interleaved",
      "--num-layers-per-virtual-pipeline-stage", "2"], "does not divide the 3 layers per stage"),
    (["--pp", "4", "--dp", "1", "--global-batch-size", "16", "--pipeline-schedule", "interleaved"], "go together"),
    (["--pp", "4", "--dp", "1", "--global-batch-size", "9", "--pipeline-schedule", "interleaved",
      "--num-layers-per-virtual-pipeline-stage", "1"], "multiple of 2"),
    (["--pipeline-schedule", "interleaved"], "give --pipeline-model-parallel-size P > 1"),
    (["--pp", "0"], "must be a positive integer"),
])
def test_pipeline_layouts_that_cannot_run_are_one_clear_paragraph(capsys, argv, needle):
    from tnlg.cli import main
    capsys.readouterr()
    assert main(["plan", "--preset", "gpt2-small", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert needle in captured.err and captured.err.count("\n") == 1, captured.err


# ------------------------------------------------------------ the step time
def test_pipeline_time_at_one_stage_is_the_planners_time_without_a_pipeline():
    from tnlg.plan.planner import Hardware, Layout, Model, plan_layout
    cfg, hw = GPTConfig.preset("gpt2-medium"), Hardware()
    for tp, dp, zero, recompute in ((1, 8, 1, False), (2, 4, 0, True), (4, 2, 1, False)):
        plan = pipeline_plan(cfg, tp, 1, dp, zero, "fp16", 2, 4, recompute)
        ours = pipeline_time(cfg, plan, hw, tp, dp, zero, "fp16", 2, recompute)
        flat = plan_layout(Model("m", cfg), Layout(tp=tp, dp=dp, zero_stage=zero, micro_batch=2, global_batch=8 * dp,
                                                   recompute=recompute), hw, use_meta=False)["compute"]
        assert ours["time_per_iteration_s"] == pytest.approx(flat["time_per_iteration_s"], rel=1e-9)
        assert ours["model_flops_utilization"] == pytest.approx(flat["model_flops_utilization"], rel=1e-9)


def test_pipeline_time_is_m_plus_p_minus_1_slots_of_the_slowest_stage():
    from tnlg.plan.planner import Hardware
    cfg = GPTConfig(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=256, vocab_size=1000)
    hw = Hardware(gpu_tflops=100.0, mfu=0.5, intra_node_gbps=1e12)  # communication free
    s, h, v_pad = 256, 512, cfg.padded_vocab_size(1)
    layer = 3 * (24 * s * h * h + 4 * s * s * h)  # forward + backward of one sequence, f = 4h
    slot = (2 * layer + 3 * 2 * s * h * v_pad) / (100e12 * 0.5)  # the last stage: 2 layers and the logits
    t = pipeline_time(cfg, pipeline_plan(cfg, 1, 4, 1, 0, "fp16", 1, 16), hw, 1, 1, 0, "fp16", 1, False)
    assert t["time_per_iteration_s"] == pytest.approx((16 + 3) * slot, rel=1e-6)


def test_pipeline_dp_traffic_per_zero_stage():
    """DP traffic of the heaviest stage per step: ZeRO 0-2 two stage's worth of 16-bit parameters (all-reduce;
    reduce-scatter + all-gather; ZeRO 2's one gather in the first forward and one reduce-scatter), ZeRO 3
    m + 1 all-gathers (a unit gathered again in each backward after a forward, kept to its next forward) and one
    reduce-scatter: (m + 2), each x (DP - 1) / DP, at the intra-node bandwidth (TP x DP = a node)."""
    from tnlg.plan.planner import Hardware
    cfg, hw, m, dp = GPTConfig.preset("gpt2-medium"), Hardware(), 8, 4
    for zero, units in ((0, 2), (1, 2), (2, 2), (3, m + 2)):
        plan = pipeline_plan(cfg, 2, 2, dp, zero, "bf16", 1, m)
        psi = max(s["params"] for s in plan["stages"])
        t = pipeline_time(cfg, plan, hw, 2, dp, zero, "bf16", 1, False)
        assert t["dp_comm_s"] == pytest.approx(units * psi * 2 * (dp - 1) / dp / (hw.intra_node_gbps * 1e9))


def test_search_lists_zero_2_and_3_pipeline_layouts_with_their_stage_memory(capsys):
    """--search tries ZeRO 0-3 for every pipeline layout; a ZeRO 2/3 row's memory is pipeline_plan's at its
    layout, and it never holds less than ZeRO 1 at the same micro batch (torch's schedule keeps the stage's
    unsharded parameters and gradients), so the fastest layout is never a ZeRO 2/3 one that ZeRO 1 beats."""
    res = _search(capsys, "--preset", "gpt2-medium", "--world-size", "8", "--global-batch-size", "32",
                  "--gpu-memory", "80GB", "--pp", "2")
    rows = res["pipelines"]["layouts"]
    c = GPTConfig.preset("gpt2-medium")
    assert {2, 3} <= {r["zero_stage"] for r in rows if r["dp"] > 1}
    assert {1, 2} <= {r["cp"] for r in rows}  # CP laid out with the pipelines
    for r in rows:
        if r["zero_stage"] < 2:
            continue
        plan = pipeline_plan(c, r["tp"], r["pp"], r["dp"], r["zero_stage"], "fp16", r["micro_batch"],
                             r["micro_batches"], r["recompute"], cp=r["cp"])
        assert r["total"] == plan["stages"][r["heaviest_stage"]]["total"]
        one = pipeline_plan(c, r["tp"], r["pp"], r["dp"], 1, "fp16", r["micro_batch"], r["micro_batches"],
                            r["recompute"], cp=r["cp"])
        assert r["total"] >= one["stages"][one["heaviest"]]["total"]
    capsys.readouterr()
    assert _plan(["--search", "--preset", "gpt2-medium", "--world-size", "8", "--global-batch-size", "32",
                  "--gpu-memory", "80GB", "--pp", "2"]) == 0
    assert "ZeRO 0-3" in capsys.readouterr().out


def test_a_pipeline_plan_leads_with_the_layout_asked_for(capsys):
    """``tnlg plan --pp 4 --tp 4 --world-size 256``: the per-stage table of PP 4 x TP 4 x DP 16 comes first,
    the whole model on one stage (TP 4 x DP 16 = 64 GPUs) after it, headed as such."""
    from tnlg.cli import main
    assert main(["plan", "--preset", "tnlg-17b", "--pp", "4", "--tp", "4", "--world-size", "256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("per pipeline stage (PP 4 x TP 4 x DP 16 = 256 GPUs"), out[:300]
    assert out.index("<- heaviest") < out.index("the whole model on one stage, without a pipeline:")
