"""``tnlg plan``: flags, validation and output (table or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from ..config import PRESETS, GPTConfig, arch_fields, divisors, flag_of
from ..errors import UserError
from ..options.fields import add_options, check_declared
from ..layout import ParallelDims, World, add_layout_arguments, check_positive
from ..options.pipeline import check_stage_count, interleaved_chunks
from ..options.recipes import RECIPES
from ..plan.context import (check_context_parallel, context_plan, format_context, format_context_search,
                            search_context_parallel)
from ..plan.experts import check_expert_layout
from ..plan.flops import FLOPS_FORMULA
from ..plan.gpus import GPUS
from ..plan.gpus import gpu as lookup_gpu
from ..plan.memory import ACTIVATION_FORMULA, MODEL_STATE_FORMULA, PRECISIONS, check_zero_and_precision
from ..plan.pipeline import format_pipeline, pipeline_plan, pipeline_time
from ..plan.pipeline_search import check_search_pipeline, format_pipeline_search, search_pipelines
from ..plan.planner import Hardware, Layout, Model, plan_layout, smallest_tp
from ..plan.report import format_plan, format_search, format_simulation, format_stage_simulations, search_head
from ..plan.search import search_layouts
from ..plan.units import parse_bytes, parse_count

__all__ = ["add_arguments", "run"]

TNLG_TOKENS = 300_000 * 512 * 1024  # T-NLG recipe: 300k steps x batch 512 x seq 1024
# GPUs each published recipe (tnlg.options.recipes.RECIPES) ran on: T-NLG (Microsoft, 2020) on 256 V100-32GB,
# TP 4 x DP 64; Megatron-LM's 8.3B (Shoeybi et al. 2019) on 512 V100-32GB, TP 8 x DP 64.
RECIPE_GPUS = {"tnlg-17b": 256, "megatron-8.3b": 512}
# layout fields a recipe brings, and their defaults without one
LAYOUT_DEFAULTS = dict(tp=1, zero_stage=0, micro_batch_size=1, precision="fp16")
# what --help says of the model flags' defaults (the others: GPTConfig's, which a preset overrides)
_MODEL_DEFAULTS = dict(num_layers="the preset's; required without one", hidden_size="the preset's; required "
                       "without one", num_attention_heads="the preset's; required without one",
                       seq_length="the preset's, else 1024", vocab_size="the preset's, else 50257")

EPILOG = f"""\
How the numbers are computed (all stated again in the output):
  parameters   per tensor-parallel rank, by building each rank's shard on the meta
               device (no memory used), with the closed-form count beside it; heads
               that TP does not divide are split as evenly as possible (e.g. 28 heads
               at TP 16: 2 heads on 12 ranks, 1 on 4); the largest rank sets memory.
  model states {MODEL_STATE_FORMULA}.
               Per GPU: ZeRO 0: 16 Psi, 1: 4 Psi + 12 Psi/Nd, 2: 2 Psi + 14 Psi/Nd, 3: 16 Psi/Nd.
  activations  {ACTIVATION_FORMULA}; the attention core as the GPU's kernel keeps it: flash
               attention for fp16/bf16 (output and log-sum-exp), the math kernel for fp32.
  FLOPs        {FLOPS_FORMULA[False]};
               with --recompute-activations {FLOPS_FORMULA[True]}.
               --params N: 6N (8N with recomputation) FLOPs per token.
  time         FLOPs / (GPUs x --gpu-tflops x --mfu), --mfu being the achieved fraction of
               peak on the executed FLOPs, x the slowest TP rank's share, + TP and DP
               communication at the given bandwidths (ring all-reduce, no overlap).
Memory is in GB = 1e9 bytes in the table (as in the ZeRO paper) and in bytes in --json.

