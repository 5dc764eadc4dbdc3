"""The Hugging Face model families tnlg reads and writes, one :class:`Family` entry each (:data:`FAMILIES`):
GPT-2, Llama, Qwen2, Mistral and Qwen3, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

An entry holds everything that differs between families: ``config.json``'s ``model_type``, transformers'
model and config classes, the weight names' base-model prefix and layer list, the keys of the layer count,
which weight and config mapping it uses (``layout``: ``gpt2`` in :mod:`.hf_mapping`, ``llama`` in
:mod:`.hf_llama`), what its class fixes of the architecture (Qwen2's QKV biases, Qwen3's QK norm, Llama's
optional ``attention_bias`` / ``mlp_bias``, where a window applies, OLMoE's QK norm over every head at once) and the audit of every field its config
class declares (:attr:`Family.honoured`, :attr:`Family.ignored`, :attr:`Family.refused`,
:attr:`Family.undeclared`; checked by :mod:`.hf_fields`). Each entry's audit is built once, here, from
parts shared by name (:data:`COMMON_IGNORED`, the Llama family's honoured fields, the windows'); nothing
changes an entry after it is made. Megatron-LM's names follow the architecture (rope, SwiGLU, QKV biases,
QK norm: :mod:`tnlg.interop.megatron.names`), not the family, so an entry holds none.

Reading, ``model_type`` picks the entry (:func:`family_named`). Writing, the first entry whose class
computes the architecture (:meth:`Family.computes`) is the class written (:func:`family_of`), unless the
checkpoint records the family it was converted from and that family's class computes it too: a Mistral
without a window (Mistral-7B-v0.3, Mistral-Nemo) stays ``MistralForCausalLM``, where the architecture alone
would make it Llama's. A family more is one entry here plus its weight mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

from ..config import GPTConfig
from ..errors import UserError

__all__ = ["Family", "FAMILIES", "COMMON_IGNORED", "NO_WINDOW", "family_named", "family_of"]

# --------------------------------------------------------------------------- the field audit's shared parts

_NOT_READ = "not read by the causal LM's forward"
COMMON_IGNORED = MappingProxyType({
    "transformers_version": "provenance", "_name_or_path": "provenance",
    "architectures": "the class is chosen by model_type, as AutoModelForCausalLM chooses it",
    "output_hidden_states": "what forward returns besides the logits",
    "output_attentions": "what forward returns besides the logits",
    "return_dict": "what forward returns besides the logits",
    "dtype": "the dtype transformers loads into; tnlg reads the weights to fp32 and runs at its own precision",
    "chunk_size_feed_forward": _NOT_READ + " (its feed-forward is not chunked)",
    "is_encoder_decoder": _NOT_READ + " (generate() alone reads it)",
    "id2label": "sequence-classification heads only", "label2id": "sequence-classification heads only",
    "problem_type": "sequence-classification heads only",
    "use_cache": "keeps keys and values for generation; the same logits",
    "pad_token_id": "a token id (tokenizer and generation)", "bos_token_id": "a token id (tokenizer and generation)",
    "eos_token_id": "a token id (tokenizer and generation)",
})

_TIED = ("untie_embeddings_and_output_weights (a file whose lm_head differs from the embedding loads untied, as "
         "transformers keeps them apart)")
# what every Llama-layout class declares and tnlg honours alike (each entry adds model_type and its own)
_LLAMA_HONOURED = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups (grouped-query attention when fewer than the heads)",
    "max_position_embeddings": "max_position_embeddings (and the default seq_length)", "rms_norm_eps": "layernorm_epsilon (RMSNorm)",
    "rope_parameters": "rotary_base (rope_theta) and the rope_* fields of rope_type linear, dynamic, yarn or "
                       "llama3 (docs/llama.md); another rope_type (longrope, ...) is refused by name",
    "tie_word_embeddings": _TIED,
    "attention_dropout": "attention_dropout (training only)",
    "initializer_range": "init_method_std (initialisation only)",
    "head_dim": "kv_channels (the width of every head; null: hidden_size / num_attention_heads)",
}
NO_WINDOW = ("a layer marked sliding_attention needs use_sliding_window true and a sliding_window (transformers "
              "has no window to apply without them)")
_LAYER_WINDOWS = {  # Qwen2's and Qwen3's windows, per layer
    "use_sliding_window": "without it transformers drops sliding_window (no layer slides)",
    "sliding_window": "sliding_window w (the query at p sees the keys p - w + 1 .. p) on the sliding layers",
    "layer_types": "window_layers: the layers marked sliding_attention slide (the rest attend to every earlier "
                   "position); " + NO_WINDOW}
_MAX_WINDOW_LAYERS = ("read by the config class alone, to fill layer_types when it is not given (layers from "
                      "max_window_layers on slide); tnlg reads layer_types")
_SILU = (lambda c: c.hidden_act == "silu", "tnlg's SwiGLU gates with silu")

# keys no class declares that transformers reads all the same, and what tnlg does with them
_UNDECLARED = {
    "quantization_config": "refused: quantized weights (and their scales) are not read",
    "torch_dtype": "dtype's old name: ignored as dtype",
    "auto_map": "ignored: tnlg never runs code from a folder (model_type picks transformers' own class)",
}
_ROPE_UNDECLARED = {
    "rope_scaling": "rope_parameters' old name (transformers moves it there): as rope_parameters",
    "rope_theta": "rope_parameters' old place (transformers moves it there): as rope_parameters",
    "original_max_position_embeddings": "with a yarn or llama3 rope_type, the pretraining length transformers' "
                                        "rope reads before rope_parameters' own (standardize_rope_params gives it "
                                        "priority): tnlg's rope_original_max_position",
}


# --------------------------------------------------------------------------- the entry

def _frozen(fields: Mapping) -> Mapping:
    return MappingProxyType(dict(fields))


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family (module docstring).

    ``layout``: the weight and config mapping (``gpt2``: :mod:`.hf_mapping`'s, ``llama``: :mod:`.hf_llama`'s);
    ``prefix`` / ``layers``: the base model's name and its list of layers in transformers' weight names
    (``model.layers.3....``); ``embedding``: the word embedding's weight name (a tied ``lm_head`` is it);
    ``layer_keys``: ``config.json``'s keys of the layer count, the class's own first; ``aliases``: its
    other names of fields (the config class's ``attribute_map``). What the class fixes: ``qkv_bias`` (biases
    on q/k/v and nowhere else, always), ``qk_norm`` (``q_norm`` / ``k_norm``, always; ``qk_norm_across_heads``:
    each over the whole projection, OLMoE's, so the heads are ``hidden_size / num_attention_heads`` wide), ``linear_biases``
    (Llama's ``attention_bias`` / ``mlp_bias``), ``window`` (``none``; ``every_layer``: one
    ``sliding_window`` or none; ``layer_types``: per layer), ``window_off`` (a ``sliding_window`` value the
    config class writes for "none": Qwen2-MoE's 0). A mixture of experts: ``experts`` (the published
    per-expert names: the module holding ``gate`` and ``experts.N``, and the gate, up and down projections'
    names), ``shared_expert`` (Qwen2-MoE's sigmoid-gated one), ``qkv_bias_field`` (a ``qkv_bias`` field
    sets the biases). The audit: ``honoured`` (field -> the
    :class:`~tnlg.config.GPTConfig` field it sets), ``ignored`` (field -> why the logits do not depend on
    it), ``refused`` (field -> (accepts(config) -> bool, why other values are refused)), ``undeclared``
    (keys the class does not declare that transformers reads all the same -> what tnlg does)."""

    model_type: str
    model_class: str
    config_class: str
    what: str
    layout: str
    prefix: str
    layers: str
    embedding: str
    layer_keys: tuple[str, ...]
    honoured: Mapping[str, str]
    ignored: Mapping[str, str]
    refused: Mapping[str, tuple[Callable, str]]
    undeclared: Mapping[str, str]
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_across_heads: bool = False
    linear_biases: bool = False
    window: str = "none"
    experts: tuple[str, ...] = ()
    shared_expert: bool = False
    qkv_bias_field: bool = False
    window_off: Optional[int] = None

    def computes(self, cfg: GPTConfig) -> bool:
        """Whether this family's class computes ``cfg``'s architecture (the same logits, weights mapped)."""
        if (cfg.num_experts is not None) != bool(self.experts) or (self.experts and not self._computes_experts(cfg)):
            return False
        if self.layout == "gpt2":
            return (cfg.position_embedding_type == "learned_absolute" and cfg.normalization == "LayerNorm"
                    and not cfg.swiglu and cfg.add_bias_linear and cfg.kv_groups == cfg.num_attention_heads
                    and cfg.kv_channels is None and not cfg.qk_layernorm and cfg.sliding_window is None)
        gpt2_only = not cfg.scale_attn_weights or cfg.scale_attn_by_inverse_layer_idx
        if not (cfg.position_embedding_type == "rope" and cfg.normalization == "RMSNorm" and cfg.swiglu
                and cfg.rotary_percent == 1.0 and not gpt2_only and cfg.qk_layernorm == self.qk_norm
                and cfg.qk_layernorm_across_heads == self.qk_norm_across_heads):
            return False
        if self.qk_norm_across_heads and cfg.kv_channels is not None:  # (its q_norm is hidden_size wide)
            return False
        if self.linear_biases:  # attention_bias: q, k, v and o together; mlp_bias: gate, up, down
            biases = cfg.qkv_bias == cfg.attn_out_bias
        else:
            qkv = self.qkv_bias_field or cfg.qkv_bias == self.qkv_bias  # (Qwen2-MoE's qkv_bias: either)
            biases = qkv and not cfg.attn_out_bias and not cfg.mlp_biases
        every_layer = cfg.window_layers is None or all(cfg.window_layers)
        window = {"none": cfg.sliding_window is None, "every_layer": cfg.sliding_window is None or every_layer,
                  "layer_types": True}[self.window]
        return biases and window

    def _computes_experts(self, cfg: GPTConfig) -> bool:
        """What a mixture-of-experts class computes: softmax routing (the k weights renormalised for Mixtral;
        either for Qwen, ``norm_topk_prob``), no scaling, no capacity (transformers drops no token), Qwen2-MoE's
        gated shared expert or none; Mixtral's and OLMoE's experts on every layer, their width the MLP's
        (OLMoE's k weights renormalised or not, ``norm_topk_prob``)."""
        shared = cfg.moe_shared_expert_intermediate_size is not None
        plain = (cfg.moe_router_score_function == "softmax" and cfg.moe_router_topk_scaling_factor is None
                 and cfg.moe_expert_capacity_factor is None and not cfg.moe_router_enable_expert_bias
                 and shared == self.shared_expert and cfg.moe_shared_expert_gate == self.shared_expert)
        if self.model_type in ("mixtral", "olmoe"):
            return plain and cfg.num_moe_layers == cfg.num_layers and cfg.moe_ffn_hidden_size in (
                None, cfg.ffn_hidden_size) and (self.model_type == "olmoe" or not cfg.moe_router_pre_softmax)
        return plain


