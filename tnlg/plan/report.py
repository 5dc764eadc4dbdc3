"""Readable tables for a plan and a search (GB = 1e9 bytes, as in the ZeRO paper)."""

from __future__ import annotations

from collections import Counter

from .units import GB, format_count

__all__ = ["format_plan", "format_search", "format_simulation", "format_stage_simulations", "heads_compact", "search_head"]


def _gb(n: float) -> str:
    return f"{n / GB:,.2f}"


def _model_line(m: dict) -> str:
    if m["kind"] == "abstract":
        return f"{m['name']}: abstract model of {m['params']:,} parameters (seq {m['seq_length']})"
    return (f"{m['name']}: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
            f"ffn {m['ffn_hidden_size']}, seq {m['seq_length']}, vocab {m['vocab_size']}")


def _heads_split(heads: list[int]) -> str:
    counts = Counter(heads)
    return ", ".join(f"{h} head{'s' if h > 1 else ''} x {n} rank{'s' if n > 1 else ''}"
                     for h, n in sorted(counts.items(), reverse=True))


def _parameters(p: dict, tp: int) -> list[str]:
    lines = [f"Parameters ({p['source']})",
             f"  total                {p['total']:>16,}   formula {p['total_formula']:,}"]
    if p.get("active") is not None:  # a mixture of experts: what a token runs through (FLOPs count these)
        lines.append(f"  active per token     {p['active']:>16,}   (every dense part, the router, the shared expert "
                     f"and the top-k experts)")
    if p["padded_vocab_size"] is not None:
        lines.append(f"  with padding         {p['total_padded']:>16,}   (vocab padded to {p['padded_vocab_size']})")
        lines.append(f"  replicated per rank  {p['replicated_per_rank']:>16,}   (LayerNorms, row-parallel biases, "
                     f"position embedding)")
    if tp > 1 and p["heads_per_rank"] is not None:
        lines.append(f"  heads per rank       {_heads_split(p['heads_per_rank'])}"
                     + ("  (uneven: Megatron cannot run this TP)" if p["uneven"] else ""))
        formula = p["formula_per_rank"]
        ranks = range(tp) if tp <= 8 else sorted({p["largest_rank"]["rank"], p["smallest_rank"]["rank"]})
        lines.append(f"  {'rank':>6} {'heads':>6} {'params':>16} {'formula':>16}")
        for r in ranks:
            lines.append(f"  {r:>6} {p['heads_per_rank'][r]:>6} {p['per_rank'][r]['params']:>16,} "
                         f"{formula[r]['params']:>16,}")
        if tp > 8:
            lines.append(f"  ({tp - len(ranks)} other ranks not shown; --json lists all)")
    lg, sm = p["largest_rank"], p["smallest_rank"]
    if lg["params"] == sm["params"]:
        lines.append(f"  per rank             {lg['params']:>16,}   ({format_count(lg['params'])}; all {tp} ranks equal)")
        return lines
    lines.append(f"  largest rank {lg['rank']}: {lg['params']:,} ({format_count(lg['params'])}, sets the memory "
                 f"bound); smallest rank {sm['rank']}: {sm['params']:,}; imbalance {p['imbalance_percent']:.1f}% "
                 f"(largest / mean - 1)")
    return lines


