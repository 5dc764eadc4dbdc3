"""Per-device memory: model states (ZeRO paper accounting) and activations (Korthikanti et al.).

Model states (Rajbhandari et al., ZeRO, SC20, sections 3.1 and 5). Mixed-precision
Adam keeps ``2 Psi`` bytes of 16-bit parameters, ``2 Psi`` of 16-bit gradients and
``K Psi`` of optimizer states (fp32 master weights, momentum, variance: K = 12),
16 Psi in all, for a model-parallel shard of ``Psi`` parameters. ZeRO partitions
over the ``Nd`` data-parallel ranks: stage 1 the optimizer states, stage 2 also
the gradients, stage 3 also the parameters:

    stage 0: 16 Psi   stage 1: 4 Psi + 12 Psi / Nd   stage 2: 2 Psi + 14 Psi / Nd   stage 3: 16 Psi / Nd

fp32 training keeps 4 + 4 bytes of parameters and gradients and K = 8 (momentum,
variance), again 16 Psi. Two accountings of tnlg's engine go beyond the paper:
``--accumulate-allreduce-grads-in-fp32`` keeps 4-byte gradients (2 + 4 + 12/Nd at
stage 1), and ZeRO-2 through FSDP2 keeps the 16-bit DP shard of the parameters
beside the unsharded copy it holds from a unit's forward to its backward
(``+ 2 Psi / Nd``; ``engine=True``). Buffers (communication buckets, fragmentation, the CUDA
context) are not counted; the headroom is what is left for them.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4): per transformer layer and micro batch ``b``, with
16-bit activations and dropout masks of one byte,

    no TP:  s b h (34 + 5 a s / h)        TP = t:  s b h (10 + 24/t + 5 a s / (h t))

bytes (no sequence parallelism), where ``10 s b h`` is replicated (LayerNorm inputs,
the inputs of QKV and fc, two dropout masks) and ``24/t`` is split: ``8`` in attention
(Q, K, V, the projection input) and ``16`` in the MLP (fc output, GeLU output);
``5 a s / (h t)`` is the attention core (softmax output 2, dropout mask 1, dropout
output 2 bytes per score, ``a s^2 b / t`` scores). With heads split unevenly the
largest rank holds ``a_r`` of ``a`` heads and ``f_r`` of ``f`` MLP columns, so its
share is ``8 a_r/a + 16 f_r/f`` and ``5 a_r s / h``.

The Llama family: RMSNorm keeps its 16-bit input as LayerNorm does (``tnlg.model._RMSNorm``) and rope keeps
no more than the rotated queries and keys (the ``cos``/``sin`` tables are ``s d`` per sequence); grouped-query
attention's keys and values are counted at the queries' width (``8`` unchanged): exact where the rank copies
its groups to its heads (uneven splits, attention dropout), an upper bound of ``4 s b (h - g d) / t`` bytes
per layer (``g`` KV groups of ``d`` channels) where SDPA reads the groups themselves (``enable_gqa``; the
llama3-8b plan stays within 5% of the simulation, tests/test_simulate.py); SwiGLU keeps the fc output (gate and up, ``2 f``), silu's output
and the product, ``8 s b f_r`` bytes, where GELU keeps ``4 s b f_r`` (``16 s b h`` at ``f = 4h``).

Sequence parallelism (section 4.2.2) splits the replicated ``10 s b h`` over the
sequence: rank ``r`` keeps ``10 s_r b h`` for its ``s_r`` positions (the column layers
store only the shard of their input and all-gather it again in backward), so with
``t | s``

    TP + SP:  s b h / t (34 + 5 a s / h)

and with an uneven split the largest rank's ``s_r = ceil(s / t)`` replaces ``s / t``.

Recomputation (section 5): ``selective`` keeps everything but the attention core
(drops the ``5 a s / h`` term: ``s b h (10 + 24/t)``, with SP ``34 s b h / t``) and
recomputes one layer's core during that layer's backward; ``full`` keeps only each
layer's input, ``2 s b h`` per layer (with SP ``2 s_r b h``), plus the activations of
the one layer being recomputed during its backward; with SP that layer's backward also
holds a column layer's re-gathered full-sequence input and its full-sequence input
gradient before the reduce-scatter, ``4 s b h`` (the peak of full recomputation is that
layer's backward, so it shows; without recomputation it falls where earlier layers'
activations are already freed).

Dropout masks are counted only where the config has dropout (``hidden_dropout > 0``:
the ``2 s b h`` of the two hidden masks and the embedding's ``s b h``;
``attention_dropout > 0``: the attention core's mask and dropout output, else only the
softmax output, ``2 a s / h``). The paper's core is PyTorch's math attention kernel
(``attention="math"``). A fused kernel (flash or memory-efficient attention, what
``F.scaled_dot_product_attention`` runs on GPUs, and on CPUs without attention dropout)
keeps no ``a s^2`` tensor but its output, ``2 s b h a_r / a``, and the fp32 log-sum-exp,
``4 a_r s b`` (``attention="fused"``); selective recomputation then keeps neither.

``tnlg plan`` counts the kernel the GPU runs (:func:`gpu_attention`): fused for fp16/bf16,
math for fp32; the step's peak so planned agrees with :mod:`tnlg.training.simulate` within 3% at
tnlg-17b (TP 4 x DP 64 fp16, TP 8 x DP 32 bf16 with full recomputation) and GPT-2-XL (TP 1 bf16).

Outside the layers (section 4.3): the embedding dropout mask ``s b h``, the final
LayerNorm input ``2 s b h`` (both ``s_r`` with SP) and the fp32 logits of the
vocabulary shard for the cross-entropy, ``4 s b V_p / t``. fp32 training doubles
everything (masks counted at 2 bytes too).

A mixture of experts (:mod:`.experts`): a MoE layer counts its MLP slot's activations
(:func:`.experts.moe_activation_bytes`: the routed token copies under even routing, the router, the shared
expert) in place of the dense MLP's ``8 s b f_r`` (SwiGLU) or ``4 s b f_r``; the model states of expert
parallelism split by gradient kind (:func:`model_state_bytes_by_kind`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Union

from ..config import GPTConfig
from ..errors import UserError
from .experts import moe_activation_bytes, moe_dispatch_bytes

__all__ = ["PRECISIONS", "check_zero_and_precision", "model_state_bytes", "model_state_bytes_by_kind",
           "activation_bytes", "fsdp_shard_numel",
           "recompute_granularity", "gpu_attention",
           "ACTIVATION_FORMULA", "MODEL_STATE_FORMULA"]

# precision -> (bytes per parameter, bytes per gradient, K optimizer bytes per parameter)
PRECISIONS: dict[str, tuple[int, int, int]] = {"fp16": (2, 2, 12), "bf16": (2, 2, 12), "fp32": (4, 4, 8)}

MODEL_STATE_FORMULA = ("ZeRO paper (Rajbhandari et al. 2020): mixed-precision Adam, 2 + 2 + K bytes per "
                       "parameter with K = 12 (fp32: 4 + 4 + 8); stage 1 partitions the optimizer "
                       "states, stage 2 also gradients, stage 3 also parameters over the DP group")
ACTIVATION_FORMULA = ("Korthikanti et al. 2022: per layer s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes "
                      "(= s*b*h*(34 + 5*a*s/h) at t = 1; uneven heads: the largest rank's "
                      "8*a_r/a + 16*f_r/f and 5*a_r*s/h); sequence parallelism: 10*s_r*b*h for the "
                      "replicated part, s*b*h/t*(34 + 5*a*s/h) when t divides s; selective "
                      "recomputation drops 5*a*s/h; full recomputation: 2*s*b*h per layer "
                      "(2*s_r*b*h with SP) + one layer being recomputed; plus s*b*h*3 (s_r with SP) "
                      "+ 4*s*b*V_p/t outside the layers")


def check_zero_and_precision(zero_stage: int, precision: str) -> None:
    """Raise :class:`UserError` for a ZeRO stage outside 0-3 or an unknown precision."""
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero-stage {zero_stage!r} is not a ZeRO stage; valid stages: 0 (plain data "
                        f"parallelism), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).")
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r} is not supported; valid: {', '.join(PRECISIONS)}.")


def model_state_bytes(psi: int, dp: int, zero_stage: int, precision: str = "fp16", *,
                      grads_fp32: bool = False, engine: bool = False, shard_psi: Optional[int] = None) -> dict:
    """Bytes of parameters, gradients and optimizer states per device for a shard of ``psi`` parameters.

    ``grads_fp32``: 4-byte gradients with 16-bit parameters (fp32 accumulation). ``engine``:
    tnlg's engine rather than the paper's abstract one (stage 2 adds FSDP2's parameter shard).
    ``shard_psi``: the elements this rank holds when stages 2/3 shard every parameter along
    dim 0 (FSDP2 gives rank 0 ``ceil(rows / dp)`` rows of each, a little over ``psi / dp``);
    default ``psi / dp``.
    """
    check_zero_and_precision(zero_stage, precision)
    p_bytes, g_bytes, k = PRECISIONS[precision]
    if grads_fp32:
        g_bytes = 4
    shard = shard_psi if shard_psi is not None and zero_stage >= 2 else psi / dp
    params = p_bytes * (shard if zero_stage >= 3 else psi)
    if engine and zero_stage == 2 and dp > 1:
        params += p_bytes * shard
    grads = g_bytes * (shard if zero_stage >= 2 else psi)
    optim = k * (shard if zero_stage >= 2 else psi / dp if zero_stage == 1 else psi)
    return {"params": round(params), "grads": round(grads), "optimizer": round(optim),
            "total": round(params + grads + optim), "k": k}


def model_state_bytes_by_kind(dense_psi: int, expert_psi: int, gradient_ranks: int, ep: int, zero_stage: int,
                              precision: str = "fp16", *, grads_fp32: bool = False) -> dict:
    """:func:`model_state_bytes` of tnlg's engine with expert parallelism (ZeRO 0/1, one flat backend per gradient
    kind, :mod:`tnlg.optim.kinds`): ``dense_psi`` parameters partitioned over the ``gradient_ranks`` (DP x CP),
    ``expert_psi`` over the expert-data-parallel ranks ``gradient_ranks / ep``. The totals, and ``dense`` and
    ``experts`` apart."""
    dense = model_state_bytes(dense_psi, gradient_ranks, zero_stage, precision, grads_fp32=grads_fp32, engine=True)
    experts = model_state_bytes(expert_psi, gradient_ranks // ep, zero_stage, precision, grads_fp32=grads_fp32,
                                engine=True)
    out = {key: dense[key] + experts[key] for key in ("params", "grads", "optimizer", "total")}
    out.update(k=dense["k"], dense=dense, experts=dict(experts, psi=expert_psi, ranks=gradient_ranks // ep))
    return out


def fsdp_shard_numel(config: GPTConfig, tp: int, dp: int) -> int:
    """Elements of TP rank 0's shard that DP rank 0 holds when every parameter is split along dim 0
    over ``dp`` ranks as FSDP2 does (``ceil(rows / dp)`` rows each); built on the meta device."""
    import json
    return _fsdp_shard_numel(json.dumps(config.to_dict(), sort_keys=True), tp, dp)


@lru_cache(maxsize=64)
def _fsdp_shard_numel(config_json: str, tp: int, dp: int) -> int:
    import json

    import torch

    from ..model import GPT
    from ..parallel.state import ParallelState
    with torch.device("meta"):
        shard = GPT(GPTConfig.from_dict(json.loads(config_json)), ParallelState.for_virtual_rank(tp, 0))
    total = 0
    for p in shard.parameters():
        rows = p.shape[0] if p.dim() else 1
        total += -(-rows // dp) * (p.numel() // max(rows, 1))
    return total


def gpu_attention(precision: str) -> str:
    """The attention kernel the model's ``F.scaled_dot_product_attention`` runs on a GPU at ``precision``:
    ``"fused"`` (flash attention, dropout included) for fp16/bf16 without a mask, which is what tnlg
    pretrains with; ``"math"`` for fp32, as the planner counts it. :mod:`tnlg.training.simulate` runs the
    same kernels, and ``tnlg plan`` plans with this one."""
    return "math" if precision == "fp32" else "fused"


def recompute_granularity(recompute: Union[bool, str, None]) -> Optional[str]:
    """``True`` -> ``"full"`` (the older boolean), ``False``/``None`` -> ``None``; ``"full"`` and
    ``"selective"`` as given; anything else is a :class:`UserError`."""
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return None
    if recompute in ("full", "selective"):
        return recompute
    raise UserError(f"recompute granularity {recompute!r} is not one of full, selective (or none).")


def _attention_core_bytes(config: GPTConfig, heads_r: int, s: int, b: int, attention: str, scale: int) -> float:
    """What one layer's attention core keeps for backward on the largest TP rank (``heads_r`` heads)."""
    if attention == "math":  # softmax output (2), dropout mask (1) and dropout output (2) per score
        return (5 if config.attention_dropout > 0 else 2) * heads_r * s * s * b * scale
    if attention == "fused":  # the kernel's output and its fp32 log-sum-exp
        h, a = config.hidden_size, config.num_attention_heads
        return (2 * s * b * h * heads_r / a) * scale + 4 * heads_r * s * b
    raise UserError(f"attention kernel {attention!r} is not one of math, fused.")


