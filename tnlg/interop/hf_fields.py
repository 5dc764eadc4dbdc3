"""Every field of the Hugging Face config classes tnlg reads (``GPT2Config``, ``LlamaConfig``,
``Qwen2Config``, ``MistralConfig``, ``Qwen3Config``), in one of three lists (docs/hf.md's table):

* :data:`HONOURED`: the field sets what tnlg computes exactly as it sets transformers' logits (the
  :class:`~tnlg.config.GPTConfig` field it becomes); an invalid value (a count that is not a positive
  integer, ...) is refused.
* :data:`IGNORED`: the field does not change the logits of the causal-LM forward (generation defaults,
  token ids, what ``forward`` returns, the dtype transformers would load in, ...), each with its reason.
* :data:`REFUSED`: the field is accepted only at values that leave the model one tnlg computes (its
  default, or one with the same effect); any other value is refused in one paragraph naming the field
  and value, because honouring it would change the model's computation (not supported yet).

``tests/test_hf_fields.py`` walks each class's fields as the installed transformers declares them and
fails on a field in none of the lists, so a field a later transformers adds cannot slip through.
Keys a config class does not declare are kept by transformers as attributes its model never reads,
except those in :data:`UNDECLARED` (read by the loading code or by ``getattr`` in the model).
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import boolean, fraction, optional_positive, optional_positive_int, positive, positive_int
from ..errors import UserError
from .hf_llama import ROPE_KEYS

__all__ = ["COMMON_IGNORED", "HONOURED", "IGNORED", "REFUSED", "ROPE_TYPES", "UNDECLARED", "check_counts",
           "check_fields", "rope_type"]

_NOT_READ = "not read by the causal LM's forward"
COMMON_IGNORED = {
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
}

HONOURED = {
    "gpt2": {
        "model_type": "picks GPT2LMHeadModel", "vocab_size": "vocab_size", "n_positions": "seq_length",
        "max_position_embeddings": "seq_length (n_positions' other name)", "n_embd": "hidden_size",
        "hidden_size": "hidden_size (n_embd's other name)", "n_layer": "num_layers",
        "num_hidden_layers": "num_layers (n_layer's other name)", "n_head": "num_attention_heads",
        "num_attention_heads": "num_attention_heads (n_head's other name)",
        "n_inner": "ffn_hidden_size (null: 4 x n_embd)", "layer_norm_epsilon": "layernorm_epsilon",
        "activation_function": "openai_gelu: gelu_new / gelu_pytorch_tanh (tanh form) or gelu (exact); others refused",
        "tie_word_embeddings": "untie_embeddings_and_output_weights (a file whose lm_head differs from the "
                               "embedding loads untied, as transformers keeps them apart)",
        "resid_pdrop": "hidden_dropout (training only)", "attn_pdrop": "attention_dropout (training only)",
        "embd_pdrop": "training only; tnlg's embedding dropout is hidden_dropout (written back as such)",
        "initializer_range": "init_method_std (initialisation only)",
        "scale_attn_weights": "scale_attn_weights (false: the scores are not divided by sqrt(head_dim))",
        "scale_attn_by_inverse_layer_idx": "scale_attn_by_inverse_layer_idx (layer i's scores divided by i + 1)",
    },
    "llama": {
        "model_type": "picks LlamaForCausalLM", "vocab_size": "vocab_size", "hidden_size": "hidden_size",
        "intermediate_size": "ffn_hidden_size", "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_attention_heads",
        "num_key_value_heads": "num_query_groups (grouped-query attention when fewer than the heads)",
        "max_position_embeddings": "seq_length", "rms_norm_eps": "layernorm_epsilon (RMSNorm)",
        "rope_parameters": "rotary_base (rope_theta) and the rope_* fields of rope_type linear, dynamic, yarn or "
                           "llama3 (docs/llama.md); another rope_type (longrope, ...) is refused by name",
        "tie_word_embeddings": "untie_embeddings_and_output_weights (a file whose lm_head differs from the "
                               "embedding loads untied, as transformers keeps them apart)",
        "attention_dropout": "attention_dropout (training only)",
        "initializer_range": "init_method_std (initialisation only)",
    },
}
HONOURED["llama"]["head_dim"] = "kv_channels (the width of every head; null: hidden_size / num_attention_heads)"
_WINDOWS = {
    "use_sliding_window": "without it transformers drops sliding_window (no layer slides)",
    "sliding_window": "sliding_window w (the query at p sees the keys p - w + 1 .. p) on the sliding layers",
    "layer_types": "window_layers: the layers marked sliding_attention slide (the rest attend to every earlier "
                   "position)"}
HONOURED["qwen2"] = dict(HONOURED["llama"], model_type="picks Qwen2ForCausalLM (biases on Q, K, V: add_qkv_bias)",
                         **_WINDOWS)
HONOURED["mistral"] = dict(HONOURED["llama"], model_type="picks MistralForCausalLM",
                           sliding_window="sliding_window w on every layer (the query at p sees the keys "
                           "p - w + 1 .. p); null: none")
HONOURED["qwen3"] = dict(HONOURED["llama"], model_type="picks Qwen3ForCausalLM (q_norm, k_norm: qk_layernorm)",
                         **_WINDOWS)
# (Llama's own: Qwen2, Mistral and Qwen3 declare no mlp_bias, and Qwen3's attention_bias is refused)
HONOURED["llama"].update(attention_bias="add_attn_bias: biases on q/k/v and o_proj (with mlp_bias: add_bias_linear)",
                         mlp_bias="add_mlp_bias: biases on gate/up/down (with attention_bias: add_bias_linear)")

IGNORED = {
    "gpt2": dict(COMMON_IGNORED, **{
        f"summary_{x}": "GPT2DoubleHeadsModel's multiple-choice head only"
        for x in ("type", "use_proj", "activation", "proj_to_labels", "first_dropout")},
        reorder_and_upcast_attn="computes the attention scores in fp32, scaled first: rounding only"),
    "llama": dict(COMMON_IGNORED, pretraining_tp="not read by LlamaForCausalLM in transformers 5 (it once "
                  "split the matmuls, changing rounding only)"),
    "qwen2": dict(COMMON_IGNORED),
    "mistral": dict(COMMON_IGNORED),
}
_MAX_WINDOW_LAYERS = ("read by the config class alone, to fill layer_types when it is not given (layers from "
                      "max_window_layers on slide); tnlg reads layer_types")
IGNORED["qwen2"]["max_window_layers"] = _MAX_WINDOW_LAYERS
IGNORED["qwen3"] = dict(COMMON_IGNORED, max_window_layers=_MAX_WINDOW_LAYERS)


# --------------------------------------------------------------------------- refusals
# Each refused field: (accepts(config) -> bool, why the other values are refused).

def rope_type(c) -> Any:
    """The ``rope_type`` of a Llama/Qwen2 config (``default`` when it sets none)."""
    rope = getattr(c, "rope_parameters", None) or {}
    return rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope


def _windowed_layers_have_a_window(c) -> bool:
    """A layer that ``layer_types`` marks ``sliding_attention`` needs a window (``use_sliding_window`` with
    ``sliding_window``): without one transformers' attention has none to apply."""
    kinds = getattr(c, "layer_types", None) or []
    return "sliding_attention" not in kinds or getattr(c, "sliding_window", None) is not None


