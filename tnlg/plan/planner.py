"""One layout's plan: parameters, memory against the GPU, FLOPs and time; and the TP a model needs.

Everything here is arithmetic on :mod:`.counts`, :mod:`.memory` and :mod:`.flops`;
the formulas are stated in those modules and repeated in the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ..config import GPTConfig
from ..errors import UserError
from ..layout import ParallelDims, check_positive
from .counts import abstract_parameter_report, parameter_report, rank_counts_formula
from .experts import EXPERT_FORMULA, all_to_all_traffic, check_expert_layout, expert_split
from .flops import (ABSTRACT_FLOPS_FORMULA, FLOPS_FORMULA, dp_traffic_units, flops_per_iteration, iteration_time,
                    rank_flops_imbalance)
from .memory import (ACTIVATION_FORMULA, MODEL_STATE_FORMULA, PRECISIONS, activation_bytes,
                     check_zero_and_precision, fsdp_shard_numel, gpu_attention, model_state_bytes,
                     model_state_bytes_by_kind, recompute_granularity)

__all__ = ["Model", "Layout", "Hardware", "plan_layout", "smallest_tp", "check_layout", "layout_psi", "layout_states",
           "expert_plan", "add_expert_time"]


@dataclass
class Model:
    """A model shape (``config``) or the ZeRO paper's abstract model of ``params`` parameters."""

    name: str
    config: Optional[GPTConfig] = None
    params: Optional[int] = None
    seq_length: int = 1024

    @property
    def abstract(self) -> bool:
        return self.config is None

    @property
    def shape(self) -> GPTConfig:
        """The config of a shaped model; a :class:`UserError` for the abstract one (it has no layers or heads)."""
        if self.config is None:
            raise UserError(f"{self.name}: an abstract model (--params) has no layers, heads or sequence to plan "
                            f"this by; give --preset or the shape flags.")
        return self.config

    @property
    def total_params(self) -> int:
        if self.config is not None:
            return self.config.num_parameters_formula()
        assert self.params is not None  # (a model is a shape or a parameter count)
        return self.params

    @property
    def seq(self) -> int:
        return self.seq_length if self.config is None else self.config.seq_length

    def describe(self) -> dict:
        if self.config is None:
            return {"name": self.name, "kind": "abstract", "params": self.params, "seq_length": self.seq_length}
        c = self.config
        return {"name": self.name, "kind": "shape", "num_layers": c.num_layers, "hidden_size": c.hidden_size,
                "num_attention_heads": c.num_attention_heads, "ffn_hidden_size": c.ffn_hidden_size,
                "seq_length": c.seq_length, "vocab_size": c.vocab_size}