# --------------------------------------------------------------------------- the families

def _llama_layout(model_type: str, model_class: str, config_class: str, what: str, *, honoured: Mapping,
                  ignored: Mapping, refused: Mapping, undeclared: Mapping = MappingProxyType({}), **fixed) -> Family:
    """An entry of the Llama layout: its own fields on top of what every such class declares (less those it
    refuses)."""
    read = {"model_type": f"picks {model_class}", **_LLAMA_HONOURED, **honoured}
    return Family(model_type, model_class, config_class, what, layout="llama", prefix="model", layers="layers",
                  embedding="model.embed_tokens.weight", layer_keys=("num_hidden_layers",),
                  honoured=_frozen({k: v for k, v in read.items() if k not in refused}),
                  ignored=_frozen({**COMMON_IGNORED, **ignored}), refused=_frozen({"hidden_act": _SILU, **refused}),
                  undeclared=_frozen({**_UNDECLARED, **_ROPE_UNDECLARED, **undeclared}), **fixed)


GPT2 = Family(
    "gpt2", "GPT2LMHeadModel", "GPT2Config", "GPT-2", layout="gpt2", prefix="transformer", layers="h",
    embedding="transformer.wte.weight", layer_keys=("n_layer", "num_hidden_layers"),
    aliases=_frozen({"max_position_embeddings": "n_positions", "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head"}),
    honoured=_frozen({
        "model_type": "picks GPT2LMHeadModel", "vocab_size": "vocab_size", "n_positions": "max_position_embeddings (and the default seq_length)",
        "max_position_embeddings": "max_position_embeddings (n_positions' other name)", "n_embd": "hidden_size",
        "hidden_size": "hidden_size (n_embd's other name)", "n_layer": "num_layers",
        "num_hidden_layers": "num_layers (n_layer's other name)", "n_head": "num_attention_heads",
        "num_attention_heads": "num_attention_heads (n_head's other name)",
        "n_inner": "ffn_hidden_size (null: 4 x n_embd)", "layer_norm_epsilon": "layernorm_epsilon",
        "activation_function": "openai_gelu: gelu_new / gelu_pytorch_tanh (tanh form) or gelu (exact); others refused",
        "tie_word_embeddings": _TIED,
        "resid_pdrop": "hidden_dropout (training only)", "attn_pdrop": "attention_dropout (training only)",
        "embd_pdrop": "training only; tnlg's embedding dropout is hidden_dropout (written back as such)",
        "initializer_range": "init_method_std (initialisation only)",
        "scale_attn_weights": "scale_attn_weights (false: the scores are not divided by sqrt(head_dim))",
        "scale_attn_by_inverse_layer_idx": "scale_attn_by_inverse_layer_idx (layer i's scores divided by i + 1)"}),
    ignored=_frozen({
        **COMMON_IGNORED,
        **{f"summary_{x}": "GPT2DoubleHeadsModel's multiple-choice head only"
           for x in ("type", "use_proj", "activation", "proj_to_labels", "first_dropout")},
        "reorder_and_upcast_attn": "computes the attention scores in fp32, scaled first: rounding only"}),
    refused=_frozen({"add_cross_attention": (lambda c: c.add_cross_attention is False, "cross-attention (an "
                                             "encoder's states) is not part of a causal LM tnlg runs")}),
    undeclared=_frozen(_UNDECLARED))