def _memory(m: dict, lay: dict) -> list[str]:
    stage = lay["zero_stage"]
    dp = lay.get("gradient_reduction_ranks", lay["dp"])  # with context parallelism: DP x CP
    def split(on: bool) -> str:
        return f"/ {dp} {'DP x CP' if dp != lay['dp'] else 'DP'} ranks" if on and dp > 1 else ""

    def row(label: str, value: float, note: str = "") -> str:
        return f"  {label:<26}{_gb(value):>10}  {note}".rstrip()
    lines = ["Memory per GPU, largest rank (GB = 1e9 bytes)" + (f"; EP {lay['ep']}: dense parameters over the "
                                                                 f"DP ranks, the experts' over DP / EP"
                                                                 if lay.get("ep", 1) > 1 else ""),
             f"  model states: {m['model_states_formula']}",
             row(f"parameters ({lay['precision']})", m["params"], split(stage >= 3)),
             row("gradients", m["grads"], split(stage >= 2)),
             row(f"optimizer states (K={m['k']})", m["optimizer"], split(stage >= 1)),
             row("model states", m["model_states"],
                 f"{'fit' if m['model_states_fit'] else 'do NOT fit'} alone in {_gb(m['gpu_memory'])} GB")]
    if m["activations_no_recompute"] is not None:
        rc, no = m["activations_recompute"], m["activations_no_recompute"]
        on = lay["recompute"]
        lines += [row("activations", m["activations"],
                      f"micro batch {lay['micro_batch']}, recomputation {'on' if on else 'off'} "
                      f"({_gb((no if on else rc)['total'])} GB with it {'off' if on else 'on'})"),
                  f"    activations: {m['activations_formula']}"]
    else:
        lines.append(f"  {'activations':<26}{'n/a':>10}  ({m['activations_note']})")
    verdict = (f"fits, {_gb(m['headroom'])} GB to spare" if m["fits"]
               else f"does NOT fit: {_gb(-m['headroom'])} GB over")
    lines.append(row("total", m["total"], f"of {_gb(m['gpu_memory'])} GB: {verdict}"))
    return lines


def _compute(c: dict, lay: dict) -> list[str]:
    t = c["time"]
    lines = ["Compute",
             f"  FLOPs: {c['formula']}",
             f"  FLOPs per iteration  {c['flops_per_iteration']:.3e}  ({c['tokens_per_iteration']:,} tokens)",
             f"  time per iteration   {c['time_per_iteration_s']:.3f} s at {c['gpu_tflops']:g} TFLOP/s x "
             f"{c['mfu_assumed']:.2f} per GPU: compute {t['compute_s']:.3f} s"
             + (f" (slowest rank x{c['rank_imbalance_factor']:.3f})" if c["rank_imbalance_factor"] > 1 else "")
             + f" + TP comm {t['tp_comm_s']:.3f} s + DP comm {t['dp_comm_s']:.3f} s"
             + (f" + all-to-all {t['ep_comm_s']:.3f} s" if t.get("ep_comm_s") else "") + " (no overlap assumed)",
             f"  throughput           {c['tokens_per_s']:,.0f} tokens/s; {c['model_tflops_per_gpu']:.1f} model "
             f"TFLOP/s per GPU (MFU {100 * c['model_flops_utilization']:.1f}%)"]
    if c["train_days"] is not None:
        lines.append(f"  training             {c['train_days']:.1f} days for {c['train_tokens']:.3g} tokens "
                     f"on {_gpus(lay['world_size'])}")
    return lines