Examples:
  tnlg plan --params 7.5e9 --zero-stage 1 --data-parallel-size 64
  tnlg plan --preset tnlg-17b                 # T-NLG's recipe: TP 4 x DP 64 = 256 GPUs, ZeRO 1, batch 512
  tnlg plan --preset tnlg-17b --zero-stage 0 --recompute-activations --gpu-memory 32GB
  tnlg plan --preset tnlg-17b --tensor-model-parallel-size 16       # on the recipe's 256 GPUs: DP 16
  tnlg plan --preset tnlg-17b --search --world-size 256 --gpu-memory 32GB --global-batch-size 512
  tnlg plan --preset tnlg-17b --tp 4 --pp 4 --zero-stage 1   # per pipeline stage, on the recipe's 256 GPUs
  tnlg plan --preset tnlg-17b --simulate --gpu h200   # + the step itself on fake tensors: peaks, traffic, time
  tnlg plan --preset mixtral-8x7b --seq-length 4096 --tp 2 --world-size 64 --ep 8 --zero-stage 1 --bf16 \
      --gpu-memory 80GB                       # experts over EP 8: their memory per rank, the all-to-all
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tnlg plan`` (Megatron's names, with short aliases)."""
    parser.description = ("Plan a training layout before renting GPUs: parameters per tensor-parallel rank, "
                          "memory per GPU (ZeRO stages, activations), FLOPs, time per iteration and days, or "
                          "--search for every layout that fits.")
    parser.epilog = EPILOG
    _add_model_arguments(parser)
    lay = parser.add_argument_group("layout")
    add_layout_arguments(lay, dict(tp=None, dp=None), help=dict(tp="default: the preset's recipe, else 1",
                                                                dp="default: world size / (TP x CP x PP), or 1"))
    lay.add_argument("--world-size", type=int, help="number of GPUs = TP x DP (with --search: the GPUs to use; "
                                                    "default: the preset's recipe, e.g. 256 for tnlg-17b, unless "
                                                    "--data-parallel-size is given)")
    _add_pipeline_arguments(lay)
    add_layout_arguments(lay, dict(cp=None), help=dict(
        cp="the world is TP x CP x PP x DP; 2 x CP must divide --seq-length: activations per rank (per pipeline "
           "stage with --pp), the ring's traffic and time; with --simulate a CP rank on fake tensors; with --search "
           "only this CP (default: --search adds the fastest layout of every CP > 1 and lays CP with the "
           "pipelines)"))
    lay.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int,
                     help="with a mixture of experts (--num-experts, or a MoE preset): the experts split over EP ranks "
                          "carved from DP x CP (EP must divide the experts and DP x CP; ZeRO 0 or 1 when EP > 1): the "
                          "experts' memory per rank, their gradients and optimizer states over DP x CP / EP, the "
                          "all-to-all traffic (default 1; with --search: only this EP, else every EP that divides)")
    lay.add_argument("--zero-stage", type=int,
                     help="0 plain DP, 1 optimizer states, 2 + gradients, 3 + parameters partitioned (default: the "
                          "preset's recipe, else 0)")
    lay.add_argument("--micro-batch-size", type=int,
                     help="sequences per GPU per step (default: the preset's recipe, else 1)")
    lay.add_argument("--global-batch-size", type=int,
                     help="sequences per iteration (default: the preset's recipe, else micro batch x DP; with "
                          "--search 512, T-NLG's)")
    lay.add_argument("--recompute-activations", action="store_true",
                     help="full activation recomputation: keep only each layer's input")
    lay.add_argument("--precision", help=f"{', '.join(PRECISIONS)} (default fp16: mixed precision, K = 12; "
                                         f"or the preset's recipe)")
    lay.add_argument("--bf16", action="store_true", help="as tnlg pretrain --bf16: --precision bf16")
    lay.add_argument("--fp16", action="store_true", help="as tnlg pretrain --fp16: --precision fp16")
    lay.add_argument("--accumulate-allreduce-grads-in-fp32", dest="grads_fp32", action="store_true",
                     help="fp32 gradient buffer with 16-bit parameters (4-byte gradients; ZeRO stages 0 and 1)")
    _add_hardware_arguments(parser)
    lora = parser.add_argument_group("low-rank adapters (as tnlg finetune --lora-rank)")
    lora.add_argument("--lora-rank", type=int, help="also the model states with a frozen base and rank-R adapters "
                      "(LoRA) beside full fine-tuning's")
    lora.add_argument("--lora-target-modules", nargs="+", metavar="MODULE",
                      help="with --lora-rank: the adapted layers by PEFT's names (default PEFT's for the family)")
    out = parser.add_argument_group("output")
    out.add_argument("--search", action="store_true",
                     help="list every (tp, dp, ZeRO stage, recomputation, micro batch) that fits on --world-size "
                          "GPUs, smallest TP first, with heads per rank and predicted throughput; a ZeRO stage "
                          "that fits at no micro batch is listed with the reason")
    out.add_argument("--json", action="store_true", help="print one JSON object (memory in bytes) and nothing else")
    out.add_argument("--formula-counts", action="store_true",
                     help="count per-rank parameters by formula instead of meta-device builds (faster)")
    _add_simulation_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's flags: a preset, every architecture field of :class:`GPTConfig` (declared there, as
    ``tnlg pretrain``'s), or an abstract --params."""
    m = parser.add_argument_group("model (a preset, shape flags, or --params)")
    m.add_argument("--preset", help=f"named model shape: {', '.join(PRESETS)}; shape flags override its fields. "
                                    f"{' and '.join(RECIPES)} also bring their published layout and batch "
                                    f"(tnlg-17b: TP 4 x DP 64 = 256 GPUs, ZeRO 1, micro batch 1, global batch "
                                    f"512, fp16); layout flags override those")
    add_options(m, GPTConfig, {}, names=_shape_names(), defaults=_MODEL_DEFAULTS)
    m.add_argument("--params", help="abstract model of N parameters as in the ZeRO paper (7.5e9, 1.28e+11, "
                                    "1000000): model states and 6N FLOPs per token only")