LLAMA = _llama_layout(
    "llama", "LlamaForCausalLM", "LlamaConfig", "Llama", linear_biases=True,
    honoured={"attention_bias": "add_attn_bias: biases on q/k/v and o_proj (with mlp_bias: add_bias_linear)",
              "mlp_bias": "add_mlp_bias: biases on gate/up/down (with attention_bias: add_bias_linear)"},
    ignored={"pretraining_tp": "not read by LlamaForCausalLM in transformers 5 (it once split the matmuls, "
                               "changing rounding only)"},
    refused={})

QWEN2 = _llama_layout(
    "qwen2", "Qwen2ForCausalLM", "Qwen2Config", "Llama with QKV biases", qkv_bias=True, window="layer_types",
    honoured={"model_type": "picks Qwen2ForCausalLM (biases on Q, K, V: add_qkv_bias)",
              "head_dim": "kv_channels (undeclared by Qwen2Config; its attention reads it by getattr)",
              **_LAYER_WINDOWS},
    ignored={"max_window_layers": _MAX_WINDOW_LAYERS}, refused={},
    undeclared={"head_dim": "Qwen2's attention reads it by getattr: kv_channels, as Llama's head_dim"})

MISTRAL = _llama_layout(
    "mistral", "MistralForCausalLM", "MistralConfig", "Llama with a sliding window", window="every_layer",
    honoured={"sliding_window": "sliding_window w on every layer (the query at p sees the keys p - w + 1 .. p); "
                                "null: none"},
    ignored={}, refused={})