def _experts(e: dict, lay: dict) -> list[str]:
    """The mixture-of-experts lines: the experts per rank at EP and their states, the MoE layers' activations
    (even routing) and the all-to-all of a step."""
    ep, states, acts, a2a = e["ep"], e["expert_states"], e["moe_mlp_activations"], e["all_to_all"]
    edp = e["expert_data_parallel_ranks"]
    lines = [f"Experts: {e['num_experts']} per MoE layer x {e['moe_layers']} layers, top-{e['topk']}; EP {ep}: "
             f"{e['experts_per_rank']} expert{'s' if e['experts_per_rank'] > 1 else ''} per rank, their gradients and optimizer states over {edp} "
             f"expert-data-parallel rank{'s' if edp > 1 else ''} (DP{' x CP' if lay.get('cp', 1) > 1 else ''} / EP)",
             f"  {e['formula']}",
             f"  parameters per rank at EP {ep} {e['parameters']['largest_rank']['params']:>14,}   (dense "
             f"{e['parameters']['largest_rank']['dense']:,} + experts {e['expert_params']:,}; the experts' model "
             f"states {_gb(states['total'])} GB, included above)"]
    if acts is not None:
        lines.append(f"  MoE MLP activations per layer and micro batch {_gb(acts['total'])} GB: {acts['copies']:,} routed "
                     f"copies {_gb(acts['routed'])} GB, router {_gb(acts['router'])} GB, shared expert "
                     f"{_gb(acts['shared'])} GB")
    lines.append(f"  routing: {e['routing']}")
    if a2a is not None and ep > 1:
        lines.append(f"  all-to-all per iteration {_gb(a2a['bytes_per_iteration'])} GB sent to other EP ranks "
                     f"({a2a['all_to_alls_per_layer']} all-to-alls per MoE layer and micro batch: dispatch "
                     f"{a2a['dispatch_bytes'] / 1e6:,.1f} MB, combine {a2a['combine_bytes'] / 1e6:,.1f} MB) = "
                     f"{a2a['time_s']:.3f} s at {a2a['bandwidth_gbps']:g} GB/s")
    return lines


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def _tp_needed(n: dict, lay: dict, heads: int, gpu_memory: int) -> list[str]:
    """The smallest TPs that fit, as sentences (``None`` in ``n``: no TP up to the head count is enough)."""
    world, stage = lay["world_size"], lay["zero_stage"]
    any_, even, on_world = n["plain_dp_any"], n["plain_dp_even"], n["plain_dp_world"]
    dividing = f"that divides {_gpus(world)}"
    if any_ is None:
        plain = f"they fit at no TP up to the head count ({heads})."
    else:
        clauses = [f"from TP {any_}" + (" (heads split unevenly)" if heads % any_ else "")]
        if even != any_:
            clauses.append(f"from TP {even} with the {heads} heads split evenly (as Megatron requires)" if even
                           else f"at no TP with the {heads} heads split evenly (as Megatron requires)")
        if on_world is None:
            clauses.append(f"at no TP {dividing}" if world > 1 else "not on 1 GPU")
        elif on_world not in (any_, even):
            clauses.append(f"from TP {on_world} among the sizes that divide {_gpus(world)}")
        joined = clauses[0] if len(clauses) == 1 else ", ".join(clauses[:-1]) + ("," if len(clauses) > 2 else "") \
            + (" but " if on_world is None else " and ") + clauses[-1]
        plain = f"they fit {joined}."
    lines = [f"Tensor parallelism needed: the smallest TP at which the largest rank fits one {_gb(gpu_memory)} GB "
             f"GPU (per-rank formula)",
             f"  Without ZeRO (plain data parallelism), the model states alone: {plain}"]

    def verdict(t) -> str:
        if world == 1:
            return "they fit on 1 GPU." if t is not None else "they do not fit on 1 GPU."
        return f"TP {t} is the smallest TP {dividing} and fits." if t is not None else f"no TP {dividing} fits."

    if stage > 0:
        dp = f" (DP = {world} / TP)" if world > 1 else ""
        lines.append(f"  With ZeRO stage {stage} on {_gpus(world)}{dp}, the model states: "
                     + verdict(n["this_stage_world"]))
    lines.append(f"  With this layout's activations as well (micro batch {lay['micro_batch']}, recomputation "
                 f"{'on' if lay['recompute'] else 'off'}): " + verdict(n["this_layout_with_activations"]))
    return lines


def format_plan(plan: dict) -> str:
    """The table for one layout."""
    lay = plan["layout"]
    head = [f"tnlg plan: {_model_line(plan['model'])}",
            f"layout: TP {lay['tp']} x DP {lay['dp']} = {_gpus(lay['world_size'])}, ZeRO stage {lay['zero_stage']}, "
            f"micro batch {lay['micro_batch']}, global batch {lay['global_batch']} "
            f"(accumulation steps: {lay['grad_accumulation_steps']}), recomputation "
            f"{'on' if lay['recompute'] else 'off'}, {lay['precision']}"]
    if lay.get("source"):
        head.append(f"        ({lay['source']})")
    head.append("")
    body = _parameters(plan["parameters"], lay["tp"]) + [""] + _memory(plan["memory"], lay) + [""]
    body += _compute(plan["compute"], lay)
    if plan.get("experts"):
        body += [""] + _experts(plan["experts"], lay)
    if plan.get("tp_needed"):
        body += [""] + _tp_needed(plan["tp_needed"], lay, plan["model"]["num_attention_heads"],
                                  plan["memory"]["gpu_memory"])
    return "\n".join(head + body)