def _add_pipeline_arguments(lay) -> None:
    """``--pp`` and its schedule (Megatron's names)."""
    add_layout_arguments(lay, dict(pp=None), help=dict(
        pp="adds the per-stage parameters, model states, activations in flight, receive buffers, the bubble and "
           "the step time (docs/pipeline.md); with --search only this PP (default: --search ranks PP 1 and every "
           "PP > 1)"))
    lay.add_argument("--pipeline-schedule", choices=["1f1b", "gpipe", "interleaved"], default="1f1b",
                     help="with --pp: the schedule whose activations in flight and bubble are counted (default "
                          "1f1b; interleaved needs --num-layers-per-virtual-pipeline-stage)")
    lay.add_argument("--num-layers-per-virtual-pipeline-stage", dest="layers_per_chunk", type=int,
                     help="interleaved 1F1B: layers per model chunk (v = layers / (PP x this) chunks per rank)")


def _add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    hw = parser.add_argument_group("hardware and budget")
    hw.add_argument("--gpu-memory", default="32GB", help="memory per GPU: 32GB, 32GiB, 80G or bytes "
                                                         "(default 32GB, a V100-32GB)")
    hw.add_argument("--gpu-tflops", type=float, default=125.0,
                    help="peak TFLOP/s per GPU at this precision (default 125, V100 fp16 tensor cores)")
    hw.add_argument("--mfu", type=float, default=0.4,
                    help="fraction of peak achieved on the executed FLOPs (default 0.4)")
    hw.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    hw.add_argument("--intra-node-bandwidth", type=float, default=150.0,
                    help="GB/s per GPU inside a node (default 150, NVLink)")
    hw.add_argument("--inter-node-bandwidth", type=float, default=12.5,
                    help="GB/s per GPU across nodes (default 12.5, 100 Gb/s InfiniBand per GPU)")
    hw.add_argument("--train-tokens", default=str(TNLG_TOKENS),
                    help=f"token budget for the days estimate (default {TNLG_TOKENS:.4g} = T-NLG's 300k steps x "
                         f"512 x 1024)")


def _add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("simulation (tnlg's own step on fake tensors, at full size)")
    sim.add_argument("--simulate", action="store_true",
                     help="also run one iteration of rank 0 of the layout (meta build, materialisation into the "
                          "engine, forward and backward of the micro batches, gradient reduction, norm, AdamW) "
                          "on fake tensors with a fake process group: per phase the bytes live and at the peak by "
                          "kind, FLOPs, bytes read and written, collective bytes per group, and the predicted step "
                          "time and MFU on --gpu (ZeRO stages 0 and 1; with --pp also 2 and 3; with --cp a CP rank; a mixture "
                          "of experts routed evenly, with --ep its all-to-alls; about a minute at 17B)")
    sim.add_argument("--gpu", help=f"the GPU of --simulate's time prediction: {', '.join(GPUS)} (default h100)")