def activation_bytes(config: GPTConfig, tp: int, micro_batch: int, recompute: Union[bool, str, None],
                     precision: str = "fp16", *, sequence_parallel: bool = False, attention: str = "math",
                     ep: int = 1) -> dict:
    """Activation bytes of the largest TP rank for one micro batch (see the module docstring).

    ``recompute``: ``False``/``None`` (keep everything), ``"selective"``, ``"full"`` or ``True``
    (= ``"full"``). ``sequence_parallel``: activations between the TP regions split over the
    sequence (ignored at ``tp == 1`` and when the sequence is shorter than ``tp``, as the model).
    ``attention``: ``"math"`` (the paper's materialised softmax) or ``"fused"`` (flash-style kernel).
    ``ep``: a mixture of experts' expert-parallel ranks (the dispatch's moment, :func:`.experts.moe_dispatch_bytes`).

    Returns ``layers`` (all transformer layers, what they keep for backward),
    ``recompute_working`` (what one layer's recomputation holds during its backward: the whole
    layer for full, the attention core for selective, 0 without recomputation), ``outside``
    (embedding mask, final LayerNorm, fp32 logits) and ``total``; ``per_layer`` is one layer
    without recomputation (a dense one), ``attention_core`` its ``5 a_r s^2 b`` part; ``seq_per_rank`` the
    positions the largest rank holds between the TP regions. With experts also ``moe_layer`` (one MoE layer),
    ``moe_mlp`` (its MLP slot, :func:`.experts.moe_activation_bytes`) and ``moe_working`` (the dispatch's
    moment, in ``total`` where it exceeds the logits, or on top of the recomputed layer); ``None`` / 0 without.
    """
    granularity = recompute_granularity(recompute)
    s, b, h, a, l = config.seq_length, micro_batch, config.hidden_size, config.num_attention_heads, config.num_layers
    heads_r = max(config.heads_per_rank(tp))
    ffn_r = max(config.ffn_per_rank(tp))
    scale = 2 if precision == "fp32" else 1
    s_r = -(-s // tp) if sequence_parallel and 1 < tp <= s else s  # largest rank: ceil(s / t) positions
    hidden_masks = config.hidden_dropout > 0
    # LayerNorm / QKV / fc inputs (8), two dropout masks (2)
    replicated = (8 + (2 if hidden_masks else 0)) * s_r * b * h * scale
    # Q, K, V (the keys and values each query head reads: as wide as Q with grouped queries too), the
    # projection input; the MLP's fc and GeLU outputs (4 bytes per column), SwiGLU's gate and up, silu
    # and product (8)
    split = (s * b * h * 8 * heads_r / a + (8 if config.swiglu else 4) * s * b * ffn_r) * scale
    core = _attention_core_bytes(config, heads_r, s, b, attention, scale)
    per_layer = replicated + split + core
    # a mixture of experts' layer: its MLP slot (routed copies, router, shared expert) for the dense MLP's
    moe = config.num_moe_layers
    moe_slot = moe_activation_bytes(config, tp, s * b, precision) if moe else None
    swap = 0.0 if moe_slot is None else moe_slot["total"] - (8 if config.swiglu else 4) * s * b * ffn_r * scale
    heaviest = per_layer + (swap if moe == l else max(swap, 0.0) if moe else 0.0)  # the largest layer
    layers: float
    working: float
    if granularity == "full":  # (+ SP: the gathered input of a column layer and its gradient, full length)
        layers, working = 2 * s_r * b * h * l * scale, heaviest + (4 * s * b * h * scale if s_r != s else 0)
    elif granularity == "selective":
        layers, working = (replicated + split) * l + swap * moe, core
    else:
        layers, working = per_layer * l + swap * moe, 0.0
    outside = (3 if hidden_masks else 2) * s_r * b * h * scale + 4 * s * b * config.padded_vocab_size(tp) / tp
    # a MoE layer's dispatch holds its tokens' copies a moment (.experts.moe_dispatch_bytes): beyond the logits
    # outside the layers (the forward's last peak), or on top of the layer a full recomputation runs again
    moe_working = moe_dispatch_bytes(config, s * b, ep, precision) if moe else 0
    transient = moe_working if granularity == "full" else max(moe_working - outside, 0)
    return {"per_layer": round(per_layer), "attention_core": round(core), "layers": round(layers),
            "recompute_working": round(working), "outside": round(outside),
            "moe_layer": None if moe_slot is None else round(per_layer + swap), "moe_mlp": moe_slot,
            "moe_working": moe_working, "total": round(layers + working + outside + transient), "seq_per_rank": s_r,
            "granularity": granularity,
            "sequence_parallel": s_r != s, "attention": attention}