def heads_compact(heads: list[int]) -> str:
    """``[4, 4, 4, 4, 3, 3, 3, 3]`` -> ``4x4,3x4`` (heads per rank x ranks)."""
    return ",".join(f"{h}x{n}" for h, n in sorted(Counter(heads).items(), reverse=True))


SEARCH_HEADER = (f"{'tp':>3} {'dp':>5} {'heads':>8} {'zero':>4} {'recomp':>6} {'mb':>4} {'accum':>5} "
                 f"{'states GB':>9} {'acts GB':>8} {'total GB':>8} {'s/iter':>7} {'tokens/s':>9} {'TFLOP/s':>7} "
                 f"{'days':>6}  note")


def _search_row(r: dict) -> str:
    """One row of the search table; a row with a ``reason`` does not fit and has no time."""
    uneven = f"uneven ({r['imbalance_percent']:.1f}% imbalance; not in Megatron)" if r["uneven"] else ""
    if r.get("ep", 1) > 1:  # expert parallelism (a mixture of experts)
        uneven = "; ".join(filter(None, [f"EP {r['ep']}", uneven]))
    if "reason" in r:
        timing, note = f"{'-':>7} {'-':>9} {'-':>7} {'-':>6}", "; ".join(filter(None, [
            f"does NOT fit: {r['reason']}", uneven]))
    else:
        days = f"{r['train_days']:.1f}" if r["train_days"] is not None else "-"
        timing = (f"{r['time_per_iteration_s']:>7.2f} {r['tokens_per_s']:>9,.0f} {r['model_tflops_per_gpu']:>7.1f} "
                  f"{days:>6}")
        note = uneven
    heads = heads_compact(r["heads_per_rank"]) if r.get("heads_per_rank") else "-"
    return (f"{r['tp']:>3} {r['dp']:>5} {heads:>8} {r['zero_stage']:>4} {'on' if r['recompute'] else 'off':>6} "
            f"{r['micro_batch']:>4} {r['grad_accumulation_steps']:>5} {_gb(r['model_states']):>9} "
            f"{_gb(r['activations']):>8} {_gb(r['total']):>8} {timing}  {note}").rstrip()


def search_head(result: dict) -> list[str]:
    """The lines above the search tables: the model, the GPUs, the batch and how to read the rows."""
    hw = result["hardware"]
    lines = [f"tnlg plan --search: {_model_line(result['model'])}",
             f"{result['gpus']} GPUs x {_gb(hw['gpu_memory'])} GB, global batch {result['global_batch']}, "
             f"{result['precision']}, {hw['gpu_tflops']:g} TFLOP/s x {hw['mfu']:.2f} per GPU; micro batch: the "
             f"largest that fits (smaller ones fit too); GB = 1e9 bytes",
             "heads: attention heads per rank x ranks; a ZeRO stage that fits at no micro batch is shown at its "
             "smallest (micro batch 1, recomputation on) with the reason"]
    if result.get("source"):
        lines.append(f"({result['source']})")
    return lines


def format_search(result: dict) -> str:
    """The table of layouts, smallest TP first: per TP the ones that fit, fastest first, then per
    ZeRO stage that fits at no micro batch its smallest footprint and why it does not fit."""
    lines = search_head(result) + [""]
    unfit = result.get("not_fitting", [])
    if result["layouts"] or unfit:
        lines.append(SEARCH_HEADER)
        for tp in sorted({r["tp"] for r in result["layouts"] + unfit}):
            lines += [_search_row(r) for r in result["layouts"] + unfit if r["tp"] == tp]
    if not result["layouts"]:
        lines += ["", "No layout fits."]
    else:
        b = result["fastest"]
        lines += ["", f"smallest TP that fits: {result['smallest_tp']}; fastest predicted: TP {b['tp']} x DP {b['dp']}, "
                      f"ZeRO {b['zero_stage']}, recomputation {'on' if b['recompute'] else 'off'}, micro batch "
                      f"{b['micro_batch']} ({b['tokens_per_s']:,.0f} tokens/s)"]
    for s in result["skipped"]:
        lines.append(f"skipped TP {s['tp']} x DP {s['dp']}{' x EP ' + str(s['ep']) if 'ep' in s else ''}: "
                     f"{s['reason']}")
    return "\n".join(lines)


