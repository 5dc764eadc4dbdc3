"""Context parallelism (CP) in the plan: activations per CP rank, the ring's traffic and time, and the search.

A CP layout of ``C`` ranks (:mod:`tnlg.parallel.context`) runs TP x CP x DP x PP GPUs. What changes
against the same (TP, DP) without CP:

* **Activations** per rank are those of a sequence of ``s / C`` positions (every tensor a layer keeps
  is per token), with the attention core counted as a fused kernel's (output and fp32 log-sum-exp:
  the ring keeps no ``s x s`` scores, whatever the precision): :func:`context_activation_bytes`. One
  layer's ring also holds, while it runs, two K/V buffers (the one in use and the one arriving), their
  copies expanded to the query heads, and in backward the fp32 dQ and two fp32 dK/dV accumulators (in
  use, arriving): the ``ring_working`` term, counted once (one layer at a time).
* **Model states** are partitioned by ZeRO over DP x CP (the gradient reduction spans both), and the
  DP gradient traffic runs over those ``dp * C`` ranks.
* **Compute** per GPU is the iteration's FLOPs (the full ``s^2`` attention of Narayanan et al.) over
  ``tp * C * dp`` GPUs; TP traffic carries ``s / C`` positions per rank.
* **The ring** (per layer, per micro batch, per rank): K and V of the rank's ``2c = s / C`` positions,
  ``kv = 2 (s / C) b g_r d`` elements (``g_r`` = K/V heads on the rank), ``C - 1`` hops in forward;
  in backward the K/V again (``C - 1`` hops) and the fp32 dK/dV (``C`` hops); full recomputation adds
  one more forward. Time at the intra-node bandwidth when TP x CP fits in a node, else the inter-node
  one. Each hop overlaps one step's half block of attention (``2c x c`` scores, ``8 c^2 b h_r d`` FLOPs forward, twice in backward);
  only what a hop takes beyond its block is counted as exposed and added to the iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import GPTConfig
from ..errors import UserError
from ..layout import ParallelDims, check_context_sequence, check_positive
from .counts import parameter_report
from .flops import flops_per_iteration, iteration_time, rank_flops_imbalance
from .memory import PRECISIONS, activation_bytes
from .planner import (Hardware, Layout, Model, add_expert_time, check_layout, expert_plan, layout_psi, layout_states,
                      plan_layout)
from .search import _divisors_desc, _row, _why_not

__all__ = ["check_context_parallel", "context_activation_bytes", "ring_traffic", "context_plan",
           "search_context_parallel", "format_context", "format_context_search", "RING_FORMULA"]

RING_FORMULA = ("ring per layer and micro batch: K/V = 2*(s/C)*b*g_r*d elements; forward (C-1) hops, backward "
                "(C-1) hops of K/V + C hops of fp32 dK/dV (+ (C-1) with full recomputation); exposed = what a "
                "hop takes beyond its block's attention")


def check_context_parallel(config: GPTConfig, cp: int) -> None:
    """A :class:`UserError` unless ``cp`` is a positive integer and ``2 cp`` divides the sequence."""
    check_positive(cp=cp)
    check_context_sequence(cp, config.seq_length)


def _kv_heads_per_rank(config: GPTConfig, tp: int) -> int:
    """K/V heads the largest TP rank holds and sends round the ring: its key/value groups
    (:meth:`GPTConfig.kv_groups_per_rank`, the function the model builds its K/V projection from; one group
    per head without GQA). A group shared by several ranks counts on each: 8 heads, 2 groups at TP 3 hold
    groups [0], [0, 1], [1], so the largest rank holds 2."""
    return max(len(groups) for groups in config.kv_groups_per_rank(tp))


def context_activation_bytes(config: GPTConfig, tp: int, cp: int, micro_batch: int, recompute,
                             precision: str = "fp16", *, sequence_parallel: bool = False, ep: int = 1) -> dict:
    """:func:`tnlg.plan.memory.activation_bytes` of one CP rank (``s / cp`` positions, fused core) plus the
    one-layer ring buffers (``ring_working``, in ``total``)."""
    check_context_parallel(config, cp)
    local = dataclasses.replace(config, seq_length=config.seq_length // cp)
    out = activation_bytes(local, tp, micro_batch, recompute, precision, sequence_parallel=sequence_parallel,
                           attention="fused", ep=ep)
    n, d, b = config.seq_length // cp, config.head_dim, micro_batch
    elem = 4 if precision == "fp32" else 2
    kv = 2 * n * b * _kv_heads_per_rank(config, tp) * d
    expanded = 2 * n * b * max(config.heads_per_rank(tp)) * d
    working = 0 if cp == 1 else 2 * kv * elem + expanded * elem + 2 * kv * 4 + expanded // 2 * 4
    out.update(ring_working=working, total=out["total"] + working, cp=cp)
    return out


def ring_traffic(config: GPTConfig, tp: int, cp: int, micro_batch: int, precision: str, recompute: bool,
                 micro_batches: int, hw: Hardware) -> dict:
    """Bytes the ring moves per rank (per layer and per iteration) and their time, total and exposed."""
    n, d, b, l = config.seq_length // cp, config.head_dim, micro_batch, config.num_layers
    elem = 4 if precision == "fp32" else 2
    kv = 2 * n * b * _kv_heads_per_rank(config, tp) * d
    forward = (cp - 1) * kv * elem * (2 if recompute else 1)
    backward = (cp - 1) * kv * elem + cp * kv * 4
    bw = (hw.intra_node_gbps if tp * cp <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
    rate = hw.gpu_tflops * 1e12 * hw.mfu
    # one step's half block: 2c x c scores (c = n / 2), 4 FLOPs per score and head dimension, forward
    block = 4 * n * (n // 2) * b * max(config.heads_per_rank(tp)) * d / rate
    hop_f, hop_b = kv * elem / bw, kv * (elem + 4) / bw
    exposed = (cp - 1) * (max(0.0, hop_f - block) * (2 if recompute else 1) + max(0.0, hop_b - 2 * block)) \
        + (kv * 4 / bw if cp > 1 else 0.0)
    per_layer = forward + backward if cp > 1 else 0
    return {"formula": RING_FORMULA, "forward_bytes_per_layer": forward if cp > 1 else 0,
            "backward_bytes_per_layer": backward if cp > 1 else 0,
            "bytes_per_iteration": per_layer * l * micro_batches, "bandwidth_gbps": bw / 1e9,
            "time_s": per_layer * l * micro_batches / bw, "exposed_s": exposed * l * micro_batches if cp > 1 else 0.0}


def context_plan(model: Model, layout: Layout, hw: Hardware, cp: int, train_tokens: Optional[int] = None,
                 params: Optional[dict] = None) -> dict:
    """:func:`tnlg.planner.plan_layout` of ``layout`` (its TP and DP) with ``cp`` context-parallel ranks."""
    if model.abstract:
        raise UserError("--context-parallel-size needs a model shape (--preset or shape flags): the activations "
                        "and the ring's traffic depend on the sequence, heads and hidden size.")
    c = model.shape
    check_context_parallel(c, cp)
    check_layout(model, layout, cp)
    params = params if params is not None else parameter_report(c, layout.tp, use_meta=False)
    plan = plan_layout(model, layout, hw, train_tokens, params=params, cp=cp)
    if cp == 1:
        return plan
    grads_dp = layout.dp * cp
    plan["layout"].update(cp=cp, world_size=layout.world_size * cp, gradient_reduction_ranks=grads_dp)
    plan["memory"].update(_memory(model, layout, cp, params, hw))
    plan["compute"].update(_compute(model, layout, cp, params, hw, train_tokens))
    if "experts" in plan:
        plan["experts"] = expert_plan(model, layout, params, plan["memory"], plan["compute"]["time"], grads_dp)
    return plan


def _memory(model: Model, layout: Layout, cp: int, params: dict, hw: Hardware) -> dict:
    c = model.shape
    states = layout_states(model, layout, params, layout.dp * cp)
    acts = {rc: context_activation_bytes(c, layout.tp, cp, layout.micro_batch, rc, layout.precision, ep=layout.ep)
            for rc in (False, True)}
    total = states["total"] + acts[layout.recompute]["total"]
    return {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
            "model_states": states["total"], "model_states_fit": states["total"] <= hw.gpu_memory,
            "activations_no_recompute": acts[False], "activations_recompute": acts[True],
            "activations": acts[layout.recompute]["total"],
            "activations_formula": f"one CP rank: the formula at s/{cp} positions with a fused core, + ring buffers",
            "total": total, "fits": total <= hw.gpu_memory, "headroom": hw.gpu_memory - total}


def _compute(model: Model, layout: Layout, cp: int, params: dict, hw: Hardware, train_tokens: Optional[int]) -> dict:
    c = model.shape
    B, s, world = layout.batch, c.seq_length, layout.world_size * cp
    psi = layout_psi(model, layout, params)
    if layout.ep > 1:  # the experts' gradient traffic is added apart (add_expert_time)
        psi -= layout_states(model, layout, params, layout.dp * cp)["experts"]["psi"]
    vocab = c.padded_vocab_size(layout.tp)
    flops = flops_per_iteration(c, B, layout.recompute, vocab)
    model_flops = flops_per_iteration(c, B, False, vocab)
    t = iteration_time(flops=flops, gpus=world, gpu_tflops=hw.gpu_tflops, mfu=hw.mfu,
                       imbalance=rank_flops_imbalance(c, layout.tp), tp=layout.tp, dp=layout.dp * cp,
                       zero_stage=layout.zero_stage, psi=psi, tokens_per_dp_rank=B * s // (layout.dp * cp),
                       hidden=c.hidden_size, layers=c.num_layers, recompute=layout.recompute,
                       act_bytes=4 if layout.precision == "fp32" else 2, grad_bytes=PRECISIONS[layout.precision][1],
                       gpus_per_node=hw.gpus_per_node, intra_gbps=hw.intra_node_gbps, inter_gbps=hw.inter_node_gbps)
    if c.num_experts is not None:
        add_expert_time(t, model, layout, params, layout.dp * cp, cp, hw)
    ring = ring_traffic(c, layout.tp, cp, layout.micro_batch, layout.precision, layout.recompute,
                        B // (layout.micro_batch * layout.dp), hw)
    t.update(ring_s=ring["time_s"], ring_exposed_s=ring["exposed_s"], total_s=t["total_s"] + ring["exposed_s"])
    total = t["total_s"]
    return {"time": t, "ring": ring, "time_per_iteration_s": total, "tokens_per_s": B * s / total,
            "model_tflops_per_gpu": model_flops / total / world / 1e12,
            "model_flops_utilization": model_flops / total / world / (hw.gpu_tflops * 1e12),
            "train_days": train_tokens / (B * s / total) / 86400 if train_tokens else None}


def search_context_parallel(model: Model, gpus: int, hw: Hardware, global_batch: int, precision: str = "fp16",
                            train_tokens: Optional[int] = None, cps: Optional[list[int]] = None) -> dict:
    """Every (CP > 1, TP, ZeRO stage, recomputation) on ``gpus`` GPUs with its largest micro batch that fits."""
    c = model.shape
    cps = cps or [n for n in range(2, gpus + 1) if gpus % n == 0 and c.seq_length % (2 * n) == 0]
    rows: list[dict] = []
    unfit: list[dict] = []
    for dims in ParallelDims.every(gpus, cps=cps, max_tp=c.max_tensor_parallel_size()):
        tp, dp, cp = dims.tp, dims.dp, dims.cp
        if not global_batch % dp:
            params = parameter_report(c, tp, use_meta=False)
            for stage in range(4):
                row = _largest_fitting(model, Layout(tp=tp, dp=dp, zero_stage=stage, global_batch=global_batch,
                                                     precision=precision), hw, cp, train_tokens, params)
                (rows if "reason" not in row else unfit).append(row)
    rows.sort(key=lambda r: (r["cp"], r["tp"], -r["tokens_per_s"]))
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    smallest = min(rows, key=lambda r: (r["cp"], -r["tokens_per_s"])) if rows else None
    return {"gpus": gpus, "layouts": rows, "not_fitting": unfit, "fastest": best, "smallest_cp": smallest}


def _largest_fitting(model, base: Layout, hw, cp, train_tokens, params) -> dict:
    plan = None
    for recompute in (False, True):
        for mb in _divisors_desc(base.batch // base.dp):
            plan = context_plan(model, dataclasses.replace(base, recompute=recompute, micro_batch=mb), hw, cp,
                                train_tokens, params)
            if plan["memory"]["fits"]:
                return dict(_row(plan, params), cp=cp, world_size=plan["layout"]["world_size"],
                            mfu=plan["compute"]["model_flops_utilization"])
    assert plan is not None  # (every batch has a divisor: the loop ran)
    return dict(_row(plan, params), cp=cp, reason=_why_not(plan["memory"]),
                mfu=plan["compute"]["model_flops_utilization"])


def format_context(plan: dict) -> str:
    """The CP lines of one plan: layout, activations per rank, the ring's traffic and time."""
    lay, mem, comp = plan["layout"], plan["memory"], plan["compute"]
    ring, acts = comp["ring"], mem["activations_recompute" if lay["recompute"] else "activations_no_recompute"]
    gb = 1e9
    return "\n".join([
        f"Context parallelism: CP {lay['cp']} (world = TP {lay['tp']} x CP {lay['cp']} x DP {lay['dp']} = "
        f"{lay['world_size']} GPUs; each rank holds 2 chunks of {plan['model']['seq_length'] // (2 * lay['cp'])} "
        f"positions; ZeRO and the gradient reduction span DP x CP = {lay['gradient_reduction_ranks']} ranks)",
        f"  activations per rank {acts['total'] / gb:,.2f} GB (ring buffers {acts['ring_working'] / gb:,.3f} GB)",
        f"  {ring['formula']}",
        f"  ring bytes per layer: forward {ring['forward_bytes_per_layer'] / 1e6:,.1f} MB, backward "
        f"{ring['backward_bytes_per_layer'] / 1e6:,.1f} MB; per iteration {ring['bytes_per_iteration'] / gb:,.2f} GB "
        f"= {ring['time_s']:.3f} s at {ring['bandwidth_gbps']:g} GB/s, {ring['exposed_s']:.3f} s exposed",
    ])


def format_context_search(found: dict) -> str:
    """Per CP size, the fastest layout that fits (and the count of the others)."""
    gb = 1e9
    lines = [f"Context parallel layouts on {found['gpus']} GPUs (TP x CP x DP; fastest per CP; --json lists all)",
             f"  {'CP':>4} {'TP':>3} {'DP':>4} {'ZeRO':>4} {'recomp':>6} {'micro':>5} {'total GB':>9} "
             f"{'tokens/s':>10} {'MFU':>6} {'fitting':>7}"]
    by_cp: dict = {}
    for r in found["layouts"]:
        by_cp.setdefault(r["cp"], []).append(r)
    for cp, rows in sorted(by_cp.items()):
        r = max(rows, key=lambda x: x["tokens_per_s"])
        lines.append(f"  {cp:>4} {r['tp']:>3} {r['dp']:>4} {r['zero_stage']:>4} {'on' if r['recompute'] else 'off':>6} "
                     f"{r['micro_batch']:>5} {r['total'] / gb:>9,.2f} {r['tokens_per_s']:>10,.0f} "
                     f"{100 * r['mfu']:>5.1f}% {len(rows):>7}")
    if not by_cp:
        lines.append("  no CP layout fits")
    return "\n".join(lines)