@dataclass
class Layout:
    """How the model is laid out: TP x DP, ZeRO stage, batch sizes, recomputation, precision; ``ep`` expert-parallel
    ranks carved from DP (x CP) for a mixture of experts (:mod:`.experts`)."""

    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    global_batch: Optional[int] = None
    recompute: bool = False
    precision: str = "fp16"
    grads_fp32: bool = False  # --accumulate-allreduce-grads-in-fp32
    ep: int = 1  # --expert-model-parallel-size

    @property
    def dims(self) -> ParallelDims:
        """The TP x DP sizes (CP and PP are planned beside: :mod:`.context`, :mod:`.pipeline`)."""
        return ParallelDims(tp=self.tp, dp=self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def batch(self) -> int:
        return self.global_batch if self.global_batch is not None else self.micro_batch * self.dp


@dataclass
class Hardware:
    """One GPU's memory (bytes) and peak TFLOP/s, the achieved fraction, and the network."""

    gpu_memory: int = 32 * 10**9
    gpu_tflops: float = 125.0
    mfu: float = 0.4
    gpus_per_node: int = 8
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 12.5


def check_layout(model: Model, layout: Layout, cp: int = 1) -> None:
    """Raise :class:`UserError` for a layout that cannot run, naming what would be valid (``cp``: the
    context-parallel ranks, from which with DP the expert-parallel ones are carved)."""
    check_positive(tp=layout.tp, dp=layout.dp)
    if layout.micro_batch < 1:
        raise UserError(f"--micro-batch-size must be a positive integer, got {layout.micro_batch}.")
    check_zero_and_precision(layout.zero_stage, layout.precision)
    check_expert_layout(model.config, layout.ep, layout.dp * cp, layout.zero_stage)
    if not model.abstract:
        try:
            model.shape.check_tensor_parallel(layout.tp)
        except ValueError as err:
            raise UserError(str(err)) from None
    layout.dims.micro_batches(layout.batch, layout.micro_batch)


def _params(model: Model, tp: int, use_meta: bool) -> dict:
    if model.config is None:
        return abstract_parameter_report(model.total_params, tp)
    return parameter_report(model.config, tp, use_meta=use_meta)


def layout_psi(model: Model, layout: Layout, params: dict) -> int:
    """The parameters of the rank that sets the memory bound: the largest TP rank's, with expert parallelism
    its dense parameters and ``E / EP`` experts per MoE layer (:func:`.experts.expert_split`)."""
    if layout.ep > 1:
        return expert_split(model.shape, params["per_rank"], layout.ep)["largest_rank"]["params"]
    return params["largest_rank"]["params"]


def layout_states(model: Model, layout: Layout, params: dict, ranks: int) -> dict:
    """Model-state bytes of the largest rank over ``ranks`` gradient ranks (DP, or DP x CP): the ZeRO paper's for
    the abstract model; tnlg's engine for a shape (FSDP2's row shards at stages 2/3); with expert parallelism the
    dense and the expert parameters over their own groups (:func:`.memory.model_state_bytes_by_kind`)."""
    if layout.ep > 1:
        split = expert_split(model.shape, params["per_rank"], layout.ep)["largest_rank"]
        return model_state_bytes_by_kind(split["dense"], split["expert"], ranks, layout.ep, layout.zero_stage,
                                         layout.precision, grads_fp32=layout.grads_fp32)
    shard_psi = (fsdp_shard_numel(model.shape, layout.tp, ranks)
                 if not model.abstract and layout.zero_stage >= 2 and ranks > 1 else None)
    return model_state_bytes(layout_psi(model, layout, params), ranks, layout.zero_stage, layout.precision,
                             grads_fp32=layout.grads_fp32, engine=not model.abstract, shard_psi=shard_psi)


def _memory(model: Model, layout: Layout, params: dict, hw: Hardware, ranks: int) -> dict:
    # a shaped model is planned for tnlg's engine; the abstract one is the ZeRO paper's (Table 1)
    psi = layout_psi(model, layout, params)
    states = layout_states(model, layout, params, ranks)
    out = {"model_states_formula": MODEL_STATE_FORMULA, "psi": psi, "params": states["params"],
           "grads": states["grads"], "optimizer": states["optimizer"], "k": states["k"],
           "model_states": states["total"], "gpu_memory": hw.gpu_memory,
           "model_states_fit": states["total"] <= hw.gpu_memory}
    if model.abstract:
        out.update(activations_formula=None, activations_no_recompute=None, activations_recompute=None,
                   activations=0, activations_note="abstract model: no shape, activations not counted")
    else:
        kernel = gpu_attention(layout.precision)
        no_rc = activation_bytes(model.shape, layout.tp, layout.micro_batch, False, layout.precision, attention=kernel,
                                 ep=layout.ep)
        rc = activation_bytes(model.shape, layout.tp, layout.micro_batch, True, layout.precision, attention=kernel,
                              ep=layout.ep)
        out.update(activations_formula=ACTIVATION_FORMULA, activations_no_recompute=no_rc,
                   activations_recompute=rc, activations=(rc if layout.recompute else no_rc)["total"])
    out["total"] = out["model_states"] + out["activations"]
    out["fits"] = out["total"] <= hw.gpu_memory
    out["headroom"] = hw.gpu_memory - out["total"]
    return out


def _compute(model: Model, layout: Layout, psi: int, hw: Hardware, train_tokens: Optional[int],
             params: dict, ranks: int) -> dict:
    B, s = layout.batch, model.seq
    if model.abstract:
        per_token = (8 if layout.recompute else 6) * model.total_params
        flops, model_flops = float(per_token * B * s), float(6 * model.total_params * B * s)
        formula, imbalance, hidden, layers = ABSTRACT_FLOPS_FORMULA[layout.recompute], 1.0, 0, 0
    else:
        c = model.shape
        vocab = c.padded_vocab_size(layout.tp)
        flops = flops_per_iteration(c, B, layout.recompute, vocab)
        model_flops = flops_per_iteration(c, B, False, vocab)
        formula, imbalance = FLOPS_FORMULA[layout.recompute], rank_flops_imbalance(c, layout.tp)
        hidden, layers = c.hidden_size, c.num_layers
    act_bytes = 4 if layout.precision == "fp32" else 2
    dense_psi = psi if layout.ep == 1 else expert_split(model.shape, params["per_rank"],
                                                        layout.ep)["largest_rank"]["dense"]
    t = iteration_time(flops=flops, gpus=layout.world_size, gpu_tflops=hw.gpu_tflops, mfu=hw.mfu,
                       imbalance=imbalance, tp=layout.tp, dp=layout.dp, zero_stage=layout.zero_stage, psi=dense_psi,
                       tokens_per_dp_rank=B * s // layout.dp, hidden=hidden, layers=layers,
                       recompute=layout.recompute, act_bytes=act_bytes, grad_bytes=PRECISIONS[layout.precision][1],
                       gpus_per_node=hw.gpus_per_node, intra_gbps=hw.intra_node_gbps, inter_gbps=hw.inter_node_gbps)
    if not model.abstract and model.shape.num_experts is not None:
        add_expert_time(t, model, layout, params, ranks, 1, hw)
    tokens_per_s = B * s / t["total_s"]
    out = {"formula": formula, "recompute": layout.recompute, "flops_per_iteration": flops,
           "model_flops_per_iteration": model_flops, "tokens_per_iteration": B * s,
           "gpu_tflops": hw.gpu_tflops, "mfu_assumed": hw.mfu, "rank_imbalance_factor": imbalance,
           "time": t, "time_per_iteration_s": t["total_s"], "tokens_per_s": tokens_per_s,
           "model_tflops_per_gpu": model_flops / t["total_s"] / layout.world_size / 1e12,
           "model_flops_utilization": model_flops / t["total_s"] / layout.world_size / (hw.gpu_tflops * 1e12),
           "train_tokens": train_tokens, "train_days": None}
    if model.abstract and layout.tp > 1:
        out["tp_comm_note"] = "abstract model: no hidden size, TP communication not counted"
    if train_tokens:
        out["train_days"] = train_tokens / tokens_per_s / 86400
    return out


def plan_layout(model: Model, layout: Layout, hw: Hardware, train_tokens: Optional[int] = None,
                use_meta: bool = True, params: Optional[dict] = None, cp: int = 1) -> dict:
    """The full plan of one layout as a JSON-ready dict (memory in bytes).

    ``params`` may pass a precomputed :func:`parameter_report` (the search does, with
    the formula); otherwise it is computed, from meta-device builds when ``use_meta``.
    ``cp``: the context-parallel ranks the layout's expert parallelism is carved from with DP (the CP plan,
    :func:`.context.context_plan`, replaces the memory and time with a CP rank's).
    """
    check_layout(model, layout, cp)
    params = params if params is not None else _params(model, layout.tp, use_meta)
    psi = layout_psi(model, layout, params)
    layout_d = asdict(layout)
    layout_d.update(global_batch=layout.batch, world_size=layout.world_size,
                    grad_accumulation_steps=layout.batch // (layout.micro_batch * layout.dp))
    if not model.abstract:
        heads = model.shape.num_attention_heads
        layout_d["megatron_can_run"] = heads % layout.tp == 0
    plan = {"model": model.describe(), "layout": layout_d, "hardware": asdict(hw), "parameters": params,
            "memory": _memory(model, layout, params, hw, layout.dp * cp),
            "compute": _compute(model, layout, psi, hw, train_tokens, params, layout.dp * cp)}
    if not model.abstract and model.shape.num_experts is not None:
        plan["experts"] = expert_plan(model, layout, params, plan["memory"], plan["compute"]["time"],
                                      layout.dp * cp)
    return plan


def expert_plan(model: Model, layout: Layout, params: dict, memory: dict, time: dict, ranks: int) -> dict:
    """The plan's mixture-of-experts section (:mod:`.experts`): the experts' parameters and states per rank at
    EP, the MoE layers' activations (even routing) and the all-to-all traffic. ``ranks``: DP (x CP)."""
    c = model.shape
    split = expert_split(c, params["per_rank"], layout.ep)
    expert_psi = split["largest_rank"]["expert"]
    states = model_state_bytes(expert_psi, ranks // layout.ep, layout.zero_stage, layout.precision,
                               grads_fp32=layout.grads_fp32, engine=True)
    acts = memory.get("activations_recompute" if layout.recompute else "activations_no_recompute") or {}
    return {"formula": EXPERT_FORMULA, "num_experts": c.num_experts, "topk": c.moe_router_topk,
            "moe_layers": c.num_moe_layers, "ep": layout.ep, "experts_per_rank": split["experts_per_rank"],
            "expert_data_parallel_ranks": ranks // layout.ep, "parameters": split, "expert_params": expert_psi,
            "expert_states": states, "moe_mlp_activations": acts.get("moe_mlp"),
            "all_to_all": time.get("all_to_all"),
            "routing": "dropless, even routing assumed: every expert gets T k / E of a micro batch's T k routed "
                       "copies (real routing is uneven; the busiest EP rank holds more)"}


def add_expert_time(t: dict, model: Model, layout: Layout, params: dict, ranks: int, cp: int, hw: Hardware) -> None:
    """Add to :func:`.flops.iteration_time`'s ``t`` (computed with the dense parameters' DP traffic) the experts'
    gradient traffic over their ``ranks / EP`` expert-data-parallel ranks and the all-to-all of expert
    parallelism (:func:`.experts.all_to_all_traffic`), both without overlap. At EP 1 the experts are in the
    dense traffic already and no all-to-all runs."""
    c = model.shape
    micro_batches = layout.batch // (layout.micro_batch * layout.dp)
    a2a = all_to_all_traffic(c, layout.tp, layout.ep, cp, layout.micro_batch, micro_batches, layout.precision,
                             recompute_granularity(layout.recompute) == "full", gpus_per_node=hw.gpus_per_node,
                             intra_gbps=hw.intra_node_gbps, inter_gbps=hw.inter_node_gbps)
    t["all_to_all"] = a2a
    t["ep_comm_s"], t["ep_comm_bytes"] = a2a["time_s"], a2a["bytes_per_iteration"]
    expert_bytes = 0.0
    n = ranks // layout.ep
    if layout.ep > 1 and n > 1:
        psi = expert_split(c, params["per_rank"], layout.ep)["largest_rank"]["expert"]
        expert_bytes = dp_traffic_units(layout.zero_stage) * psi * PRECISIONS[layout.precision][1] * (n - 1) / n
    bw = (hw.intra_node_gbps if layout.tp * ranks <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
    t["dp_comm_bytes"] += round(expert_bytes)
    t["dp_comm_s"] += expert_bytes / bw
    t["total_s"] += expert_bytes / bw + a2a["time_s"]


def smallest_tp(model: Model, layout: Layout, hw: Hardware, *, zero_stage: int = 0,
                with_activations: bool = False, even_only: bool = False,
                divides: Optional[int] = None) -> Optional[int]:
    """Smallest TP at which one GPU holds the largest rank's model states (and activations).

    ``layout`` gives DP (for ZeRO), micro batch, recomputation and precision; ``even_only``
    keeps TPs that divide the heads (what Megatron accepts); ``divides`` keeps TPs that
    divide a world size. Uses the per-rank formula. ``None`` when no TP is enough.
    """
    c = model.shape
    for tp in range(1, c.max_tensor_parallel_size() + 1):
        if even_only and (c.num_attention_heads % tp or max(c.ffn_per_rank(tp)) != min(c.ffn_per_rank(tp))):
            continue
        if divides is not None and divides % tp:
            continue
        dp = divides // tp if divides is not None else layout.dp
        psi = max(r["params"] for r in rank_counts_formula(c, tp))
        need = model_state_bytes(psi, dp, zero_stage, layout.precision, grads_fp32=layout.grads_fp32,
                                 engine=True)["total"]
        if with_activations:
            need += activation_bytes(c, tp, layout.micro_batch, layout.recompute, layout.precision,
                                     attention=gpu_attention(layout.precision))["total"]
        if need <= hw.gpu_memory:
            return tp
    return None
