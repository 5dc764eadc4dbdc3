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
from .flops import (ABSTRACT_FLOPS_FORMULA, FLOPS_FORMULA, flops_per_iteration, iteration_time,
                    rank_flops_imbalance)
from .memory import (ACTIVATION_FORMULA, MODEL_STATE_FORMULA, PRECISIONS, activation_bytes,
                     check_zero_and_precision, fsdp_shard_numel, gpu_attention, model_state_bytes)

__all__ = ["Model", "Layout", "Hardware", "plan_layout", "smallest_tp", "check_layout"]


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
    """How the model is laid out: TP x DP, ZeRO stage, batch sizes, recomputation, precision."""

    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    global_batch: Optional[int] = None
    recompute: bool = False
    precision: str = "fp16"
    grads_fp32: bool = False  # --accumulate-allreduce-grads-in-fp32

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


def check_layout(model: Model, layout: Layout) -> None:
    """Raise :class:`UserError` for a layout that cannot run, naming what would be valid."""
    check_positive(tp=layout.tp, dp=layout.dp)
    if layout.micro_batch < 1:
        raise UserError(f"--micro-batch-size must be a positive integer, got {layout.micro_batch}.")
    check_zero_and_precision(layout.zero_stage, layout.precision)
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


def _memory(model: Model, layout: Layout, psi: int, hw: Hardware) -> dict:
    # a shaped model is planned for tnlg's engine; the abstract one is the ZeRO paper's (Table 1)
    shard_psi = (fsdp_shard_numel(model.shape, layout.tp, layout.dp)
                 if not model.abstract and layout.zero_stage >= 2 and layout.dp > 1 else None)
    states = model_state_bytes(psi, layout.dp, layout.zero_stage, layout.precision, grads_fp32=layout.grads_fp32,
                               engine=not model.abstract, shard_psi=shard_psi)
    out = {"model_states_formula": MODEL_STATE_FORMULA, "psi": psi, "params": states["params"],
           "grads": states["grads"], "optimizer": states["optimizer"], "k": states["k"],
           "model_states": states["total"], "gpu_memory": hw.gpu_memory,
           "model_states_fit": states["total"] <= hw.gpu_memory}
    if model.abstract:
        out.update(activations_formula=None, activations_no_recompute=None, activations_recompute=None,
                   activations=0, activations_note="abstract model: no shape, activations not counted")
    else:
        kernel = gpu_attention(layout.precision)
        no_rc = activation_bytes(model.shape, layout.tp, layout.micro_batch, False, layout.precision, attention=kernel)
        rc = activation_bytes(model.shape, layout.tp, layout.micro_batch, True, layout.precision, attention=kernel)
        out.update(activations_formula=ACTIVATION_FORMULA, activations_no_recompute=no_rc,
                   activations_recompute=rc, activations=(rc if layout.recompute else no_rc)["total"])
    out["total"] = out["model_states"] + out["activations"]
    out["fits"] = out["total"] <= hw.gpu_memory
    out["headroom"] = hw.gpu_memory - out["total"]
    return out


def _compute(model: Model, layout: Layout, psi: int, hw: Hardware, train_tokens: Optional[int]) -> dict:
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
    t = iteration_time(flops=flops, gpus=layout.world_size, gpu_tflops=hw.gpu_tflops, mfu=hw.mfu,
                       imbalance=imbalance, tp=layout.tp, dp=layout.dp, zero_stage=layout.zero_stage, psi=psi,
                       tokens_per_dp_rank=B * s // layout.dp, hidden=hidden, layers=layers,
                       recompute=layout.recompute, act_bytes=act_bytes, grad_bytes=PRECISIONS[layout.precision][1],
                       gpus_per_node=hw.gpus_per_node, intra_gbps=hw.intra_node_gbps, inter_gbps=hw.inter_node_gbps)
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
                use_meta: bool = True, params: Optional[dict] = None) -> dict:
    """The full plan of one layout as a JSON-ready dict (memory in bytes).

    ``params`` may pass a precomputed :func:`parameter_report` (the search does, with
    the formula); otherwise it is computed, from meta-device builds when ``use_meta``.
    """
    check_layout(model, layout)
    params = params if params is not None else _params(model, layout.tp, use_meta)
    psi = params["largest_rank"]["params"]
    layout_d = asdict(layout)
    layout_d.update(global_batch=layout.batch, world_size=layout.world_size,
                    grad_accumulation_steps=layout.batch // (layout.micro_batch * layout.dp))
    if not model.abstract:
        heads = model.shape.num_attention_heads
        layout_d["megatron_can_run"] = heads % layout.tp == 0
    return {"model": model.describe(), "layout": layout_d, "hardware": asdict(hw), "parameters": params,
            "memory": _memory(model, layout, psi, hw), "compute": _compute(model, layout, psi, hw, train_tokens)}


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