def _shape_names() -> tuple[str, ...]:
    """The model flags a plan reads: every architecture field and the sequence length (a training choice that
    sizes activations and FLOPs)."""
    names = arch_fields()
    at = names.index("max_position_embeddings")
    return names[:at] + ("seq_length",) + names[at:]


def _model_fields(args) -> dict:
    """The architecture fields given as flags (by field name), each checked by its declaration."""
    fields = {name: getattr(args, name) for name in _shape_names() if hasattr(args, name)}
    check_declared(GPTConfig, fields)
    return fields


def _model(args) -> Model:
    fields = _model_fields(args)
    shape_given = [f for f in fields if f != "seq_length"]
    if args.params is not None:
        if args.preset or shape_given:
            raise UserError("--params describes an abstract model; it cannot be combined with --preset or "
                            f"shape flags (got {', '.join(flag_of(f) for f in shape_given) or '--preset'}).")
        return Model(name=f"{parse_count(args.params):.3g} parameters", params=parse_count(args.params),
                     seq_length=fields.get("seq_length", 1024))
    try:
        if args.preset:
            return Model(name=args.preset, config=GPTConfig.preset(args.preset, **fields))
        missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads") if f not in fields]
        if missing:
            raise UserError("give a model: --preset NAME (" + ", ".join(PRESETS) + "), or the shape flags "
                            "--num-layers, --hidden-size and --num-attention-heads (missing: "
                            + ", ".join(flag_of(f) for f in missing) + "), or --params N.")
        fields.setdefault("seq_length", 1024)
        fields.setdefault("vocab_size", 50257)
        return Model(name="custom", config=GPTConfig(**fields))
    except UserError:
        raise
    except ValueError as err:
        raise UserError(str(err)) from None


def _hardware(args) -> Hardware:
    if not args.gpu_tflops > 0:
        raise UserError(f"--gpu-tflops must be positive, got {args.gpu_tflops}.")
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu is a fraction of peak in (0, 1], got {args.mfu}.")
    for flag in ("gpus_per_node", "intra_node_bandwidth", "inter_node_bandwidth"):
        if not getattr(args, flag) > 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}.")
    return Hardware(gpu_memory=parse_bytes(args.gpu_memory), gpu_tflops=args.gpu_tflops, mfu=args.mfu,
                    gpus_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_bandwidth,
                    inter_node_gbps=args.inter_node_bandwidth)


def _apply_recipe(args) -> dict | None:
    """Fill the layout flags not given from the preset's published recipe (``RECIPES``); the rest
    from :data:`LAYOUT_DEFAULTS`. Returns what the recipe supplied (``None`` without a recipe)."""
    _precision_flags(args)
    recipe = RECIPES.get(args.preset) if args.preset and args.params is None else None
    taken: dict = {}
    if recipe is not None:
        precision = "fp16" if recipe.get("fp16") else "bf16" if recipe.get("bf16") else "fp32"
        offer = dict(tp=recipe["tensor_model_parallel_size"], zero_stage=recipe["zero_stage"],
                     micro_batch_size=recipe["micro_batch_size"], global_batch_size=recipe["global_batch_size"],
                     precision=precision)
        if args.dp is None:  # a DP given without a world size sets the GPU count itself
            offer["world_size"] = RECIPE_GPUS[args.preset]
        for key, value in offer.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
                taken[key] = value
    for key, value in LAYOUT_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.recipe_layout = taken if recipe is not None else None
    return args.recipe_layout


def _precision_flags(args) -> None:
    """``--bf16`` / ``--fp16`` (``tnlg pretrain``'s flags) as ``--precision``; a clear error when they
    disagree with each other or with ``--precision``."""
    given = [name for name in ("bf16", "fp16") if getattr(args, name, False)]
    if len(given) > 1:
        raise UserError("--bf16 and --fp16 choose different precisions: give one of them.")
    if given and args.precision not in (None, given[0]):
        raise UserError(f"--{given[0]} asks for {given[0]} but --precision says {args.precision}: give one of them.")
    if given:
        args.precision = given[0]


def _recipe_note(preset: str, taken: dict) -> str:
    """Which layout fields the preset's recipe supplied, in words."""
    words = dict(tp="TP {}", zero_stage="ZeRO stage {}", micro_batch_size="micro batch {}",
                 global_batch_size="global batch {}", precision="{}", world_size="on {} GPUs")
    if not taken:
        return f"flags override every layout field of the {preset} recipe"
    return f"from the {preset} recipe: {', '.join(words[k].format(v) for k, v in taken.items())}; flags override"


