"""FLOPs per iteration, the slowest TP rank, communication volume and time per iteration.

FLOPs (Narayanan et al. 2021, eq. 3, counting the full ``s^2`` attention as that
paper does, with ``V`` the padded vocabulary that is really multiplied). A forward
pass over ``B`` sequences costs per layer ``8Bsh^2`` (QKV, projection) ``+ 4Bshf``
(MLP) ``+ 4Bs^2h`` (scores, weighted sum), and ``2BshV`` for the logits. The Llama family: the
keys and values of ``G`` groups of width ``d`` cost ``4Bsh Gd`` instead of ``4Bsh^2`` (QKV and projection
``4Bsh^2 + 4BshGd``), SwiGLU's three matrices ``6Bshf``; RMSNorm and rope are elementwise (not counted,
as LayerNorm is not). Heads of width ``d`` apart from ``h / a`` (``kv_channels``): the queries and the
projection cost ``4Bsh ad`` and the core ``4Bs^2 ad``. A sliding window ``w < s`` lets each query see ``w``
keys: its layers' core costs ``4Bs w ad`` (the per-layer figure is the mean over the layers). QK norm is
elementwise. Training is
forward + backward (2x forward); full recomputation adds one forward of the layers,
selective recomputation (Korthikanti et al. 2022) one forward of the attention core
(``4Bs^2h`` per layer: scores and weighted sum):

    no recomputation:        72 B s l h^2 (1 + s/(6h) + V/(12 l h))   (f = 4h)
    full recomputation:      96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    selective recomputation: the first, plus 4 B s^2 l h

For an abstract model (``--params N``) the rule of thumb 6N (8N with recomputation)
FLOPs per token is used.

Time: the executed FLOPs over ``gpus * gpu_tflops * mfu`` (``mfu`` is the fraction of
peak achieved on the executed FLOPs), times the slowest rank's share of the TP work
(uneven heads) over the mean share, plus communication, which is assumed not to
overlap with compute (pessimistic): Megatron TP all-reduces of ``[b, s, h]`` (two per
layer forward, two backward, two more in a recomputed forward; one each way for the
vocab-parallel embedding and output layer), ring all-reduce moving ``2 (t-1)/t`` of the
data per GPU; DP gradient traffic ``2 Psi`` (ZeRO stages 0-2) or ``3 Psi`` (stage 3) in
16-bit, times ``(Nd-1)/Nd`` (:func:`dp_traffic_units`). Under a pipeline schedule with ``m`` micro
batches ZeRO 3 moves ``(m + 2) Psi``: torch's schedules keep a unit gathered from its backward to its next
forward, so each model chunk is all-gathered ``m + 1`` times (:mod:`.pipeline`; with ``v`` chunks of
``Psi / v`` each, ``(m + 1) Psi`` in all), then reduce-scattered once; ZeRO 2 gathers once and reduce-scatters once, ``2 Psi``. A group that spans nodes runs at the inter-node bandwidth.
"""

from __future__ import annotations

from typing import Optional, Union

from ..config import GPTConfig
from .memory import recompute_granularity

__all__ = ["dp_traffic_units", "flops_per_iteration", "training_flops_per_sequence", "reference_flops", "rank_flops_imbalance", "iteration_time",
           "FLOPS_FORMULA"]

FLOPS_FORMULA = {
    False: "72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (Narayanan et al. 2021; no recomputation; "
           "full s^2 attention; V = padded vocabulary)",
    True: "96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) (Narayanan et al. 2021, eq. 3; full recomputation; "
          "full s^2 attention; V = padded vocabulary)",
}
ABSTRACT_FLOPS_FORMULA = {False: "6*N FLOPs per token (no recomputation)",
                          True: "8*N FLOPs per token (full recomputation)"}


def flops_per_iteration(config: GPTConfig, global_batch: int, recompute: Union[bool, str, None],
                        vocab: int) -> float:
    """Executed FLOPs of one training iteration over ``global_batch`` sequences (any ffn width).

    ``recompute``: ``False``/``None`` (model FLOPs, what MFU counts), ``True``/``"full"`` (one more
    forward of every layer) or ``"selective"`` (one more forward of the attention core)."""
    layer, logits = training_flops_per_sequence(config, recompute, vocab)
    return float(global_batch * (config.num_layers * layer + logits))


def training_flops_per_sequence(config: GPTConfig, recompute: Union[bool, str, None], vocab: int) -> tuple[int, int]:
    """Executed FLOPs of one sequence's forward and backward: per transformer layer (with the
    recomputed forward) and for the logits, which a pipeline's stages sum over their own layers."""
    s, h, f = config.seq_length, config.hidden_size, config.ffn_hidden_size
    assert f is not None  # (GPTConfig.__post_init__ sets it)
    width, l = config.attention_width, config.num_layers  # the queries' width: h unless kv_channels sets it
    seen = sum(min(config.layer_window(i) or s, s) for i in range(l))  # keys a query sees, over the layers
    core_fwd = round(4 * s * seen * width / l)
    kv = config.kv_groups * config.head_dim  # the key (and the value) width: h without grouped queries
    mats = 3 if config.swiglu else 2        # SwiGLU: gate, up and down
    layer_fwd = 4 * s * h * width + 4 * s * h * kv + _mlp_forward(config, s, mats) + core_fwd
    extra = {None: 0, "full": layer_fwd, "selective": core_fwd}[recompute_granularity(recompute)]
    return 3 * layer_fwd + extra, 3 * 2 * s * h * vocab


