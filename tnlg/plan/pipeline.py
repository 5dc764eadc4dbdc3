"""What a pipeline costs per stage: parameters and model states, activations in flight, the bubble, time.

Per pipeline rank ``i`` of ``P`` (TP rank 0, the largest shard): its parameters from the GPT's own
description of every shard (:meth:`tnlg.GPT.describe`), filtered to the rank's layers, plus the
embeddings on the first stage and the final LayerNorm and LM head (the tied embedding's copy) on
the last, exactly what :class:`tnlg.model.stage.StageModel` builds; model states from
:func:`.memory.model_state_bytes` (tnlg's engine, as the planner counts them without a pipeline).

Activations: a rank holds the activations of the (chunk, micro batch) pairs whose forward has
run and whose backward has not, each its chunk's layers' share of :func:`.memory.activation_bytes`;
at its peak (:func:`chunks_in_flight`)

* 1F1B (torch's ``Schedule1F1B``: ``P - i`` forwards before the first backward): ``min(m, P - i)``;
* GPipe: all ``m``;
* interleaved 1F1B with ``v`` chunks of ``n`` layers per rank (torch's ``ScheduleInterleaved1F1B``,
  whose warm-up is Megatron's): ``(v - 1) r + 2 (P - 1 - i)`` warm-up forwards with ``r`` micro
  batches per round (``r = P`` when ``P`` divides ``m``), then one more before the first backward:
  ``min(m v, (v - 1) r + 2 (P - 1 - i) + 1)`` chunks of ``n`` layers; on the first rank
  ``L (1 + (P - 1) / (P v))`` layers' worth (Korthikanti et al. 2022, section 4.2.3).

Beside them: the working set of one layer's recomputation, the embedding's dropout mask on the
first stage (per micro batch in flight), the final LayerNorm input and the fp32 logits on the last
(one micro batch: its loss's backward follows its forward; GPipe all ``m``), and torch's receive
buffers: a ``PipelineStage`` keeps one ``[b, s, h]`` buffer per micro batch for the activation it
receives (all chunks but the model's first) and one for the gradient (all but the last), ``m`` of
each for the whole run (the stage's first layer saves that buffer as its input, so one ``s b h``
of each micro batch in flight is counted twice: under 1/30 of a layer's activations).

ZeRO 2 and 3 (FSDP2, :mod:`tnlg.optim.fsdp`) under torch's schedules: before every micro batch's backward
torch's ``PipelineStage`` turns FSDP2's gradient reduce-scatter *and its reshard after backward* off, and
after the last backward (``perform_reduce_grad``) reduce-scatters the accumulated gradients once and
reshards. So a stage of ``Psi`` parameters (TP rank 0) holds for the whole schedule its accumulated
*unsharded* 16-bit gradients (``2 Psi``) and its unsharded parameters: ZeRO 2 gathers them in the first
forward and keeps them to the end of the step; ZeRO 3 frees each unit's after its forward, gathers it again
in each backward and keeps it from there to the unit's next forward, so through every backward and the
cool-down the whole stage is gathered again (:func:`pipeline_state_bytes`):

    ZeRO 2 and 3 in a pipeline: 2 Psi/Nd (shard) + 2 Psi (unsharded) + 2 Psi (gradients) + 12 Psi/Nd

that is ZeRO 1's ``4 Psi + 12 Psi/Nd`` plus the shard: no saving over ZeRO 1 in a pipeline (the gradient
shards, ``2 Psi/Nd``, replace the unsharded gradients after the step's reduce-scatter; ZeRO 3's all-gather
buffers, one unit at a time, are not counted). Traffic over DP per step (:func:`tnlg.plan.flops.dp_traffic_units`):
ZeRO 2 one all-gather and one reduce-scatter (``2 Psi``, as ZeRO 0/1); ZeRO 3 ``m + 1`` all-gathers per model
chunk (a unit is gathered by each forward that follows a forward or starts the step, and by each backward that
follows a forward: for any order of ``m`` forwards and ``m`` backwards starting with a forward and ending with
a backward that is ``m + 1``) and one reduce-scatter, ``(m + 2) Psi``.

Bubble: a rank idles ``(P - 1) / v`` of a micro batch's forward + backward per step (Narayanan et
al. 2021: interleaving makes the bubble time ``v`` times smaller), so the idle fraction of the step
is ``(P - 1) / (v m + P - 1)``: ``(P - 1) / (m + P - 1)`` for 1F1B and GPipe. Point-to-point: one
``[b, s_r, h]`` activation per micro batch and chunk boundary forward, its gradient backward.

Time (:func:`pipeline_time`, the planner's model without a pipeline applied to the slowest stage):
per micro batch the slowest rank's FLOPs over ``tp x --gpu-tflops x --mfu`` (x the uneven-heads
factor) + its TP all-reduces + its sends (``2 v``, one fewer on each end stage); a step is ``m + (P - 1) / v`` of those, plus the
DP traffic of the heaviest stage (its gradients; at ZeRO 3 also the ``m + 1`` all-gathers per chunk, which
run inside the schedule), with no overlap (pessimistic, as without a pipeline).
"""