_NO_WINDOW = ("a layer marked sliding_attention needs use_sliding_window true and a sliding_window (transformers "
              "has no window to apply without them)")
REFUSED: dict[str, dict[str, tuple[Callable, str]]] = {
    "gpt2": {
        "add_cross_attention": (lambda c: c.add_cross_attention is False, "cross-attention (an encoder's "
                                "states) is not part of a causal LM tnlg runs"),
    },
    "llama": {
        "hidden_act": (lambda c: c.hidden_act == "silu", "tnlg's SwiGLU gates with silu"),
    },
    "qwen2": {
        "hidden_act": (lambda c: c.hidden_act == "silu", "tnlg's SwiGLU gates with silu"),
    },
    "mistral": {
        "hidden_act": (lambda c: c.hidden_act == "silu", "tnlg's SwiGLU gates with silu"),
    },
    "qwen3": {
        "hidden_act": (lambda c: c.hidden_act == "silu", "tnlg's SwiGLU gates with silu"),
        "attention_bias": (lambda c: c.attention_bias is False, "biases on q/k/v and o_proj are not supported yet "
                           "(tnlg has biases on Q, K, V alone, Qwen2's, or on every linear layer)"),
    },
}
HONOURED["qwen2"]["layer_types"] = HONOURED["qwen3"]["layer_types"] = _WINDOWS["layer_types"] + "; " + _NO_WINDOW
HONOURED["qwen2"]["head_dim"] = "kv_channels (undeclared by Qwen2Config; its attention reads it by getattr)"

# keys the classes do not declare that transformers reads all the same, and what tnlg does with them
UNDECLARED = {
    "quantization_config": "refused: quantized weights (and their scales) are not read",
    "head_dim": "Qwen2's attention reads it by getattr: kv_channels, as Llama's head_dim",
    "rope_scaling": "rope_parameters' old name (transformers moves it there): as rope_parameters",
    "rope_theta": "rope_parameters' old place (transformers moves it there): as rope_parameters",
    "torch_dtype": "dtype's old name: ignored as dtype",
    "auto_map": "ignored: tnlg never runs code from a folder (model_type picks transformers' own class)",
}


# --------------------------------------------------------------------------- checks

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# each scaled type's keys: (check, whether transformers needs the key); yarn's factor may be missing
# (max_position_embeddings / original_max_position_embeddings), its other keys have defaults
_ROPE_CHECKS: dict[str, Callable] = dict(factor=positive, low_freq_factor=positive, high_freq_factor=positive,
                                         original_max_position_embeddings=positive_int, beta_fast=optional_positive,
                                         beta_slow=optional_positive, mscale=optional_positive,
                                         mscale_all_dim=optional_positive, attention_factor=optional_positive,
                                         truncate=boolean)