QWEN3 = _llama_layout(
    "qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Llama with QK norm", qk_norm=True, window="layer_types",
    honoured={"model_type": "picks Qwen3ForCausalLM (q_norm, k_norm: qk_layernorm)", **_LAYER_WINDOWS},
    ignored={"max_window_layers": _MAX_WINDOW_LAYERS},
    refused={"attention_bias": (lambda c: c.attention_bias is False, "biases on q/k/v and o_proj are not supported "
                                "yet (tnlg has biases on Q, K, V alone, Qwen2's, or on every linear layer)")})

# the mixtures of experts (docs/moe.md): transformers' router, experts and shared expert as tnlg's MoE layer
_TOPK = "moe_router_topk (each token's experts)"
_AUX = ("training only: transformers adds its load-balancing loss (over every layer's router logits at once, not "
        "megatron-core's per-layer loss) to the loss only with output_router_logits; tnlg's balancing loss is the "
        "run's --moe-aux-loss-coeff")
_MOE_IGNORED = {"router_aux_loss_coef": _AUX,
                "output_router_logits": "what forward returns besides the logits (and whether its auxiliary loss is "
                                        "added in training)"}
_QWEN_MOE = {"moe_intermediate_size": "moe_ffn_hidden_size (each routed expert's width)",
             "norm_topk_prob": "moe_router_pre_softmax false (the k weights renormalised) when true, else true",
             "num_experts_per_tok": _TOPK,
             "decoder_sparse_step": "moe_layer_freq: layer i has experts when (i + 1) % step == 0 and i is not in "
                                    "mlp_only_layers",
             "mlp_only_layers": "moe_layer_freq: these layers keep the dense MLP (intermediate_size)",
             "intermediate_size": "ffn_hidden_size (the dense layers' MLP)"}

