"""megatron-core's ``TransformerConfig`` field by field: what tnlg does with each (docs/megatron.md).

A Megatron-LM run turns its ``args`` into a ``TransformerConfig`` (``core_transformer_config_from_args``:
each field from the argument of its own name, a few from older names: ``apply_layernorm_1p``,
``norm_epsilon``, ``num_experts``, ``decoder_first_pipeline_num_layers``, ...), and the checkpoint keeps
those ``args``. Every field of megatron-core 0.16.1's ``TransformerConfig`` is in exactly one of three
tables (a test walks the installed class's fields, so a field a later megatron-core adds fails it
until it is placed):

* :data:`HONOURED`: tnlg computes what Megatron computes with it (read into :class:`~tnlg.config.GPTConfig`,
  or checked, by :mod:`.args`);
* :data:`INERT`: it does not change what the saved model computes (how it runs, is initialised,
  communicates, or a choice that only acts together with a refused one), each with its reason;
* :data:`REFUSED`: tnlg models one value (or a few); any other selects a model tnlg does not
  compute, and :func:`check_refused` names it in one paragraph before anything is written.

:data:`REFUSED` also holds Megatron-LM arguments that are no ``TransformerConfig`` field but select the
model (``squared_relu``, ...); :data:`HONOURED_ARGS` those tnlg reads (``use_rope_scaling``).
A saved value of ``None`` is an argument the run
did not save: Megatron's default, which tnlg models.
"""

from __future__ import annotations

from typing import NamedTuple

from ...errors import UserError
from .safe_load import shown

__all__ = ["HONOURED", "HONOURED_ARGS", "INERT", "REFUSED", "Refused", "inert_fields", "check_refused"]