def _layout(args, model: Model) -> Layout:
    check_zero_and_precision(args.zero_stage, args.precision)
    check_positive(tp=args.tp)
    if not model.abstract:
        try:
            model.shape.check_tensor_parallel(args.tp)
        except ValueError as err:
            raise UserError(str(err)) from None
    dims = _dims(args, model)
    if args.grads_fp32 and (args.precision == "fp32" or args.zero_stage >= 2):
        raise UserError("--accumulate-allreduce-grads-in-fp32 applies to --precision fp16/bf16 at ZeRO stages 0 "
                        "and 1 (as in tnlg pretrain).")
    ep = 1 if args.ep is None else args.ep
    check_expert_layout(model.config, ep, dims.dp * dims.cp, args.zero_stage)
    if ep > 1 and dims.pp > 1:
        raise UserError(f"--expert-model-parallel-size {ep} with --pipeline-model-parallel-size {dims.pp}: the per-stage "
                        "plan does not split the experts over EP yet. Plan the layout with --pp 1, or with EP 1.")
    return Layout(tp=dims.tp, dp=dims.dp, zero_stage=args.zero_stage, micro_batch=args.micro_batch_size,
                  global_batch=args.global_batch_size, recompute=args.recompute_activations,
                  precision=args.precision, grads_fp32=args.grads_fp32, ep=ep)


def _dims(args, model: Model) -> ParallelDims:
    """The layout's sizes: on ``--world-size`` (or the recipe's GPUs) as :class:`ParallelDims` checks them,
    listing the sizes the model allows; without a world, ``--data-parallel-size`` (default 1) sets it."""
    cp = 1 if args.cp is None else args.cp
    if args.world_size is None:
        dp = 1 if args.dp is None else args.dp
        check_positive(tp=args.tp, pp=args.pp, cp=cp, dp=dp)
        return ParallelDims(tp=args.tp, cp=cp, dp=dp, pp=args.pp)
    words = (f"the {args.world_size} GPUs of the {args.preset} recipe (give --world-size or --data-parallel-size "
             f"for another GPU count)" if "world_size" in (args.recipe_layout or {}) else None)
    c = model.config
    return ParallelDims.of(World.gpus(args.world_size, words), args.tp, args.pp, cp, args.dp,
                           max_tp=None if c is None else c.max_tensor_parallel_size(),
                           max_pp=None if c is None else c.num_layers,
                           cp_fits=None if c is None else lambda n: c.seq_length % (2 * n) == 0)


def _context(args, model: Model, layout: Layout, hw: Hardware, train_tokens, result: dict) -> tuple[dict, str]:
    """``--context-parallel-size C > 1``: the plan of one CP rank (with ``--pp``, of the whole model on one
    stage), and its CP lines."""
    plan = context_plan(model, layout, hw, args.cp, train_tokens, params=result["parameters"])
    plan["tp_needed"] = result.get("tp_needed")
    return plan, format_plan(plan) + "\n\n" + format_context(plan)


def _tp_needed(model: Model, layout: Layout, hw: Hardware) -> dict:
    world = layout.world_size
    return {
        "plain_dp_any": smallest_tp(model, layout, hw, zero_stage=0),
        "plain_dp_even": smallest_tp(model, layout, hw, zero_stage=0, even_only=True),
        "plain_dp_world": smallest_tp(model, layout, hw, zero_stage=0, divides=world),
        "this_stage_world": smallest_tp(model, layout, hw, zero_stage=layout.zero_stage, divides=world),
        "this_layout_with_activations": smallest_tp(model, layout, hw, zero_stage=layout.zero_stage,
                                                    with_activations=True, divides=world),
        "note": "smallest TP whose largest rank fits one GPU; per-rank formula; 'world' keeps TPs dividing "
                "the GPU count with DP = GPUs / TP",
    }


