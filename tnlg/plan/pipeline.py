"""What a pipeline costs per stage: parameters and model states, activations in flight, the bubble.

Per stage ``i`` of ``P`` (TP rank 0, the largest shard): its parameters from the GPT's own
description of every shard (:meth:`tnlg.GPT.describe`), filtered to the stage's layers, plus the
embeddings on the first stage and the final LayerNorm and LM head (the tied embedding's copy) on
the last, exactly what :class:`tnlg.parallel.pipeline.StageModel` builds; model states from
:func:`.memory.model_state_bytes`. Activations: 1F1B keeps at most ``min(m, P - i)`` micro batches
in flight on stage ``i`` (stage 0 the most; GPipe all ``m``), each holding its layers' share of
:func:`.memory.activation_bytes` (the logits only on the last stage). Bubble: the fraction of a
step a stage idles, ``(P - 1) / (m + P - 1)`` for 1F1B and GPipe, divided by ``v`` for the
interleaved schedule (Narayanan et al. 2021). Point-to-point: one ``[b, s, h]`` activation per
micro batch and stage boundary forward, its gradient backward.
"""

from __future__ import annotations

import math
from typing import Optional

from ..config import GPTConfig, stage_layer_counts
from .memory import activation_bytes, model_state_bytes

__all__ = ["bubble_fraction", "stage_parameters", "pipeline_plan", "format_pipeline"]


def bubble_fraction(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """``(P - 1) / (m + P - 1)``, divided by ``v`` for interleaving."""
    return (stages - 1) / (micro_batches + stages - 1) / virtual


def stage_parameters(config: GPTConfig, tp: int, layers: range, first: bool, last: bool) -> int:
    """Parameters of TP rank 0 of a stage holding ``layers`` (and the embeddings / LM head)."""
    from ..model import GPT  # deferred: imports torch
    ends = (("transformer.wte.", "transformer.wpe.") if first else ()) + (
        ("transformer.ln_f.", "lm_head." if config.untie_embeddings_and_output_weights else "transformer.wte.")
        if last else ())
    n = 0
    for name, spec in GPT.describe(config, tp).items():
        block = name.split(".")[2] if name.startswith("transformer.h.") else None
        if name.startswith(ends) or (block is not None and int(block) in layers):
            n += math.prod(spec.local_shape(0))
    return n


def pipeline_plan(config: GPTConfig, tp: int, pp: int, dp: int, zero_stage: int, precision: str, micro_batch: int,
                  micro_batches: int, recompute=None, schedule: str = "1f1b", virtual: int = 1,
                  first: Optional[int] = None, last: Optional[int] = None) -> dict:
    """Per-stage ``layers``, ``params``, ``model_states`` and ``activations`` (bytes), the bubble and p2p bytes."""
    counts = stage_layer_counts(config.num_layers, pp, first, last)
    act = activation_bytes(config, tp, micro_batch, recompute, precision)
    per_layer = act["layers"] / config.num_layers
    scale = 4 if precision == "fp32" else 2
    boundary = config.seq_length * micro_batch * config.hidden_size * scale
    stages, start = [], 0
    for i, n in enumerate(counts):
        layers = range(start, start + n)
        start += n
        params = stage_parameters(config, tp, layers, i == 0, i == pp - 1)
        in_flight = micro_batches if schedule == "gpipe" else min(micro_batches, pp - i)
        outside = act["outside"] if i == pp - 1 else 0
        stages.append(dict(stage=i, layers=n, params=params, in_flight=in_flight,
                           model_states=model_state_bytes(params, dp, zero_stage, precision)["total"],
                           activations=round(in_flight * per_layer * n + act["recompute_working"] + outside)))
    return dict(stages=stages, schedule=schedule, micro_batches=micro_batches, virtual=virtual,
                bubble=bubble_fraction(pp, micro_batches, virtual),
                p2p_bytes_per_step=2 * boundary * micro_batches * (pp - 1) * virtual)


def format_pipeline(plan: dict) -> str:
    """The per-stage table ``tnlg plan --pp`` prints."""
    gib = 2 ** 30
    lines = [f"pipeline ({plan['schedule']}, {plan['micro_batches']} micro batches per step): bubble "
             f"{plan['bubble']:.1%} of each step; point-to-point {plan['p2p_bytes_per_step'] / gib:.3f} GiB per "
             f"step over all stage boundaries",
             "stage  layers  params (TP rank 0)  model states  activations (in flight)"]
    for s in plan["stages"]:
        lines.append(f"{s['stage']:>5}  {s['layers']:>6}  {s['params']:>18,}  {s['model_states'] / gib:>8.2f} GiB  "
                     f"{s['activations'] / gib:>8.2f} GiB ({s['in_flight']})")
    return "\n".join(lines)
