"""A mixture of experts in the plan: parameters and model states per rank under expert parallelism, the MoE
layers' activations, and the all-to-all traffic (docs/plan.md, docs/moe.md; the layer is
:mod:`tnlg.model.moe`).

What experts change against a dense model, per rank (``E`` experts, top-``k``, expert width ``f_e`` of which
the largest TP rank holds ``f_r``, ``mats`` 2 with SwiGLU and 1 with GELU, ``L_m`` MoE layers):

* **Parameters.** A MoE layer holds ``E`` routed experts of ``(mats + 1) f_r h`` parameters each
  (:meth:`tnlg.config.GPTConfig.routed_expert_parameters`); expert parallelism ``EP`` keeps ``E / EP`` of them
  on a rank. Everything else (attention, router, shared expert, embeddings) is dense:
  ``Psi_expert = L_m (E / EP) (mats + 1) f_r h`` and ``Psi_dense`` = the rank's parameters at EP 1 less
  ``L_m E (mats + 1) f_r h``.
* **Model states** (:func:`tnlg.plan.memory.model_state_bytes_by_kind`): the dense ``Psi`` partitioned by ZeRO
  over DP x CP as ever, the experts' over the expert-data-parallel ranks ``N_e = DP x CP / EP`` (the ranks that
  hold the same experts; tnlg's engine keeps one flat ZeRO 0/1 backend per kind, :mod:`tnlg.optim.kinds`). At
  ZeRO 1 with 16-bit parameters: ``4 Psi_dense + 12 Psi_dense / (DP CP) + 4 Psi_expert + 12 Psi_expert / N_e``.
* **Activations** of a MoE layer's MLP slot for a micro batch of ``T = s b`` tokens (:func:`moe_activation_bytes`;
  every TP rank routes all of its micro batch's tokens, with sequence parallelism too), **dropless with even
  routing**: every expert gets ``T k / E`` of the ``T k`` routed copies, so every EP rank runs ``T k`` copies
  (real routing is uneven: the busiest rank holds more; the load-balancing loss keeps it near even). Kept for
  backward, per routed copy (16-bit): the expert's input (the permuted token), its un-permuted output and its
  weighted output (``index_add``'s source), ``2 h`` bytes each; the expert's fc1 output and activation (SwiGLU:
  gate and up ``4 f_r``, silu ``2 f_r``, the product ``2 f_r``; GELU ``2 f_r + 2 f_r``); its routing weight (2);
  and 32 bytes of int64 indices (the routing map's nonzero pairs, the regrouping permutation and its inverse).
  Per token the router's top-k indices and the softmax of the top-k logits (``12 k``, fp32); with the
  load-balancing loss the fp32 scores of every expert (``4 E``), with the z-loss the logits (``2 E``); the shared
  expert as a dense MLP of its width (and its gate's output). fp32 activations double the 2-byte terms. For a
  moment the dispatch also holds the copies of the tokens (in the autocast dtype, which the layer casts them to
  first) before and after the all-to-all (one tensor at EP 1) and regrouped by expert, ``6 h`` bytes per copy
  in 16-bit training (``4 h`` at EP 1; fp32 twice that; :func:`moe_dispatch_bytes`): the forward's peak is the larger of that and the logits outside the layers;
  with full recomputation it adds to the recomputed layer.
* **All-to-all** (EP > 1; :func:`all_to_all_traffic`): per MoE layer and micro batch the dispatch and the combine
  each send ``T k h`` elements from a rank, ``(EP - 1) / EP`` of them to other ranks (even routing), once in
  forward and once (their gradients) in backward; full recomputation runs the forward's two again. ``T = s b /
  CP``. tnlg dispatches the tokens in the autocast dtype (cast before the TP gather, as the dense MLP's column
  layer) and combines the experts' outputs in it: ``(2 + 2) T k h`` bytes each way in 16-bit training
  (:data:`DISPATCH_BYTES`; as megatron-core), ``(4 + 4) T k h`` in fp32. The time is these bytes at the intra-node bandwidth when the EP group (``TP x EP``
  consecutive ranks) fits in a node, else the inter-node one, not overlapped. The counts' own all-to-all (``E``
  integers) is not counted.
"""

from __future__ import annotations

import math
from typing import Optional