def _check_simulate_flags(args, model: Model) -> None:
    """--simulate and --gpu: a clear :class:`UserError` before any work."""
    if args.gpu is not None:
        if not args.simulate:
            raise UserError(f"--gpu {args.gpu} names the GPU of --simulate's time prediction; add --simulate "
                            f"(the planner's own time uses --gpu-tflops and --mfu).")
        lookup_gpu(args.gpu)
    if args.simulate and (args.search or model.abstract):
        raise UserError("--simulate runs one layout of a shaped model: give --preset or the shape flags (not "
                        "--params), and no --search.")


def _simulation(model: Model, layout: Layout, gpu_name: str, cp: int = 1, lora: Optional[tuple] = None) -> dict:
    """:func:`tnlg.training.simulate.simulate` for this layout (rank 0), without the per-operator lists; ``lora``:
    ``(rank, targets)``, a LoRA fine-tuning step."""
    from dataclasses import replace

    from ..training.simulate import simulate
    config = replace(model.shape, recompute_granularity="full" if layout.recompute else None,
                     recompute_activations=False)
    accum = layout.batch // (layout.micro_batch * layout.dp)
    sim = simulate(config, layout.tp, layout.dp, zero_stage=layout.zero_stage, precision=layout.precision,
                   micro_batch=layout.micro_batch, accum=accum, grads_fp32=layout.grads_fp32, gpu=gpu_name, cp=cp,
                   ep=layout.ep, lora=lora)
    sim.pop("ops")
    return sim


def _pipeline(args, model: Model, layout: Layout, hw: Hardware, train_tokens) -> dict:
    """``tnlg plan --pp``'s per-stage plan and step time; a clear error for what it does not cover."""
    if model.abstract:
        raise UserError(f"tnlg plan --pipeline-model-parallel-size {args.pp} does not take --params (an abstract "
                        f"model has no layers to split: give --preset or the shape flags).")
    pp, c = args.pp, model.shape
    virtual = _virtual_stages(args, c)
    if args.simulate and virtual > 1:
        raise UserError("--simulate runs a pipeline stage in the 1f1b order, one model chunk per rank; the "
                        "interleaved schedule is not simulated. Drop --simulate, or plan --pipeline-schedule 1f1b.")
    check_stage_count(pp, c.num_layers)
    cp = args.cp or 1
    dims = ParallelDims(tp=layout.tp, cp=cp, dp=layout.dp, pp=pp, vp=virtual)
    m = dims.pipeline_micro_batches(layout.batch, layout.micro_batch, args.pipeline_schedule)
    plan = pipeline_plan(c, layout.tp, pp, layout.dp, layout.zero_stage, layout.precision, layout.micro_batch, m,
                         layout.recompute, args.pipeline_schedule, virtual, grads_fp32=layout.grads_fp32, cp=cp)
    plan["gpus"] = dims.world
    plan["time"] = pipeline_time(c, plan, hw, layout.tp, layout.dp, layout.zero_stage, layout.precision,
                                 layout.micro_batch, layout.recompute, train_tokens)
    if args.simulate:
        plan["simulation"] = _stage_simulations(model, layout, pp, m, args.gpu or "h100", cp)
    return plan


def _stage_simulations(model: Model, layout: Layout, pp: int, micro_batches: int, gpu_name: str,
                       cp: int = 1) -> dict:
    """:func:`tnlg.training.simulate_pipeline.simulate_stage` of the first and the last stage; the larger peak."""
    from dataclasses import replace

    from ..training.simulate_pipeline import simulate_stage
    config = replace(model.shape, recompute_granularity="full" if layout.recompute else None,
                     recompute_activations=False)
    sims = [simulate_stage(config, layout.tp, pp, layout.dp, stage, zero_stage=layout.zero_stage,
                           precision=layout.precision, micro_batch=layout.micro_batch, micro_batches=micro_batches,
                           grads_fp32=layout.grads_fp32, gpu=gpu_name, cp=cp) for stage in (0, pp - 1)]
    return dict(stages=sims, larger=max(sims, key=lambda s: s["peak_bytes"])["stage"])


def _check_interleaved_flags(args) -> None:
    n = args.layers_per_chunk
    if (n is not None and n < 1) or (n is None) != (args.pipeline_schedule != "interleaved"):
        raise UserError("--pipeline-schedule interleaved and --num-layers-per-virtual-pipeline-stage N (a positive "
                        "number of layers per model chunk) go together: give both, or neither.")


