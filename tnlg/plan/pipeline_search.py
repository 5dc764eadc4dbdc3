"""``--search`` with pipelines: every TP x CP x PP x DP layout (PP > 1) of a world size that fits, fastest first.

Candidates: every PP that divides the GPU count and is at most the layer count (or the one ``--pp``
given), every TP from 1 to the largest valid TP (the head count, or the MLP width if smaller)
that divides GPUs / (PP x CP), uneven head splits included and marked, per context-parallel size CP (1,
or each of ``cps``: ``2 CP`` dividing the sequence; :func:`.pipeline.pipeline_plan` of one CP rank); DP =
GPUs / (TP x CP x PP) must divide the global batch. Per layout ZeRO stages 0 to 3 (tnlg's pipelines run all four; under torch's schedules
ZeRO 2 and 3 keep the stage's unsharded parameters and gradients through the step, so they never fit
where ZeRO 1 does not, and ZeRO 3 all-gathers per micro batch: :mod:`.pipeline`) with recomputation off and on, at the largest micro batch that leaves
at least PP micro batches per step (and, interleaved, a whole number of rounds) and whose heaviest pipeline rank fits the GPU:
its model states + activations in flight + receive buffers (:func:`.pipeline.pipeline_plan`),
what the planner counts without a pipeline beside what the schedule adds. Time, throughput and
MFU from :func:`.pipeline.pipeline_time` (the bubble included). A (TP, PP) where nothing fits is
reported under ``not_fitting`` at its smallest footprint (ZeRO 1, recomputation on, micro batch 1)
with the reason, so no layout that does not fit is ranked and every (TP, PP) is accounted for.
"""

from __future__ import annotations

from typing import Optional

from ..config import divisors
from ..errors import UserError
from ..layout import ParallelDims
from .pipeline import parameter_table, pipeline_plan, pipeline_time
from .planner import Hardware, Model
from .report import heads_compact
from .units import GB

__all__ = ["search_pipelines", "format_pipeline_search", "check_search_pipeline"]