from __future__ import annotations

import math
from typing import Optional

from ..config import GPTConfig, stage_parts
from .flops import iteration_time, rank_flops_imbalance, training_flops_per_sequence
from .memory import PRECISIONS, activation_bytes, gpu_attention, model_state_bytes
from .units import GB

__all__ = ["bubble_fraction", "chunks_in_flight", "parameter_table", "pipeline_plan", "pipeline_state_bytes",
           "pipeline_time", "format_pipeline"]


def bubble_fraction(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """The idle fraction of a step: ``(P - 1) / (v m + P - 1)`` (``(P - 1) / (m + P - 1)`` at ``v = 1``)."""
    return (stages - 1) / (virtual * micro_batches + stages - 1)


def chunks_in_flight(schedule: str, stages: int, micro_batches: int, rank: int, virtual: int = 1) -> int:
    """(chunk, micro batch) pairs whose activations pipeline rank ``rank`` holds at its peak (module docstring)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule != "interleaved":
        return min(micro_batches, stages - rank)
    per_round = micro_batches // max(1, micro_batches // stages)
    warmup = (virtual - 1) * per_round + 2 * (stages - 1 - rank)
    return min(micro_batches * virtual, warmup + 1)


def parameter_table(config: GPTConfig, tp: int) -> tuple[list[int], dict[str, int]]:
    """TP rank 0's parameters per transformer layer, and of the embeddings / final LayerNorm / LM head."""
    from ..model import GPT  # deferred: imports torch
    per_layer, ends = [0] * config.num_layers, dict[str, int]()
    for name, spec in GPT.describe(config, tp).items():
        n = math.prod(spec.local_shape(0))
        if name.startswith("transformer.h."):
            per_layer[int(name.split(".")[2])] += n
        else:
            key = name.split(".")[0] if name.startswith("lm_head.") else ".".join(name.split(".")[:2])
            ends[key] = ends.get(key, 0) + n
    return per_layer, ends


def _rank_parameters(config: GPTConfig, table: tuple, layers, first: bool, last: bool) -> int:
    per_layer, ends = table
    extra = [n if n == "lm_head" else f"transformer.{n}" for n in stage_parts(config, first, last) if n != "drop"]
    return sum(per_layer[i] for i in layers) + sum(ends[k] for k in extra)  # one stage: one embedding


def pipeline_state_bytes(psi: int, dp: int, zero_stage: int, precision: str, *, grads_fp32: bool = False,
                         virtual: int = 1) -> dict:
    """Model states of a pipeline rank of ``psi`` parameters at its peak under torch's schedules (module
    docstring): :func:`.memory.model_state_bytes` of tnlg's engine at ZeRO 0/1 (and at any stage with one DP
    rank, where the engine runs the flat stage-0 path); at ZeRO 2/3 the shard, the unsharded parameters and
    the accumulated unsharded gradients the schedule keeps until the step's reduce-scatter."""
    states = model_state_bytes(psi, dp, zero_stage, precision, grads_fp32=grads_fp32, engine=True)
    if zero_stage < 2 or dp == 1:
        return states
    p_bytes, g_bytes, _ = PRECISIONS[precision]
    params, grads = p_bytes * (psi + psi / dp), g_bytes * psi
    states.update(params=round(params), grads=round(grads), total=round(params + grads + states["optimizer"]))
    return states


def pipeline_plan(config: GPTConfig, tp: int, pp: int, dp: int, zero_stage: int, precision: str, micro_batch: int,
                  micro_batches: int, recompute=None, schedule: str = "1f1b", virtual: int = 1,
                  first: Optional[int] = None, last: Optional[int] = None, *, grads_fp32: bool = False,
                  sequence_parallel: bool = False, attention: Optional[str] = None,
                  table: Optional[tuple] = None, cp: int = 1) -> dict:
    """Per rank ``layers``, ``params``, ``model_states``, ``activations``, ``buffers`` and ``total`` (bytes),
    the heaviest rank, the bubble and the point-to-point bytes per step (module docstring).

    ``attention``: the kernel counted (default the GPU's at ``precision``, as ``tnlg plan``); ``table``: the
    :func:`parameter_table` of ``(config, tp)``, when the caller has it. ``cp``: context-parallel ranks
    (world TP x CP x PP x DP): a stage's activations, boundary and buffers are one CP rank's ``s / C``
    positions (:func:`.context.context_activation_bytes`: fused core, plus one layer's ring buffers on every
    stage), and ZeRO partitions over DP x CP."""
    if cp > 1:
        from .context import context_activation_bytes  # deferred: .context imports the planner
        act = context_activation_bytes(config, tp, cp, micro_batch, recompute, precision,
                                       sequence_parallel=sequence_parallel)
    else:
        act = activation_bytes(config, tp, micro_batch, recompute, precision, sequence_parallel=sequence_parallel,
                               attention=attention or gpu_attention(precision))
    ring = act.get("ring_working", 0)
    per_layer = act["layers"] / config.num_layers
    scale = PRECISIONS[precision][0]
    boundary = act["seq_per_rank"] * micro_batch * config.hidden_size * scale  # one activation sent
    # the embedding's dropout mask, one byte per element (two in fp32), as activation_bytes counts it
    embed_mask = act["seq_per_rank"] * micro_batch * config.hidden_size * (scale // 2) if config.hidden_dropout else 0
    table = table or parameter_table(config, tp)
    from ..parallel.pipeline import chunk_layers  # deferred: imports torch
    every = chunk_layers(config.num_layers, pp, virtual, first, last)
    stages = []
    for i in range(pp):
        chunks = every[i::pp]  # chunk c runs on rank c % P
        layers = [n for r in chunks for n in r]
        is_first, is_last = i == 0, i == pp - 1
        params = _rank_parameters(config, table, layers, is_first, is_last)
        held = chunks_in_flight(schedule, pp, micro_batches, i, virtual)
        last_mbs = micro_batches if schedule == "gpipe" else 1
        activations = (held * per_layer * len(chunks[0]) + act["recompute_working"] + ring
                       + (embed_mask * min(held, micro_batches) if is_first else 0)
                       + ((act["outside"] - embed_mask) * last_mbs if is_last else 0))
        buffers = micro_batches * boundary * (2 * len(chunks) - is_first - is_last)
        states = pipeline_state_bytes(params, dp * cp, zero_stage, precision, grads_fp32=grads_fp32)["total"]
        stages.append(dict(stage=i, layers=len(layers), params=params, in_flight=held, model_states=states,
                           activations=round(activations), buffers=buffers,
                           total=states + round(activations) + buffers))
    return dict(stages=stages, schedule=schedule, micro_batches=micro_batches, virtual=virtual, cp=cp,
                chunk_layers=len(chunks[0]), bubble=bubble_fraction(pp, micro_batches, virtual),
                heaviest=max(stages, key=lambda s: s["total"])["stage"], boundary_bytes=boundary,
                p2p_bytes_per_step=2 * boundary * micro_batches * (pp * virtual - 1))


def pipeline_time(config: GPTConfig, plan: dict, hw, tp: int, dp: int, zero_stage: int, precision: str,
                  micro_batch: int, recompute: bool, train_tokens: Optional[int] = None) -> dict:
    """Seconds per step of ``plan`` (:func:`pipeline_plan`) on ``hw`` (:class:`.planner.Hardware`), tokens/s,
    model TFLOP/s per GPU and MFU; ``slot_s`` is the slowest rank's forward + backward of one micro batch.
    With context parallelism (``plan["cp"] = C``) a rank computes ``1 / C`` of each micro batch's FLOPs (the
    causal load balance), its TP traffic carries ``s / C`` positions, its slot adds its layers' exposed ring
    time (:func:`.context.ring_traffic`) and the gradients are reduced over DP x CP."""
    pp, m, v, cp = len(plan["stages"]), plan["micro_batches"], plan["virtual"], plan.get("cp", 1)
    vocab = config.padded_vocab_size(tp)
    layer, logits = training_flops_per_sequence(config, recompute, vocab)
    act_bytes, grad_bytes = (4, 4) if precision == "fp32" else (2, PRECISIONS[precision][1])
    common = dict(gpu_tflops=hw.gpu_tflops, mfu=hw.mfu, imbalance=rank_flops_imbalance(config, tp), tp=tp,
                  zero_stage=zero_stage, hidden=config.hidden_size, recompute=recompute, act_bytes=act_bytes,
                  grad_bytes=grad_bytes, gpus_per_node=hw.gpus_per_node, intra_gbps=hw.intra_node_gbps,
                  inter_gbps=hw.inter_node_gbps)
    world = tp * cp * pp * dp
    ring_layer_s = 0.0
    if cp > 1:
        from .context import ring_traffic  # deferred: .context imports the planner
        ring_layer_s = ring_traffic(config, tp, cp, micro_batch, precision, bool(recompute), 1,
                                    hw)["exposed_s"] / config.num_layers
    p2p_bw = (hw.intra_node_gbps if world <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
    slots = []
    for s in plan["stages"]:
        flops = micro_batch * (s["layers"] * layer + (logits if s["stage"] == pp - 1 else 0)) / cp
        t = iteration_time(flops=flops, gpus=tp, dp=1, psi=0,
                           tokens_per_dp_rank=micro_batch * config.seq_length // cp, layers=s["layers"], **common)
        sends = 2 * v - (s["stage"] == 0) - (s["stage"] == pp - 1)  # activations forward, gradients back
        slots.append(t["compute_s"] + t["tp_comm_s"] + sends * plan["boundary_bytes"] / p2p_bw
                     + s["layers"] * ring_layer_s)
    psi = max(s["params"] for s in plan["stages"])
    dp_s = iteration_time(flops=0.0, gpus=1, dp=dp * cp, psi=psi, tokens_per_dp_rank=0, layers=0,
                          pipeline_micro_batches=m if pp > 1 else None, **common)["dp_comm_s"]
    step = (m + (pp - 1) / v) * max(slots) + dp_s
    tokens = m * micro_batch * dp * config.seq_length
    model_flops = tokens / config.seq_length * (config.num_layers * training_flops_per_sequence(config, False, vocab)[0]
                                                + logits)
    out = dict(slot_s=max(slots), ring_exposed_per_micro_batch_s=max(s["layers"] for s in plan["stages"]) * ring_layer_s, bubble_s=(pp - 1) / v * max(slots), dp_comm_s=dp_s, time_per_iteration_s=step,
               tokens_per_s=tokens / step, model_tflops_per_gpu=model_flops / step / world / 1e12,
               model_flops_utilization=model_flops / step / world / (hw.gpu_tflops * 1e12), train_days=None)
    if train_tokens:
        out["train_days"] = train_tokens / out["tokens_per_s"] / 86400
    return out


def format_pipeline(plan: dict) -> str:
    """The per-stage table ``tnlg plan --pp`` prints (GB = 1e9 bytes, as the rest of the plan)."""
    gb = GB
    chunks = (f", {plan['virtual']} chunks of {plan['chunk_layers']} layers per rank" if plan["virtual"] > 1 else "")
    cp = (f", CP {plan['cp']}: activations, boundaries and buffers of one CP rank's positions"
          if plan.get("cp", 1) > 1 else "")
    lines = [f"pipeline ({plan['schedule']}{chunks}, {plan['micro_batches']} micro batches per step{cp}): bubble "
             f"{plan['bubble']:.1%} of each step; point-to-point {plan['p2p_bytes_per_step'] / gb:.3f} GB per "
             f"step over all stage boundaries",
             "stage  layers  params (TP rank 0)  model states  activations (in flight)  recv buffers      total"]
    for s in plan["stages"]:
        lines.append(f"{s['stage']:>5}  {s['layers']:>6}  {s['params']:>18,}  {s['model_states'] / gb:>8.2f} GB  "
                     f"{s['activations'] / gb:>8.2f} GB ({s['in_flight']:>3})      {s['buffers'] / gb:>6.2f} GB  "
                     f"{s['total'] / gb:>6.2f} GB" + ("  <- heaviest" if s["stage"] == plan["heaviest"] else ""))
    if "time" in plan:
        t = plan["time"]
        lines.append(f"step {t['time_per_iteration_s']:.3f} s (slowest stage {t['slot_s'] * 1e3:.1f} ms per micro "
                     f"batch, bubble {t['bubble_s']:.3f} s, DP comm {t['dp_comm_s']:.3f} s"
                     + (f", ring exposed {t['ring_exposed_per_micro_batch_s'] * 1e3:.1f} ms per micro batch" if plan.get("cp", 1) > 1 else "") + "): "
                     f"{t['tokens_per_s']:,.0f} tokens/s, {t['model_tflops_per_gpu']:.1f} model TFLOP/s per GPU "
                     f"(MFU {t['model_flops_utilization']:.1%})")
    return "\n".join(lines)