def _virtual_stages(args, config: GPTConfig) -> int:
    """Model chunks per pipeline rank of ``--num-layers-per-virtual-pipeline-stage`` (1 without)."""
    _check_interleaved_flags(args)
    n = args.layers_per_chunk
    return 1 if n is None else interleaved_chunks(n, args.pp, config.num_layers)


def _search(args, model: Model, hw: Hardware, batch: int, train_tokens, source) -> tuple[dict, str]:
    """``--search``: the TP x DP table (PP 1) and the pipeline table (PP > 1); ``--pp P`` keeps one of them."""
    if args.pp is not None and args.pp < 1:
        raise UserError(f"--pipeline-model-parallel-size must be a positive integer, got {args.pp}.")
    if args.ep is not None:
        check_expert_layout(model.config, args.ep, args.world_size, 0)
    flat = search_layouts(model, args.world_size, hw, batch, args.precision, train_tokens,  # checks model, world
                          [args.ep] if args.ep is not None else None)
    if source is not None:
        flat["source"] = source
    if args.cp is not None:
        check_context_parallel(model.shape, args.cp)
        ParallelDims.of(World.gpus(args.world_size), cp=args.cp)
    if args.cp != 1 and args.pp in (None, 1):
        flat["context_parallel"] = search_context_parallel(model, args.world_size, hw, batch, args.precision,
                                                           train_tokens, [args.cp] if args.cp else None)
        if args.pp == 1:
            return flat, format_search(flat) + "\n\n" + format_context_search(flat["context_parallel"])
    if args.pp == 1:
        return flat, format_search(flat)
    check_search_pipeline(model, args.world_size, args.pp)
    if args.pipeline_schedule == "gpipe":
        raise UserError("--search ranks the 1f1b and interleaved schedules (GPipe holds every micro batch's "
                        "activations, so it fits nowhere 1F1B does not); drop --pipeline-schedule gpipe.")
    _check_interleaved_flags(args)
    # CP with the pipelines: the one --cp given, else 1 and every CP that divides the GPUs and whose 2 x CP
    # chunks divide the sequence
    cps = [args.cp] if args.cp is not None else [n for n in divisors(args.world_size)
                                                 if model.shape.seq_length % (2 * n) == 0 or n == 1]
    flat["pipelines"] = search_pipelines(model, args.world_size, hw, batch, args.precision, train_tokens, args.pp,
                                         args.layers_per_chunk, cps)
    if args.pp is not None and "context_parallel" not in flat:  # one PP > 1: the pipeline table alone
        return flat, "\n".join(search_head(flat)) + "\n\n" + format_pipeline_search(flat["pipelines"])
    text = format_search(flat) + "\n\n" + format_pipeline_search(flat["pipelines"], without=flat)
    if "context_parallel" in flat:
        text += "\n\n" + format_context_search(flat["context_parallel"])
    return flat, text


def _lora(args, model, result: dict) -> tuple[dict, str]:
    """``--lora-rank``: the planned layout's model states with a frozen base and adapters (:mod:`tnlg.plan.lora`)."""
    from ..interop.peft import check_lora_rank, layout_of, resolve_targets
    from ..plan.lora import lora_model_states
    if args.search or model.abstract:
        raise UserError("--lora-rank plans one layout of a model tnlg builds: give --preset or the shape flags (not "
                        "--params) and no --search.")
    if args.simulate and (args.pp > 1 or (args.cp or 1) > 1):
        raise UserError("--simulate with --lora-rank runs the LoRA step at PP 1 and CP 1; drop --simulate, or "
                        "--pipeline-model-parallel-size / --context-parallel-size.")
    cfg, lay = model.config, result["layout"]
    layout = layout_of(cfg)
    targets = resolve_targets(args.lora_target_modules, layout)
    check_lora_rank(args.lora_rank, cfg, targets, layout)
    lora = lora_model_states(cfg, lay["tp"], lay["dp"], lay["zero_stage"], lay["precision"], args.lora_rank, targets)
    lora["targets"] = list(targets)
    gib = 2 ** 30
    text = (f"LoRA rank {args.lora_rank} on {', '.join(targets)} (TP rank {lora['tp_rank']}): "
            f"{lora['adapter_params']:,} adapter parameters beside {lora['frozen_params']:,} frozen; model states "
            f"{lora['total'] / gib:.2f} GiB (base {lora['base_bytes'] / gib:.2f}, adapters "
            f"{lora['adapter_bytes']['total'] / gib:.3f}) against {lora['full_finetuning_total'] / gib:.2f} GiB for "
            f"full fine-tuning ({lora['ratio']:.3f}x)")
    return lora, text