MIXTRAL = _llama_layout(
    "mixtral", "MixtralForCausalLM", "MixtralConfig", "a mixture of experts", window="every_layer",
    experts=("block_sparse_moe", "w1", "w3", "w2"),
    honoured={"model_type": "picks MixtralForCausalLM (experts on every layer, renormalised top-k)",
              "num_local_experts": "num_experts", "num_experts": "num_experts (num_local_experts' other name)",
              "num_experts_per_tok": _TOPK,
              "intermediate_size": "ffn_hidden_size (each expert's width)",
              "sliding_window": "sliding_window w on every layer; null: none"},
    ignored={**_MOE_IGNORED, "router_jitter_noise": "training only (multiplies the hidden states by uniform noise "
                                                    "in training, not in the forward tnlg compares); tnlg has none"},
    refused={})

QWEN2_MOE = _llama_layout(
    "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "a mixture of experts with a gated shared expert",
    window="layer_types", experts=("mlp", "gate_proj", "up_proj", "down_proj"), shared_expert=True,
    qkv_bias_field=True, window_off=0,
    honoured={"model_type": "picks Qwen2MoeForCausalLM", "num_experts": "num_experts", **_QWEN_MOE,
              "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size, gated by sigmoid(x w) "
                                                 "(moe_shared_expert_gate)",
              "qkv_bias": "add_qkv_bias (biases on q, k, v)", **_LAYER_WINDOWS},
    ignored={**_MOE_IGNORED, "max_window_layers": _MAX_WINDOW_LAYERS}, refused={})

QWEN3_MOE = _llama_layout(
    "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "a mixture of experts with QK norm", qk_norm=True,
    window="every_layer", experts=("mlp", "gate_proj", "up_proj", "down_proj"),
    honoured={"model_type": "picks Qwen3MoeForCausalLM (q_norm, k_norm: qk_layernorm)",
              "num_local_experts": "num_experts", "num_experts": "num_experts (num_local_experts' other name)",
              **_QWEN_MOE,
              "use_sliding_window": "without it transformers drops sliding_window (no window)",
              "sliding_window": "sliding_window w on every layer (with use_sliding_window)"},
    ignored=_MOE_IGNORED,
    refused={"attention_bias": (lambda c: c.attention_bias is False, "biases on q/k/v and o_proj are not supported "
                                "yet (tnlg has biases on Q, K, V alone, Qwen2's, or on every linear layer)")})