def _rope_wrong(rope: Any, kind) -> list[str]:
    """What is wrong with a ``rope_parameters`` of a valid ``rope_theta``: a ``rope_type`` tnlg does not
    compute, a scaled type's value that is not valid, or a ``partial_rotary_factor`` (read by the scaled
    types' frequencies, not by Llama's rotation, which then fails)."""
    if kind not in ROPE_TYPES:
        return [f"rope_parameters has rope_type {_shown(kind)}: tnlg computes rope_type {', '.join(ROPE_TYPES)} "
                "(longrope and the others are not supported yet)"]
    if kind == "default":
        return []
    optional = {"truncate"} | ({"factor"} if kind == "yarn" else set())
    wrong = []
    for key in ROPE_KEYS[kind]:
        value = rope.get(key)
        must = None if value is None and key in optional else _ROPE_CHECKS[key](value)
        if must:
            wrong.append(f"rope_parameters' {key} {_shown(value)} must {must}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        wrong.append(f"rope_parameters' partial_rotary_factor {_shown(rope['partial_rotary_factor'])} must be 1.0 "
                     f"(a {kind} rope over part of each head is not computed by Llama's attention)")
    if kind == "llama3" and not wrong and rope["high_freq_factor"] <= rope["low_freq_factor"]:
        wrong.append(f"rope_parameters' high_freq_factor {rope['high_freq_factor']} must be greater than its "
                     f"low_freq_factor {rope['low_freq_factor']}")
    return wrong


def _counts(kind: str) -> dict[str, Callable]:
    if kind == "gpt2":
        return dict(vocab_size=positive_int, n_positions=positive_int, n_embd=positive_int, n_layer=positive_int,
                    n_head=positive_int, n_inner=optional_positive_int, layer_norm_epsilon=positive,
                    resid_pdrop=fraction, attn_pdrop=fraction, embd_pdrop=fraction, initializer_range=positive,
                    tie_word_embeddings=boolean)
    return dict(vocab_size=positive_int, hidden_size=positive_int, intermediate_size=positive_int,
                num_hidden_layers=positive_int, num_attention_heads=positive_int, num_key_value_heads=positive_int,
                max_position_embeddings=positive_int, rms_norm_eps=positive, initializer_range=positive,
                attention_dropout=fraction, tie_word_embeddings=boolean, head_dim=optional_positive_int,
                sliding_window=optional_positive_int)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_ALIASES = {"max_position_embeddings": "n_positions", "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
            "num_attention_heads": "n_head"}  # GPT2Config's attribute_map


def check_counts(raw: dict, kind: str, where: str) -> None:
    """Refuse, in one paragraph, ``config.json`` values of the honoured counts and rates that are not valid
    (checked on the JSON, before transformers' config class divides by them)."""
    checks = _counts(kind)
    wrong = []
    for key, value in raw.items():
        name = _ALIASES.get(key, key) if kind == "gpt2" else key
        must = checks[name](value) if name in checks else None
        if must:
            wrong.append(f"{key} {_shown(value)} must {must}")
    if wrong:
        raise UserError(f"{where}: config.json has {'; '.join(wrong)}. Nothing was loaded or written.")


def check_fields(c, kind: str, where: str) -> None:
    """Refuse, in one paragraph naming every offending field and value, a config (transformers' object of
    the class ``kind`` picks) with an honoured field whose value is invalid, a quantization, or a refused
    field at a value tnlg does not compute. ``where`` names the folder or model."""
    wrong = [f"{name} {_shown(getattr(c, name, None))} must {must}" for name, check in _counts(kind).items()
             if (must := check(getattr(c, name, None)))]
    if kind != "gpt2" and not wrong and c.num_attention_heads % c.num_key_value_heads:
        wrong.append(f"num_key_value_heads {c.num_key_value_heads} must divide num_attention_heads "
                     f"{c.num_attention_heads}")
    if getattr(c, "quantization_config", None) is not None:
        wrong.append("quantization_config is set (quantized weights and their scales are not read; give the "
                     "unquantized model)")
    rope = getattr(c, "rope_parameters", None)
    if kind != "gpt2" and not (isinstance(rope, dict) and positive(rope.get("rope_theta")) is None):
        wrong.append(f"rope_parameters {_shown(rope)} must hold a positive rope_theta")
    elif kind != "gpt2":
        wrong += _rope_wrong(rope, rope_type(c))
    if not wrong:  # the refused fields' tests need valid counts
        told = set()
        for name, (accepts, why) in REFUSED[kind].items():
            if accepts(c) or why in told:
                continue
            told.add(why)
            wrong.append(f"{name} {_shown(getattr(c, name, None))}: {why}")
        if kind in ("qwen2", "qwen3") and not _windowed_layers_have_a_window(c):
            wrong.append(f"layer_types {_shown(c.layer_types)} with use_sliding_window "
                         f"{_shown(getattr(c, 'use_sliding_window', None))}: {_NO_WINDOW}")
    if wrong:
        raise UserError(f"{where}: config.json has {'; '.join(wrong)}. Nothing was loaded or written.")