def _mlp_forward(config: GPTConfig, s: int, mats: int) -> int:
    """One sequence's MLP forward FLOPs per layer (the mean over the layers): ``2 mats s h f`` for a dense MLP;
    a mixture of experts' active part, the top-k experts and the shared expert (``2 mats s h (k f_e + S)``), the
    router (``2 s h E``) and the shared expert's gate (``2 s h``), on the layers ``--moe-layer-freq`` names
    (docs/moe.md)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    assert f is not None
    dense = 2 * mats * s * h * f
    if config.num_experts is None:
        return dense
    moe = config.num_moe_layers
    active = config.moe_router_topk * config.expert_ffn_hidden_size + (config.moe_shared_expert_intermediate_size or 0)
    per_moe = 2 * mats * s * h * active + 2 * s * h * (config.num_experts + (1 if config.moe_shared_expert_gate else 0))
    return round(((config.num_layers - moe) * dense + moe * per_moe) / config.num_layers)


def reference_flops(B: int, s: int, l: int, h: int, V: int, recompute: bool) -> float:
    """Narayanan et al. 2021's closed forms (eq. 3, f = 4h; docs/plan.md), used to check :func:`flops_per_iteration`."""
    if recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def rank_flops_imbalance(config: GPTConfig, tp: int) -> float:
    """Largest TP rank's share of the layer FLOPs over the mean share (1.0 when heads split evenly)."""
    s, h, a = config.seq_length, config.hidden_size, config.num_attention_heads
    heads, ffn = config.heads_per_rank(tp), config.ffn_per_rank(tp)
    kv = [len(g) * config.head_dim for g in config.kv_groups_per_rank(tp)] if config.kv_groups < a else \
        [hr * config.head_dim for hr in heads]
    mats = 3 if config.swiglu else 2
    # per token and layer: queries, output and core (4h^2 + 4sh) scale with heads, keys and values (4 h kv)
    # with the rank's KV heads, the MLP (2 mats h f) with columns
    width = config.attention_width
    work = [(4 * h * width + 4 * s * width) * hr / a + 4 * h * k + 2 * mats * h * fr for hr, k, fr in zip(heads, kv, ffn)]
    return max(work) * tp / sum(work)


def dp_traffic_units(zero_stage: int, pipeline_micro_batches: Optional[int] = None) -> int:
    """Multiples of ``Psi`` (x bytes per gradient x ``(Nd-1)/Nd``) a rank moves over DP per iteration: 2 at
    ZeRO 0-2 (all-reduce; reduce-scatter + all-gather), 3 at ZeRO 3 (two all-gathers, a reduce-scatter); under
    a pipeline schedule of ``pipeline_micro_batches`` micro batches, ZeRO 3's ``m + 2`` (module
    docstring)."""
    if zero_stage != 3:
        return 2
    return 3 if pipeline_micro_batches is None else pipeline_micro_batches + 2


def iteration_time(*, flops: float, gpus: int, gpu_tflops: float, mfu: float, imbalance: float,
                   tp: int, dp: int, zero_stage: int, psi: int, tokens_per_dp_rank: int,
                   hidden: int, layers: int, recompute: bool, act_bytes: int, grad_bytes: int,
                   gpus_per_node: int, intra_gbps: float, inter_gbps: float,
                   pipeline_micro_batches: Optional[int] = None) -> dict:
    """Seconds per iteration: compute (with the uneven-rank factor), TP and DP communication.

    ``tokens_per_dp_rank`` is ``global_batch * seq / dp``; bandwidths are per GPU in GB/s;
    ``pipeline_micro_batches``: the DP traffic of one pipeline stage (:func:`dp_traffic_units`).
    """
    compute = flops / (gpus * gpu_tflops * 1e12 * mfu) * imbalance
    tp_bw = (intra_gbps if tp <= gpus_per_node else inter_gbps) * 1e9
    dp_bw = (intra_gbps if tp * dp <= gpus_per_node else inter_gbps) * 1e9
    n_allreduce = layers * (6 if recompute else 4) + 2
    tp_bytes = (tokens_per_dp_rank * hidden * act_bytes * n_allreduce * 2 * (tp - 1) / tp) if tp > 1 else 0.0
    units = dp_traffic_units(zero_stage, pipeline_micro_batches)
    dp_bytes = (units * psi * grad_bytes * (dp - 1) / dp) if dp > 1 else 0.0
    tp_time, dp_time = tp_bytes / tp_bw, dp_bytes / dp_bw
    return {"compute_s": compute, "tp_comm_s": tp_time, "dp_comm_s": dp_time,
            "tp_comm_bytes": round(tp_bytes), "dp_comm_bytes": round(dp_bytes),
            "total_s": compute + tp_time + dp_time}