OLMOE = _llama_layout(
    "olmoe", "OlmoeForCausalLM", "OlmoeConfig", "a mixture of experts with QK norm over every head at once",
    qk_norm=True, qk_norm_across_heads=True, experts=("mlp", "gate_proj", "up_proj", "down_proj"),
    honoured={"model_type": "picks OlmoeForCausalLM (q_norm over all the heads' queries, k_norm over all the keys: "
                            "qk_layernorm_across_heads; experts on every layer)",
              "num_local_experts": "num_experts", "num_experts": "num_experts (num_local_experts' other name)",
              "num_experts_per_tok": _TOPK, "intermediate_size": "ffn_hidden_size (each expert's width)",
              "norm_topk_prob": _QWEN_MOE["norm_topk_prob"]},
    ignored=_MOE_IGNORED,
    refused={"attention_bias": (lambda c: c.attention_bias is False, "OLMoE's biases on q/k/v and o_proj are not "
                                "mapped yet"),
             "clip_qkv": (lambda c: c.clip_qkv is None, "clipping q, k and v (after the QK norm) is not computed by "
                          "tnlg yet"),
             "head_dim": (lambda c: getattr(c, "head_dim", None) in (None, c.hidden_size // c.num_attention_heads),
                          "OlmoeConfig does not declare it, and its q_norm is hidden_size wide: the heads must be "
                          "hidden_size / num_attention_heads wide")},
    undeclared={"head_dim": "read by OLMoE's attention by getattr: refused unless hidden_size / num_attention_heads "
                            "(its q_norm is hidden_size wide)"})

# in the order a class is chosen for an architecture several compute (a Llama without a window: Llama's)
FAMILIES: Mapping[str, Family] = _frozen({f.model_type: f for f in (GPT2, LLAMA, QWEN2, MISTRAL, QWEN3, MIXTRAL,
                                                                    QWEN2_MOE, QWEN3_MOE, OLMOE)})


# --------------------------------------------------------------------------- choosing one

def _listed() -> str:
    first, *rest = FAMILIES.values()
    named = [f"{first.model_class} (model_type {first.model_type!r})"]
    named += [f"{f.model_class} ({f.model_type!r}" + ("" if f.what == "Llama" else f", {f.what}") + ")" for f in rest]
    return ", ".join(named[:-1]) + " and " + named[-1]


def family_named(model_type, where: str) -> Family:
    """The family of ``config.json``'s ``model_type``, else one :class:`UserError` naming those tnlg reads."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise UserError(f"{where} is a Hugging Face {model_type!r} model (config.json's model_type); tnlg reads "
                        f"and writes {_listed()} folders. Nothing was loaded or written.")
    return FAMILIES[model_type]


def family_of(cfg: GPTConfig, recorded: Optional[str] = None) -> Family:
    """The family whose class is written for ``cfg``: ``recorded`` (the family a checkpoint was converted from)
    when its class computes ``cfg``, else the first of :data:`FAMILIES` whose class does; a
    :class:`UserError` for an architecture none of them computes."""
    if recorded is not None and recorded in FAMILIES and FAMILIES[recorded].computes(cfg):
        return FAMILIES[recorded]
    for family in FAMILIES.values():
        if family.computes(cfg):
            return family
    if cfg.num_experts is not None:
        raise UserError(f"this mixture of experts (num_experts={cfg.num_experts}) has no Hugging Face class: "
                        "MixtralForCausalLM routes a softmax's top-k renormalised on every layer, Qwen2MoeForCausalLM "
                        "and Qwen3MoeForCausalLM a softmax's top-k (renormalised with norm_topk_prob), Qwen2-MoE with "
                        "a sigmoid-gated shared expert, OlmoeForCausalLM as Qwen3-MoE on every layer with its QK norm "
                        "over every head at once; none has a capacity factor, sigmoid scores, an expert bias or "
                        "a scaling factor. Nothing was written.")
    shown = ("position_embedding_type", "normalization", "swiglu", "add_bias_linear", "add_qkv_bias", "add_attn_bias",
             "add_mlp_bias", "qk_layernorm", "qk_layernorm_across_heads", "rotary_percent", "kv_channels", "sliding_window", "window_layers",
             "scale_attn_weights", "scale_attn_by_inverse_layer_idx")
    raise UserError("this model has no Hugging Face class: GPT2LMHeadModel is learned positions, LayerNorm, GELU, "
                    "full multi-head attention and biases; LlamaForCausalLM is rope over whole heads, RMSNorm, "
                    "SwiGLU, no biases or attention_bias / mlp_bias, attention scaled by 1/sqrt(head_dim) "
                    "(Qwen2ForCausalLM: QKV biases alone; Qwen3ForCausalLM: QK norm; MistralForCausalLM: a sliding "
                    "window on every layer; per-layer windows: Qwen2's or Qwen3's); this one is "
                    + ", ".join(f"{name}={getattr(cfg, name)}" for name in shown) + ". Nothing was written.")

