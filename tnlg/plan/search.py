"""``--search``: every (tp, dp, ZeRO stage, recomputation, micro batch) that fits, smallest TP first.

TP candidates are 1 .. the largest valid TP (the head count, or the MLP width if
smaller) that divide the GPU count, including TPs that split the heads unevenly
(marked ``uneven``; Megatron rejects them). DP is ``gpus / tp`` and must divide the
global batch. For each (tp, stage, recomputation) the largest micro batch that
divides the per-rank batch and fits is reported (memory grows with the micro
batch, so every smaller one fits too). Rows are ordered by TP, then by predicted
throughput. A ZeRO stage that fits at no micro batch of a TP is reported under
``not_fitting`` at its smallest footprint (micro batch 1, recomputation on) with the
reason, so every (TP, stage) is accounted for. Per-rank counts come from the formula,
which the tests check against meta-device builds.

A mixture of experts adds expert parallelism: at each (tp, dp) every EP that divides both the experts and DP
(or the one EP asked for) is searched, EP > 1 at ZeRO stages 0 and 1 (what tnlg's engine runs with EP); the rows
carry ``ep`` and the table notes it.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import UserError
from ..layout import ParallelDims
from .counts import parameter_report
from .experts import expert_parallel_sizes
from .planner import Hardware, Layout, Model, plan_layout
from .units import GB

__all__ = ["search_layouts"]


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def search_layouts(model: Model, gpus: int, hw: Hardware, global_batch: int, precision: str = "fp16",
                   train_tokens: int | None = None, eps: list[int] | None = None) -> dict:
    """The layouts of ``model`` on ``gpus`` GPUs of ``hw`` that fit, as a JSON-ready dict. ``eps``: the
    expert-parallel sizes to try (default: every one that divides the experts and DP; 1 for a dense model)."""
    if model.abstract:
        raise UserError("--search needs a model shape (--preset or --num-layers/--hidden-size/"
                        "--num-attention-heads): with --params alone the heads, and so the valid "
                        "tensor-parallel sizes and the activation memory, are unknown.")
    if gpus < 1:
        raise UserError(f"--world-size must be a positive number of GPUs, got {gpus}.")
    c = model.shape
    rows, not_fitting, skipped = [], [], []
    for dims in ParallelDims.every(gpus, max_tp=c.max_tensor_parallel_size()):
        tp, dp = dims.tp, dims.dp
        if global_batch % dp:
            skipped.append({"tp": tp, "dp": dp, "reason": f"DP {dp} does not divide the global batch {global_batch}"})
            continue
        params = parameter_report(c, tp, use_meta=False)
        for ep in [n for n in (eps or expert_parallel_sizes(c, dp)) if n in expert_parallel_sizes(c, dp)]:
            base = Layout(tp=tp, dp=dp, global_batch=global_batch, precision=precision, ep=ep)
            fit, unfit = _search_tp(model, base, hw, train_tokens, params)
            rows += fit
            not_fitting += unfit
            if not fit:
                skipped.append({"tp": tp, "dp": dp, **({"ep": ep} if ep > 1 else {}),
                                "reason": "no ZeRO stage, recomputation or micro batch fits"})
    rows.sort(key=lambda r: (r["tp"], -r["tokens_per_s"]))
    best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    return {"model": model.describe(), "gpus": gpus, "global_batch": global_batch, "precision": precision,
            "hardware": vars(hw).copy(), "layouts": rows, "not_fitting": not_fitting, "skipped": skipped,
            "fastest": best, "smallest_tp": rows[0]["tp"] if rows else None}


def _search_tp(model: Model, base: Layout, hw: Hardware, train_tokens: int | None,
               params: dict) -> tuple[list[dict], list[dict]]:
    """At one (tp, dp): per ZeRO stage and recomputation the largest micro batch that fits; and
    per ZeRO stage where nothing fits, its smallest footprint (micro batch 1, recomputation on)
    with the reason."""
    fit, unfit = [], []
    local = base.batch // base.dp
    for stage in range(4) if base.ep == 1 else range(2):  # (expert parallelism: tnlg's flat ZeRO 0/1 buffers)
        found = False
        for recompute in (False, True):
            for mb in _divisors_desc(local):
                layout = replace(base, zero_stage=stage, recompute=recompute, micro_batch=mb)
                plan = plan_layout(model, layout, hw, train_tokens, params=params)
                if plan["memory"]["fits"]:
                    fit.append(_row(plan, params))
                    found = True
                    break
        if not found:  # ``plan`` is the last one tried: micro batch 1 with recomputation, the smallest
            unfit.append(dict(_row(plan, params), reason=_why_not(plan["memory"])))
    return fit, unfit


def _why_not(mem: dict) -> str:
    gpu = f"{mem['gpu_memory'] / GB:,.2f} GB"
    if not mem["model_states_fit"]:
        return f"model states alone {mem['model_states'] / GB:,.2f} GB > {gpu}"
    return f"{-mem['headroom'] / GB:,.2f} GB over {gpu} even at micro batch 1 with recomputation"


def _row(plan: dict, params: dict) -> dict:
    lay, mem, comp = plan["layout"], plan["memory"], plan["compute"]
    return {"tp": lay["tp"], "dp": lay["dp"], "ep": lay.get("ep", 1), "zero_stage": lay["zero_stage"],
            "recompute": lay["recompute"],
            "micro_batch": lay["micro_batch"], "grad_accumulation_steps": lay["grad_accumulation_steps"],
            "uneven": params["uneven"], "heads_per_rank": params["heads_per_rank"], "megatron_can_run": lay["megatron_can_run"],
            "imbalance_percent": params["imbalance_percent"],
            "largest_rank_params": params["largest_rank"]["params"],
            "model_states": mem["model_states"], "activations": mem["activations"], "total": mem["total"],
            "headroom": mem["headroom"], "time_per_iteration_s": comp["time_per_iteration_s"],
            "tokens_per_s": comp["tokens_per_s"], "model_tflops_per_gpu": comp["model_tflops_per_gpu"],
            "train_days": comp["train_days"]}