# field -> where tnlg reads it (the saved argument(s) and what it becomes)
HONOURED: dict[str, str] = {
    "num_layers": "num_layers, checked against the layers the files hold",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups, read with group_query_attention as Megatron-LM does (else one per head)",
    "ffn_hidden_size": "ffn_hidden_size",
    "kv_channels": "kv_channels: the width of every head (default hidden_size / num_attention_heads)",
    "qk_layernorm": "qk_layernorm: the normalization over each head's queries and keys (q_layernorm, k_layernorm)",
    "window_size": "sliding_window: (w - 1, 0) is tnlg's window w; a window that looks ahead is refused",
    "window_attn_skip_freq": "window_layers: which layers slide (every N-th full, or a list of 0 / 1)",
    "hidden_dropout": "hidden_dropout",
    "attention_dropout": "attention_dropout",
    "layernorm_epsilon": "norm_epsilon (older runs: layernorm_epsilon)",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "gated_linear_unit": "swiglu (a saved gated_linear_unit must agree with it)",
    "activation_func": "swiglu (SiLU) or openai_gelu (tanh GELU) else Megatron's erf GELU",
    "normalization": "normalization: LayerNorm or RMSNorm",
    "init_method_std": "init_method_std",
    "tensor_model_parallel_size": "tensor_model_parallel_size: how the files split the tensors",
    "pipeline_model_parallel_size": "pipeline_model_parallel_size: how the files split the layers",
    "fp16": "the weights' element type, read from the tensors themselves",
    "bf16": "the weights' element type, read from the tensors themselves",
    "params_dtype": "the weights' element type, read from the tensors themselves",
    "num_moe_experts": "num_experts (Megatron-LM's --num-experts): the routed experts of each MoE layer",
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate": "moe_shared_expert_gate",
    "moe_layer_freq": "moe_layer_freq: every N-th layer, or a list of 0 / 1 per layer",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_router_score_function": "moe_router_score_function: softmax or sigmoid",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias (a checkpoint with the bias is refused by "
                                     "the converter: tnlg checkpoints do not hold it yet)",
    "moe_router_bias_update_rate": "moe_router_bias_update_rate",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type: aux_loss, seq_aux_loss or none (others "
                                      "refused)",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_expert_capacity_factor": "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity": "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy": "moe_token_drop_policy",
    "expert_model_parallel_size": "expert_model_parallel_size: how the legacy files split the experts "
                                  "(mp_rank_TT[_PPP]_EEE)",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size: the experts' TP split, which must be TP "
                                   "(unset: TP); another is refused",
}

# Megatron-LM arguments that are no TransformerConfig field but that tnlg reads (:mod:`.args`)
HONOURED_ARGS: dict[str, str] = {
    "use_rope_scaling": "rope_scaling_type llama3 (low/high frequency factors 1 and 4, original length 8192: "
                        "megatron-core's RotaryEmbedding._apply_scaling), with rope_scaling_factor",
    "rope_scaling_factor": "rope_scaling_factor (read with use_rope_scaling; Megatron-LM's default 8)",
}

# (fields, why none of them changes what the saved model computes)
INERT: tuple[tuple[tuple[str, ...], str], ...] = (
    (("sequence_parallel", "hierarchical_context_parallel_sizes", "max_seqlen_per_dp_cp_rank",
      "hybrid_context_parallel", "cp_comm_type", "moe_extended_tp",
      "pipeline_model_parallel_comm_backend", "pipeline_dtype", "variable_seq_lengths", "overlap_p2p_comm",
      "batch_p2p_comm", "batch_p2p_sync", "use_ring_exchange_p2p", "deallocate_pipeline_outputs",
      "overlap_p2p_comm_warmup_flush", "microbatch_group_size_per_vp_stage", "mtp_standalone",
      "async_tensor_model_parallel_allreduce", "barrier_with_L1_time", "symmetric_ar_type"),
     "how the work and the activations are split and exchanged between ranks, not what is computed"),
    (("tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
      "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs", "tp_comm_atomic_rs",
      "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend",
      "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "ep_overlap_early_attn_memory_release",
      "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "gradient_accumulation_fusion"),
     "overlap of communication with computation: the same sums in another order of events"),
    (("perform_initialization", "use_cpu_initialization", "init_model_with_meta_device", "init_method",
      "output_layer_init_method", "embedding_init_method", "embedding_init_method_std"),
     "how a new model is initialised; a checkpoint's weights replace it"),
    (("timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
      "_cpu_offloading_context", "fp8_quantizer_factory", "fp4_quantizer_factory", "config_logger_dir", "test_mode"),
     "a runtime hook or log setting of the process, never saved with a meaning for the model"),
    (("recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
      "recompute_modules", "num_microbatches_with_partial_activation_checkpoints", "cpu_offloading",
      "cpu_offloading_num_layers", "cpu_offloading_activations", "cpu_offloading_weights",
      "cpu_offloading_double_buffering", "fine_grained_activation_offloading", "offload_modules",
      "min_offloaded_tensor_size", "clone_scatter_output_in_embedding", "disable_parameter_transpose_cache",
      "activation_func_fp8_input_store", "moe_layer_recompute"),
     "where activations are kept or recomputed: memory, not results"),
    (("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "memory_efficient_layer_norm",
      "bias_dropout_fusion", "apply_rope_fusion", "fused_single_qkv_rope", "use_fused_weighted_squared_relu",
      "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "use_te_activation_func", "attention_backend",
      "transformer_impl", "use_te_rng_tracker"),
     "a fused kernel or library (Transformer Engine or local) of the same operation; tnlg reads both specs' names"),
    (("fp32_residual_connection", "attention_softmax_in_fp32", "disable_bf16_reduced_precision_matmul",
      "deterministic_mode", "batch_invariant_mode", "enable_autocast", "autocast_dtype", "fp8", "fp8_recipe",
      "fp8_param", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
      "fp8_dot_product_attention", "fp8_multi_head_attention", "tp_only_amax_red", "first_last_layers_bf16",
      "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp4", "fp4_recipe", "fp4_param"),
     "the precision the same operations run in; the checkpoint holds the weights at full precision "
     "(a float8 tensor is refused by its element type)"),
    (("apply_query_key_layer_scaling",),
     "divides the scores by the layer number and multiplies them back inside the softmax: the same result"),
    (("enable_cuda_graph", "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph",
      "cuda_graph_warmup_steps", "external_cuda_graph", "cuda_graph_impl", "cuda_graph_scope"),
     "CUDA graph capture of the same kernels"),
    (("flash_decode", "inference_rng_tracker", "inference_sampling_seed", "use_inference_optimized_layers",
      "inference_fuse_tp_communication", "mlp_chunks_for_prefill"),
     "inference kernels and sampling of Megatron's own generation, not the model"),
    (("calculate_per_token_loss",),
     "how a training run weighs micro batches in the loss, not the model (tnlg's own run decides it)"),
    (("log_max_attention_logit", "qk_clip", "qk_clip_alpha", "qk_clip_threshold"),
     "logging, or QK-clip's rescaling of the query/key weights during training: the saved weights are the model"),
    (("moe_shared_expert_overlap", "moe_enable_routing_replay", "moe_router_padding_for_quantization",
      "moe_router_padding_for_fp8", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "moe_token_dispatcher_type",
      "moe_enable_deepep", "moe_flex_dispatcher_backend", "moe_per_layer_logging", "moe_permute_fusion",
      "moe_router_fusion", "moe_deepep_num_sms", "moe_hybridep_num_sms"),
     "how a mixture of experts is run (the dispatcher, grouped GEMM kernels, fusions, overlap, logging, FP8 "
     "padding): the same routing and expert outputs; the expert weights' layout is read from their names"),
    (("mtp_loss_scaling_factor",), "read only with multi-token prediction layers (mtp_num_layers, refused)"),
    (("mrope_section",), "read only with position_embedding_type='mrope' (refused)"),
    (("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
      "dsa_indexer_use_sparse_loss"),
     "read only by the sparse attention variant (experimental_attention_variant, refused)"),
    (("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
      "linear_num_value_heads"),
     "read only by linear-attention layers (linear_attention_freq, refused)"),
    (("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "use_mamba_mem_eff_path"),
     "read only by Mamba layers of a hybrid model (is_hybrid_model, refused)"),
    (("use_kitchen_attention", "kitchen_attention_backend"),
     "read only with use_kitchen (refused)"),
)


class Refused(NamedTuple):
    """A model choice tnlg computes at ``valid`` alone; ``names``: the saved arguments that carry it
    (megatron-core's field name first, then the Megatron-LM argument that sets it, where it differs)."""
    names: tuple[str, ...]
    valid: tuple
    what: str


def _r(names: str, valid: tuple, what: str) -> Refused:
    return Refused(tuple(names.split()), valid, what)


# key: the TransformerConfig field (or, for an argument that is no field, the argument)
REFUSED: dict[str, Refused] = {
    "layernorm_zero_centered_gamma": _r("layernorm_zero_centered_gamma apply_layernorm_1p", (False,),
                                        "LayerNorm weights stored as weight - 1 and applied as 1 + weight "
                                        "(--apply-layernorm-1p)"),
    "no_rope_freq": _r("no_rope_freq", (), "layers without rotary embeddings (NoPE)"),
    "qk_l2_norm": _r("qk_l2_norm", (False,), "L2 normalisation of queries and keys"),
    "softmax_type": _r("softmax_type", ("vanilla",), "a softmax with a sink or off-by-one denominator"),
    "softmax_scale": _r("softmax_scale", (), "an attention scale other than 1 / sqrt(head dim)"),
    "glu_linear_offset": _r("glu_linear_offset", (0, 0.0), "an offset added to the gated linear unit's linear half"),
    "activation_func_clamp_value": _r("activation_func_clamp_value", (), "clamped MLP activations"),
    "attention_output_gate": _r("attention_output_gate", (False,), "a gate on the attention output"),
    "apply_residual_connection_post_layernorm": _r("apply_residual_connection_post_layernorm", (False,),
                                                   "the residual taken after the LayerNorm"),
    "rotary_interleaved": _r("rotary_interleaved", (False,), "interleaved (GPT-J style) rotary embeddings"),
    "multi_latent_attention": _r("multi_latent_attention", (False,), "multi-latent attention"),
    "experimental_attention_variant": _r("experimental_attention_variant", (), "an experimental attention variant"),
    "linear_attention_freq": _r("linear_attention_freq", (), "linear-attention layers"),
    "moe_router_num_groups": _r("moe_router_num_groups", (), "group-limited routing (experts chosen within the "
                                "top device groups, DeepSeek-V3)"),
    "moe_router_group_topk": _r("moe_router_group_topk", (), "group-limited routing (experts chosen within the "
                                "top device groups, DeepSeek-V3)"),
    "moe_router_topk_limited_devices": _r("moe_router_topk_limited_devices", (), "device-limited routing"),
    "moe_router_dtype": _r("moe_router_dtype", (), "a router computed in another precision than the model's"),
    "moe_router_force_load_balancing": _r("moe_router_force_load_balancing", (False,),
                                          "routing forced to balanced random experts (a benchmark mode)"),
    "moe_input_jitter_eps": _r("moe_input_jitter_eps", (), "multiplicative noise on the router's input"),
    "moe_token_dropping": _r("moe_token_dropping", (False,), "the legacy token-dropping MoE"),
    "moe_apply_probs_on_input": _r("moe_apply_probs_on_input", (False,),
                                   "routing weights applied to the experts' input instead of their output"),
    "moe_latent_size": _r("moe_latent_size", (), "experts run in a projected latent space"),
    "mtp_num_layers": _r("mtp_num_layers", (0,), "multi-token prediction layers"),
    "is_hybrid_model": _r("is_hybrid_model", (False,), "a hybrid Mamba model"),
    "heterogeneous_block_specs": _r("heterogeneous_block_specs", (False,), "layers of different shapes"),
    "hetereogenous_dist_checkpoint": _r("hetereogenous_dist_checkpoint", (False,), "layers of different shapes"),
    "use_kitchen": _r("use_kitchen", (False,), "quantised layers (NVIDIA Kitchen)"),
    "quant_recipe": _r("quant_recipe", (), "quantised layers (a quantisation recipe)"),
    "context_parallel_size": _r("context_parallel_size", (1,), "context parallelism"),
    "virtual_pipeline_model_parallel_size": _r("virtual_pipeline_model_parallel_size", (),
                                               "an interleaved (virtual) pipeline schedule's layout"),
    "num_layers_in_first_pipeline_stage": _r("num_layers_in_first_pipeline_stage decoder_first_pipeline_num_layers",
                                             (), "an uneven pipeline split"),
    "num_layers_in_last_pipeline_stage": _r("num_layers_in_last_pipeline_stage decoder_last_pipeline_num_layers",
                                            (), "an uneven pipeline split"),
    "pipeline_model_parallel_layout": _r("pipeline_model_parallel_layout", (), "an uneven pipeline split"),
    "account_for_embedding_in_pipeline_split": _r("account_for_embedding_in_pipeline_split", (False,),
                                                  "an uneven pipeline split"),
    "account_for_loss_in_pipeline_split": _r("account_for_loss_in_pipeline_split", (False,),
                                             "an uneven pipeline split"),
    # Megatron-LM arguments that are no TransformerConfig field
    "squared_relu": _r("squared_relu", (False,), "a squared-ReLU MLP"),
    "quick_geglu": _r("quick_geglu", (False,), "a quick-GELU gated MLP"),
    "rotary_seq_len_interpolation_factor": _r("rotary_seq_len_interpolation_factor", (1, 1.0),
                                              "rope with position interpolation"),
    "num_layers_per_virtual_pipeline_stage": _r("num_layers_per_virtual_pipeline_stage", (),
                                                "an interleaved (virtual) pipeline schedule's layout"),
}


def inert_fields() -> dict[str, str]:
    """field -> why it does not change the computation (:data:`INERT` by field)."""
    return {name: why for names, why in INERT for name in names}


def _plain(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _display(value: object) -> str:
    """A saved value for the message: short tuples and lists of plain values in full, else :func:`shown`."""
    if isinstance(value, (tuple, list)) and len(value) <= 8 and all(_plain(v) for v in value):
        return repr(tuple(value) if isinstance(value, tuple) else list(value))[:80]
    return shown(value)


def _valid(value: object, valid: tuple) -> bool:
    if value is None:
        return True  # not saved: Megatron's default, the value tnlg models
    return _plain(value) and any(type(value) is type(v) or {type(value), type(v)} <= {int, float}
                                 for v in valid if v == value)


def check_refused(args, where: str) -> None:
    """One :class:`UserError` naming the first saved argument of :data:`REFUSED` set to a value that
    selects a model tnlg does not compute."""
    for field, (names, valid, what) in REFUSED.items():
        for name in names:
            value = getattr(args, name, None)
            if _valid(value, valid):
                continue
            alias = "" if name == field else f" (megatron-core's {field})"
            models = " or ".join(map(repr, valid)) if valid else "unset (None)"
            raise UserError(f"{where}: the checkpoint's args set {name}={_display(value)}{alias}, {what}, which tnlg "
                            f"does not model: converted, it would compute another model (tnlg models {name} "
                            f"{models}). Nothing was written.")