from ..config import GPTConfig, divisors, partition_sizes
from ..errors import UserError

__all__ = ["check_expert_layout", "expert_split", "routed_copies", "moe_activation_bytes", "moe_dispatch_bytes",
           "all_to_all_traffic",
           "expert_parallel_sizes", "EXPERT_FORMULA", "ALL_TO_ALL_FORMULA", "DISPATCH_BYTES"]

EXPERT_FORMULA = ("experts: Psi_expert = L_moe (E/EP) (mats+1) f_r h per rank, gradients and optimizer states "
                  "partitioned over the expert-data-parallel ranks DP x CP / EP; the dense rest over DP x CP")
ALL_TO_ALL_FORMULA = ("all-to-all per MoE layer and micro batch: dispatch (the tokens in the autocast dtype) + combine "
                      "(the experts' outputs in it), forward and backward (+ forward again with full "
                      "recomputation), T k h x bytes x (EP-1)/EP each, T = s b / CP; even routing")
# bytes per element of what a rank sends, by precision: (dispatch: the tokens, cast to the autocast dtype before
# the TP gather; combine: the experts' outputs, in the autocast dtype)
DISPATCH_BYTES = {"fp16": (2, 2), "bf16": (2, 2), "fp32": (4, 4)}


def check_expert_layout(config: Optional[GPTConfig], ep: int, gradient_ranks: int, zero_stage: int) -> None:
    """One :class:`UserError` unless ``ep`` expert-parallel ranks can split this model's experts on a layout of
    ``gradient_ranks`` = DP x CP ranks at ``zero_stage``: EP a positive integer dividing ``E`` and DP x CP; ZeRO 0
    or 1 when EP > 1 (tnlg's engine, one flat backend per gradient kind)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise UserError(f"--expert-model-parallel-size must be a positive integer, got {ep!r}.")
    if ep == 1:
        return
    if config is None or config.num_experts is None:
        raise UserError(f"--expert-model-parallel-size {ep} splits the experts of a mixture of experts, but the model "
                        "has none (give --num-experts E, a MoE preset such as mixtral-8x7b, or EP 1).")
    try:
        config.check_expert_parallel(ep)
    except ValueError as err:
        raise UserError(str(err)) from None
    if gradient_ranks % ep:
        raise UserError(f"--expert-model-parallel-size {ep} does not divide the data-parallel x context-parallel size "
                        f"{gradient_ranks}: the experts are split over EP ranks carved from DP x CP (megatron-core's "
                        f"MoE parallel folding). Valid expert-parallel sizes here: "
                        f"{expert_parallel_sizes(config, gradient_ranks)}.")
    if zero_stage >= 2:
        raise UserError(f"expert parallelism (EP {ep}) trains with --zero-stage 0 or 1 (tnlg's flat buffers, one per "
                        "gradient kind: the experts' gradients reduced and partitioned over the expert-data-parallel "
                        "ranks); FSDP2's stages 2 and 3 with a second gradient group are not built. Use --zero-stage 1, "
                        "or EP 1.")


def expert_parallel_sizes(config: GPTConfig, gradient_ranks: int) -> list[int]:
    """Every EP that divides both the experts and DP x CP (``[1]`` for a dense model)."""
    if config.num_experts is None:
        return [1]
    return [n for n in divisors(config.num_experts) if gradient_ranks % n == 0]


def expert_split(config: GPTConfig, per_rank: list[dict], ep: int) -> dict:
    """Each TP rank's parameters at EP ``ep``, dense and routed experts, from ``per_rank`` (the EP 1 counts of a
    :func:`tnlg.plan.counts.parameter_report`, every expert on every rank). ``largest_rank``: the rank with the
    most parameters at this EP (it sets the memory bound)."""
    tp, moe = len(per_rank), config.num_moe_layers
    ranks = []
    for r, counts in enumerate(per_rank):
        every = moe * config.routed_expert_parameters(tp, r, 1)
        expert = moe * config.routed_expert_parameters(tp, r, ep)
        dense = counts["params"] - every
        ranks.append(dict(dense=dense, expert=expert, params=dense + expert))
    largest = max(range(tp), key=lambda r: (ranks[r]["params"], -r))
    return {"ep": ep, "experts_per_rank": (config.num_experts or 0) // ep, "per_rank": ranks,
            "largest_rank": dict(ranks[largest], rank=largest)}


def routed_copies(config: GPTConfig, tokens: int) -> int:
    """The routed token copies an EP rank runs for ``tokens`` tokens, under even routing: ``T k`` dropless; with
    a capacity factor each expert keeps at most ``ceil(T k / E x factor)`` (exactly that many with padding)."""
    E, k = config.num_experts, config.moe_router_topk
    assert E is not None
    if config.moe_expert_capacity_factor is None:
        return tokens * k
    cap = math.ceil(tokens * k / E * config.moe_expert_capacity_factor)
    per_expert = cap if config.moe_pad_expert_input_to_capacity else min(cap, -(-tokens * k // E))
    return E * min(per_expert, tokens)


def moe_activation_bytes(config: GPTConfig, tp: int, tokens: int, precision: str) -> dict:
    """What one MoE layer's MLP slot keeps for backward on the largest TP rank, for ``tokens`` tokens of a micro
    batch (module docstring): ``routed`` (the routed copies), ``router``, ``shared`` (the shared expert and its
    gate) and ``total``, in bytes; ``copies`` the routed copies."""
    E, k, h = config.num_experts, config.moe_router_topk, config.hidden_size
    assert E is not None
    scale = 2 if precision == "fp32" else 1
    f_r = max(partition_sizes(config.expert_ffn_hidden_size, tp))
    mlp = 8 if config.swiglu else 4  # bytes per column a 16-bit MLP keeps: fc1 output and activation (SwiGLU: x 2)
    copies = routed_copies(config, tokens)
    routed = copies * ((6 * h + mlp * f_r + 2) * scale + 32)
    router = 12 * tokens * k
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type != "none":
        router += 4 * tokens * E
    if config.moe_z_loss_coeff:
        router += 2 * tokens * E * scale
    shared = 0
    if config.moe_shared_expert_intermediate_size:
        shared = mlp * tokens * max(partition_sizes(config.moe_shared_expert_intermediate_size, tp)) * scale
        if config.moe_shared_expert_gate:
            shared += 2 * tokens * scale
    return {"copies": copies, "routed": routed, "router": router, "shared": shared, "total": routed + router + shared}


def moe_dispatch_bytes(config: GPTConfig, tokens: int, ep: int, precision: str = "bf16") -> int:
    """What a MoE layer's dispatch holds for a moment in forward beyond what it keeps (module docstring): the
    routed copies of the tokens (in the autocast dtype, :data:`DISPATCH_BYTES`) before the all-to-all, after it
    (EP > 1) and regrouped by local expert, ``2 h`` bytes each per copy in 16-bit training, ``4 h`` in fp32."""
    return routed_copies(config, tokens) * config.hidden_size * DISPATCH_BYTES[precision][0] * (3 if ep > 1 else 2)


def all_to_all_traffic(config: GPTConfig, tp: int, ep: int, cp: int, micro_batch: int, micro_batches: int,
                       precision: str, recompute_full: bool, *, gpus_per_node: int, intra_gbps: float,
                       inter_gbps: float) -> dict:
    """Bytes one rank sends to other EP ranks per iteration (dispatch + combine, forward and backward) and their
    time (module docstring); zeros at EP 1."""
    tokens = config.seq_length // cp * micro_batch
    elements = routed_copies(config, tokens) * config.hidden_size  # one all-to-all's send buffer
    dispatch, combine = (elements * n for n in DISPATCH_BYTES[precision])
    passes = 2 + (1 if recompute_full else 0)  # dispatch + combine: forward, backward (, the recomputed forward)
    per_layer = passes * (dispatch + combine) * (ep - 1) / ep
    per_iteration = per_layer * config.num_moe_layers * micro_batches
    gbps = intra_gbps if tp * ep <= gpus_per_node else inter_gbps
    return {"formula": ALL_TO_ALL_FORMULA, "dispatch_bytes": dispatch, "combine_bytes": combine,
            "all_to_alls_per_layer": 2 * passes,
            "bytes_per_layer": round(per_layer), "bytes_per_iteration": round(per_iteration),
            "bandwidth_gbps": gbps, "time_s": per_iteration / (gbps * 1e9)}