def search_pipelines(model: Model, gpus: int, hw: Hardware, global_batch: int, precision: str = "fp16",
                     train_tokens: int | None = None, pp: int | None = None,
                     layers_per_chunk: int | None = None, cps: list[int] | None = None) -> dict:
    """Every fitting TP x CP x PP x DP layout with PP > 1 (``pp``: only that one; ``cps``: the CP sizes, default
    1) as a JSON-ready dict."""
    c = model.shape
    schedule = "interleaved" if layers_per_chunk else "1f1b"
    sizes = [pp] if pp is not None else [p for p in divisors(gpus) if 1 < p <= c.num_layers]
    rows, not_fitting, skipped = [], [], []
    for p in sizes:
        virtual = 1
        if layers_per_chunk:
            if c.num_layers % (p * layers_per_chunk):
                skipped.append(dict(pp=p, reason=f"{layers_per_chunk} layers per chunk do not divide the "
                                                 f"{c.num_layers / p:g} layers per stage"))
                continue
            virtual = c.num_layers // (p * layers_per_chunk)
        fitting_cps = [n for n in (cps or [1]) if c.seq_length % (2 * n) == 0]
        for dims in ParallelDims.every(gpus, [p], fitting_cps, max_tp=c.max_tensor_parallel_size()):
            tp, dp, cp = dims.tp, dims.dp, dims.cp
            reason = (f"DP {dp} does not divide the global batch {global_batch}" if global_batch % dp else
                      f"{global_batch // dp} sequences per DP rank are fewer than the {p} stages"
                      if global_batch // dp < p else None)
            if reason:
                skipped.append(dict(tp=tp, pp=p, dp=dp, cp=cp, reason=reason))
                continue
            fit, smallest = _search_layout(model, hw, tp, p, dp, global_batch, precision, train_tokens,
                                           schedule, virtual, cp)
            rows += fit
            if not fit:
                not_fitting.append(smallest)
    rows.sort(key=lambda r: -r["tokens_per_s"])
    return {"gpus": gpus, "global_batch": global_batch, "precision": precision, "schedule": schedule,
            "layers_per_chunk": layers_per_chunk, "layouts": rows, "not_fitting": not_fitting, "skipped": skipped,
            "fastest": rows[0] if rows else None}


def _search_layout(model: Model, hw: Hardware, tp: int, pp: int, dp: int, global_batch: int, precision: str,
                   train_tokens, schedule: str, virtual: int, cp: int = 1) -> tuple[list[dict], Optional[dict]]:
    """At one (TP, PP, DP): per ZeRO stage (0-3) and recomputation the largest micro batch that fits;
    and the smallest footprint (ZeRO 1, recomputation on, micro batch 1) with why it does not fit."""
    c, local = model.shape, global_batch // dp
    table = parameter_table(c, tp)
    fit, smallest = [], None
    for zero in range(4):
        for recompute in (False, True):
            for mb in [b for b in reversed(divisors(local)) if local // b >= pp]:
                m = local // mb
                if schedule == "interleaved" and m % max(1, m // pp):
                    continue  # torch's interleaved schedule runs whole rounds
                plan = pipeline_plan(c, tp, pp, dp, zero, precision, mb, m, recompute, schedule, virtual, table=table,
                                     cp=cp)
                row = _row(model, hw, plan, tp, pp, dp, zero, recompute, mb, precision, train_tokens)
                if row["total"] <= hw.gpu_memory:
                    fit.append(row)
                    break
                if (zero, recompute, mb) == (1, True, 1):
                    smallest = row
    if smallest is not None:
        states = smallest["model_states"]
        smallest["reason"] = (f"model states alone {states / GB:,.2f} GB > {hw.gpu_memory / GB:,.2f} GB"
                              if states > hw.gpu_memory else
                              f"{(smallest['total'] - hw.gpu_memory) / GB:,.2f} GB over {hw.gpu_memory / GB:,.2f} "
                              f"GB even at micro batch 1 with recomputation")
    return fit, smallest


def _row(model: Model, hw: Hardware, plan: dict, tp: int, pp: int, dp: int, zero: int, recompute: bool, mb: int,
         precision: str, train_tokens) -> dict:
    c = model.shape
    heavy = plan["stages"][plan["heaviest"]]
    t = pipeline_time(c, plan, hw, tp, dp, zero, precision, mb, recompute, train_tokens)
    heads = c.heads_per_rank(tp)
    return {"tp": tp, "cp": plan["cp"], "pp": pp, "dp": dp, "schedule": plan["schedule"], "virtual": plan["virtual"],
            "zero_stage": zero, "recompute": recompute, "micro_batch": mb, "micro_batches": plan["micro_batches"],
            "bubble": plan["bubble"], "heads_per_rank": heads, "uneven": len(set(heads)) > 1,
            "heaviest_stage": heavy["stage"], "model_states": heavy["model_states"],
            "activations": heavy["activations"], "buffers": heavy["buffers"], "total": heavy["total"],
            "headroom": hw.gpu_memory - heavy["total"], "time_per_iteration_s": t["time_per_iteration_s"],
            "tokens_per_s": t["tokens_per_s"], "model_tflops_per_gpu": t["model_tflops_per_gpu"],
            "model_flops_utilization": t["model_flops_utilization"], "train_days": t["train_days"]}


PIPELINE_HEADER = (f"{'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'heads':>8} {'zero':>4} {'recomp':>6} {'mb':>3} {'m':>4} "
                   f"{'bubble':>6} {'states GB':>9} {'acts GB':>8} {'bufs GB':>7} {'total GB':>8} {'s/iter':>7} "
                   f"{'tokens/s':>9} {'TFLOP/s':>7} {'days':>6}  note")


def _pipeline_row(r: dict) -> str:
    if "reason" in r:
        timing, note = f"{'-':>7} {'-':>9} {'-':>7} {'-':>6}", f"does NOT fit: {r['reason']}"
    else:
        days = f"{r['train_days']:.1f}" if r["train_days"] is not None else "-"
        timing = (f"{r['time_per_iteration_s']:>7.2f} {r['tokens_per_s']:>9,.0f} {r['model_tflops_per_gpu']:>7.1f} "
                  f"{days:>6}")
        note = f"heaviest stage {r['heaviest_stage']}"
    if r["uneven"]:
        note += "; uneven heads"
    return (f"{r['tp']:>3} {r['cp']:>3} {r['pp']:>3} {r['dp']:>4} {heads_compact(r['heads_per_rank']):>8} {r['zero_stage']:>4} "
            f"{'on' if r['recompute'] else 'off':>6} {r['micro_batch']:>3} {r['micro_batches']:>4} "
            f"{r['bubble']:>6.1%} {r['model_states'] / GB:>9,.2f} {r['activations'] / GB:>8,.2f} "
            f"{r['buffers'] / GB:>7,.2f} {r['total'] / GB:>8,.2f} {timing}  {note}")


def format_pipeline_search(result: dict, without: dict | None = None) -> str:
    """The pipeline table: per (TP, PP) its fastest fitting layout, fastest first, then the (TP, PP) where
    nothing fits; ``without``: the PP = 1 search, for the line naming the fastest of all."""
    sched = (f"interleaved, {result['layers_per_chunk']} layers per chunk" if result["layers_per_chunk"]
             else "1f1b")
    lines = [f"with a pipeline (PP > 1, {sched}; ZeRO 0-3, where 2 and 3 keep the stage's unsharded parameters and gradients): per TP x CP x PP the fastest "
             f"layout that fits, fastest first; m: micro batches per step; memory: the heaviest pipeline rank's "
             f"model states, activations in flight and receive buffers (--json lists every fitting layout)",
             "", PIPELINE_HEADER]
    best, seen = [], set()
    for r in result["layouts"]:
        if (r["tp"], r["cp"], r["pp"]) not in seen:
            seen.add((r["tp"], r["cp"], r["pp"]))
            best.append(r)
    lines += [_pipeline_row(r) for r in best + sorted(result["not_fitting"], key=lambda r: (r["pp"], r["cp"], r["tp"]))]
    b = result["fastest"]
    if b is None:
        lines += ["", "No pipeline layout fits."]
    else:
        lines += ["", f"fastest with a pipeline: {_describe(b)}"]
        if without is not None and without.get("fastest") and without["fastest"]["tokens_per_s"] > b["tokens_per_s"]:
            lines.append("fastest of all: the layout without a pipeline above")
        elif without is not None:
            lines.append("fastest of all: this pipeline layout")
    lines += [f"skipped {'TP %d x ' % s['tp'] if 'tp' in s else ''}{'CP %d x ' % s['cp'] if s.get('cp', 1) > 1 else ''}PP {s['pp']}{' x DP %d' % s['dp'] if 'dp' in s else ''}"
              f": {s['reason']}" for s in result["skipped"]]
    return "\n".join(lines)


def _describe(r: dict) -> str:
    cp = f"CP {r['cp']} x " if r["cp"] > 1 else ""
    return (f"TP {r['tp']} x {cp}PP {r['pp']} x DP {r['dp']}, ZeRO {r['zero_stage']}, recomputation "
            f"{'on' if r['recompute'] else 'off'}, micro batch {r['micro_batch']} x {r['micro_batches']} per step, "
            f"bubble {r['bubble']:.1%} ({r['tokens_per_s']:,.0f} tokens/s, {r['model_tflops_per_gpu']:.1f} model "
            f"TFLOP/s per GPU)")


def check_search_pipeline(model: Model, gpus: int, pp: int | None) -> None:
    """A clear :class:`UserError` for a ``--pp`` the search cannot lay out on ``gpus`` GPUs."""
    if pp is None or pp == 1:
        return
    c = model.shape
    valid = [p for p in divisors(gpus) if p <= c.num_layers]
    if pp < 1 or gpus % pp or pp > c.num_layers:
        raise UserError(f"--pipeline-model-parallel-size {pp} cannot lay out {c.num_layers} layers on --world-size "
                        f"{gpus}: the world is PP x TP x DP, so PP must divide the GPU count, and every stage needs "
                        f"at least one layer. Valid pipeline sizes for {gpus} GPUs and {c.num_layers} layers: "
                        f"{valid}.")