def _phase_rows(phases: list[dict]) -> list[str]:
    """One line per simulated phase: bytes live at the start and at the peak (by kind), traffic, FLOPs,
    collectives and predicted time."""
    lines = [f"  {'phase':<24}{'start GB':>9}{'peak GB':>9}{'acts':>7}{'temps':>7}{'TFLOP':>8}{'read GB':>9}"
             f"{'write GB':>9}  {'comm GB (group)':<22}{'ms':>8}"]
    for p in phases:
        k = p["peak_by_kind"]
        comm = ", ".join(f"{v / 1e9:.2f} ({g})" for g, v in p["comm_bytes"].items() if v) or "-"
        name = p["name"] + (f" x{p['count']}" if p.get("count", 1) > 1 else "")
        lines.append(f"  {name:<24}{_gb(p['live_start_bytes']):>9}{_gb(p['peak_bytes']):>9}"
                     f"{_gb(k.get('activations', 0)):>7}{_gb(k.get('temporaries', 0)):>7}{p['flops'] / 1e12:>8.1f}"
                     f"{p['read_bytes'] / 1e9:>9.1f}{p['written_bytes'] / 1e9:>9.1f}  {comm:<22}"
                     f"{p['total_s'] * 1e3:>8.1f}")
    return lines


def format_stage_simulations(plan: dict) -> str:
    """``--pp P --simulate``: the first and the last stage's simulated phases, each stage's peak beside the
    planner's total for that stage, and which is larger."""
    sims = plan["simulation"]
    lines = []
    for sim in sims["stages"]:
        planned = plan["stages"][sim["stage"]]["total"]
        diff = (planned - sim["peak_bytes"]) / sim["peak_bytes"]
        lines += [f"Simulation of pipeline stage {sim['stage']}'s first rank ({sim['simulated_in_s']:.0f} s on fake "
                  f"tensors; 1F1B order, {sim['in_flight']} micro batches in flight; GB = 1e9 bytes)",
                  *_phase_rows(sim["phases"]),
                  f"  peak of stage {sim['stage']}      {_gb(sim['peak_bytes'])} GB in {sim['peak_phase']} (planner: "
                  f"{_gb(planned)} GB, {diff:+.1%}); setup {_gb(sim['setup_peak_bytes'])} GB", ""]
    top = next(s for s in sims["stages"] if s["stage"] == sims["larger"])
    lines += [f"  the larger: stage {top['stage']}, {_gb(top['peak_bytes'])} GB",
              "  note: torch's schedule is not run (its point-to-point warm-up reads data a fake process group does "
              "not move): its 1F1B order is; send/recv traffic and the checkpoint save are not simulated"]
    return "\n".join(lines)


def format_simulation(sim: dict, planned_total: float) -> str:
    """The simulation's table: per phase bytes live at the start and at the peak (by kind), traffic,
    FLOPs, collectives and predicted time; then the step's peak beside the planner's total."""
    lay = sim["layout"]
    lines = [f"Simulation of rank 0 ({sim['simulated_in_s']:.0f} s on fake tensors; GB = 1e9 bytes; "
             f"accumulation micro steps counted x{lay['accum'] - 1})" if lay["accum"] > 1 else
             f"Simulation of rank 0 ({sim['simulated_in_s']:.0f} s on fake tensors; GB = 1e9 bytes)"]
    lines += _phase_rows(sim["phases"])
    diff = (planned_total - sim["peak_bytes"]) / sim["peak_bytes"]
    lines += [f"  peak per rank          {_gb(sim['peak_bytes'])} GB in {sim['peak_phase']} (planner: "
              f"{_gb(planned_total)} GB, {diff:+.1%})",
              f"  predicted on {sim['gpu']}: {sim['step_time_s']:.3f} s per iteration, MFU "
              f"{sim['mfu']:.1%} of the 16-bit spec ({sim['tokens_per_rank'] / sim['step_time_s']:,.0f} tokens/s "
              f"per rank)"]
    lines += [f"  note: {n}" for n in sim["notes"]]
    return "\n".join(lines)