def _simulated_and_lora(args, model: Model, layout: Layout, result: dict, text: str) -> str:
    """One layout's ``--simulate`` (the whole step, or each pipeline stage's) and ``--lora-rank`` parts, added to
    ``result`` and to ``text``; the text."""
    lora = _lora(args, model, result) if getattr(args, "lora_rank", None) is not None else None
    if args.simulate and args.pp > 1:
        text += "\n\n" + format_stage_simulations(result["pipeline"])
    elif args.simulate:
        planned = result["memory"]["total"]
        if lora is not None:  # the LoRA step: its model states in place of full training's
            planned += lora[0]["total"] - result["memory"]["model_states"]
        result["simulation"] = _simulation(model, layout, args.gpu or "h100", args.cp or 1,
                                           None if lora is None else (args.lora_rank, lora[0]["targets"]))
        text += "\n\n" + format_simulation(result["simulation"], planned)
    if lora is not None:
        result["lora"], more = lora
        if "simulation" in result:
            sim = result["simulation"]["model_state_bytes"]
            result["lora"]["simulated_total"] = sim
            more += (f"; simulated (fake tensors, the states live at the first forward): {sim / 2**30:.2f} GiB "
                     f"(planner {(lora[0]['total'] - sim) / sim:+.1%})")
        text += "\n\n" + more
    return text


def run(args) -> int:
    """Plan one layout (or search all layouts) and print a table or one JSON object."""
    model = _model(args)
    _check_simulate_flags(args, model)
    taken = _apply_recipe(args)
    hw = _hardware(args)
    train_tokens = parse_count(args.train_tokens, "--train-tokens")
    if args.search:
        if args.world_size is None:
            raise UserError("--search needs --world-size, the number of GPUs to lay the model out on.")
        check_zero_and_precision(0, args.precision)
        batch = args.global_batch_size or 512
        if batch < 1:
            raise UserError(f"--global-batch-size must be a positive integer, got {batch}.")
        if getattr(args, "lora_rank", None) is not None:
            _lora(args, model, {})  # (refused: one layout only)
        source = None if taken is None else _recipe_note(args.preset, {
            k: v for k, v in taken.items() if k in ("world_size", "global_batch_size", "precision")})
        result, text = _search(args, model, hw, batch, train_tokens, source)
    else:
        args.pp = 1 if args.pp is None else args.pp
        if args.pp < 1:
            raise UserError(f"--pipeline-model-parallel-size must be a positive integer, got {args.pp}.")
        layout = _layout(args, model)
        result = plan_layout(model, layout, hw, train_tokens, use_meta=not args.formula_counts, cp=args.cp or 1)
        if taken is not None:
            result["layout"]["source"] = _recipe_note(args.preset, taken)
        if not model.abstract:
            result["tp_needed"] = _tp_needed(model, layout, hw)
        text = format_plan(result)
        if (args.cp or 1) != 1:
            result, text = _context(args, model, layout, hw, train_tokens, result)
        if args.pp > 1:
            result["pipeline"] = _pipeline(args, model, layout, hw, train_tokens)
            # the layout asked for first; the table of the whole model on one stage after it
            cp_part = f"CP {args.cp} x " if (args.cp or 1) > 1 else ""
            text = (f"per pipeline stage (PP {args.pp} x TP {layout.tp} x {cp_part}DP {layout.dp} = "
                    f"{result['pipeline']['gpus']} GPUs; the table below is the whole model on one stage):\n"
                    + format_pipeline(result["pipeline"]) + "\n\nthe whole model on one stage, without a pipeline:\n"
                    + text)
        elif args.pipeline_schedule != "1f1b" or args.layers_per_chunk is not None:
            raise UserError("--pipeline-schedule and --num-layers-per-virtual-pipeline-stage describe a pipeline: "
                            "give --pipeline-model-parallel-size P > 1 with them, or drop them.")
        text = _simulated_and_lora(args, model, layout, result, text)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        print(text)
    return 0
