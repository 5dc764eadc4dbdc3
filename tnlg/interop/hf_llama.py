"""Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` <-> tnlg full state dicts and configs.

Layouts (transformers' module names on the left): ``q_proj`` ``[H d, h]`` is tnlg's ``attn.c_q.weight``
under grouped-query attention; ``k_proj`` / ``v_proj`` ``[G d, h]`` together are ``attn.c_kv.weight``
``[G, 2, d, h]`` (group, then key / value); with ``G = H`` the three are tnlg's fused ``attn.c_attn.weight``,
rows ``[head][q, k, v][d]``. ``gate_proj`` and ``up_proj`` are ``mlp.c_fc.weight`` ``[2, f, h]`` (gate
first), ``down_proj`` ``mlp.c_proj.weight``, ``o_proj`` ``attn.c_proj.weight``; ``input_layernorm``,
``post_attention_layernorm`` and ``model.norm`` are ``ln_1``, ``ln_2`` and ``ln_f``; ``embed_tokens`` is
``transformer.wte`` and ``lm_head`` is ``lm_head`` (untied), or the embedding (tied). Qwen2 adds the
query/key/value biases (``add_qkv_bias``); a Llama's ``attention_bias`` (q/k/v and ``o_proj``) is
``add_attn_bias``, its ``mlp_bias`` (gate/up/down) ``add_mlp_bias``, both ``add_bias_linear``. Rope is
rotate-half with ``rope_theta``, scaled by ``rope_parameters``' ``rope_type`` (``linear``, ``dynamic``,
``yarn``, ``llama3``: the ``rope_*`` fields of :class:`~tnlg.config.GPTConfig`; others are refused by
:mod:`.hf_fields`).

``MistralForCausalLM`` is Llama with a sliding window on every layer (``sliding_window``: tnlg's); its
``head_dim`` (as Llama's and Qwen2's) is tnlg's ``kv_channels``. ``Qwen3ForCausalLM`` adds ``q_norm`` /
``k_norm`` (``attn.q_norm.weight`` / ``attn.k_norm.weight``: ``qk_layernorm``; ``OlmoeForCausalLM``'s are over
the whole projections, ``[H d]`` and ``[G d]``: ``qk_layernorm_across_heads``) and, like Qwen2, a window
on the layers ``layer_types`` marks ``sliding_attention`` (tnlg's ``window_layers``; transformers sets
the window only with ``use_sliding_window``). What each class fixes is its entry's in :mod:`.families`.

The mixtures of experts (docs/moe.md): ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
``Qwen3MoeForCausalLM`` and ``OlmoeForCausalLM``'s router ``gate`` is tnlg's ``mlp.router.weight`` ``[E, h]``; their experts, fused 3-D
in memory (``mlp.experts.gate_up_proj`` ``[E, 2 f, h]``, gate rows first; ``mlp.experts.down_proj``
``[E, h, f]``) and written per expert by ``save_pretrained`` (Mixtral ``block_sparse_moe.experts.N.w1`` gate,
``w3`` up, ``w2`` down; Qwen and OLMoE ``mlp.experts.N.gate_proj/up_proj/down_proj``), are ``mlp.experts.fc1``
``[E, 2, f, h]`` and ``mlp.experts.fc2``; Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate`` are
``mlp.shared_expert`` (a dense MLP) and ``mlp.shared_expert_gate.weight``. Both spellings are read; the
in-memory one is written (``save_pretrained`` converts).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Union

import torch

from ..config import GPTConfig
from ..errors import UserError
from .families import FAMILIES, MIXTRAL, QWEN3_MOE, Family

__all__ = ["ROPE_KEYS", "rope_parameters_in", "rope_parameters_of", "rope_type_of", "config_from_llama", "llama_config_from",
           "llama_recipes", "tnlg_to_llama", "expert_names", "saved_spelling"]

_LAYER = {"input_layernorm.weight": "ln_1.weight", "post_attention_layernorm.weight": "ln_2.weight",
          "self_attn.o_proj.weight": "attn.c_proj.weight", "mlp.down_proj.weight": "mlp.c_proj.weight",
          "self_attn.o_proj.bias": "attn.c_proj.bias", "mlp.down_proj.bias": "mlp.c_proj.bias",
          "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight"}


# transformers' rope_parameters key -> GPTConfig field, per rope_type (what its ROPE_INIT_FUNCTIONS read)
ROPE_KEYS = {"linear": {"factor": "rope_scaling_factor"}, "dynamic": {"factor": "rope_scaling_factor"},
             "llama3": {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                        "high_freq_factor": "rope_high_freq_factor",
                        "original_max_position_embeddings": "rope_original_max_position"},
             "yarn": {"factor": "rope_scaling_factor", "original_max_position_embeddings": "rope_original_max_position",
                      "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
                      "mscale_all_dim": "rope_mscale_all_dim", "attention_factor": "rope_attention_factor",
                      "truncate": "rope_truncate"}}


# the rope types whose pretraining length transformers takes from a top-level original_max_position_embeddings
# before rope_parameters' own (longrope's too, which tnlg refuses)
_TOP_LEVEL_ORIGINAL = ("llama3", "yarn", "longrope")


def rope_type_of(rope) -> Any:
    """The ``rope_type`` of a ``rope_parameters`` dict (its old key ``type``; ``default`` when it sets none)."""
    return rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope


def rope_parameters_in(hf_config) -> Any:
    """The rope parameters transformers' rope computes with for the config object ``hf_config``: its
    ``rope_parameters`` (or ``rope_scaling``, the old name), with a yarn or llama3 rope's
    ``original_max_position_embeddings`` taken from the config's top level when it has one there. Every
    function of ``ROPE_INIT_FUNCTIONS`` first calls ``standardize_rope_params``, which gives that top-level
    attribute priority over the one inside (a Phi-3-style ``config.json`` keeps the pretraining length
    there); a key ``config.json`` holds that its class does not declare becomes such an attribute."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if rope_type_of(rope) in _TOP_LEVEL_ORIGINAL and hasattr(hf_config, "original_max_position_embeddings"):
        rope = dict(rope, original_max_position_embeddings=hf_config.original_max_position_embeddings)
    return rope


def _rope_fields(hf_config) -> dict:
    """GPTConfig's rope fields of the rope parameters transformers computes with (:func:`rope_parameters_in`;
    the type checked by :mod:`.hf_fields`). Values transformers reads as ``x or default`` (yarn's betas) take
    the default; yarn without a factor gets ``max_position_embeddings / original_max_position_embeddings``,
    as transformers computes it."""
    rope = rope_parameters_in(hf_config)
    kind = rope_type_of(rope)
    out: dict = dict(rotary_base=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))))
    if kind in (None, "default"):
        return out
    out["rope_scaling_type"] = kind
    for key, field in ROPE_KEYS[kind].items():
        value = rope.get(key)
        if key in ("beta_fast", "beta_slow"):
            value = value or None
        if value is not None:
            out[field] = value if key in ("truncate", "original_max_position_embeddings") else float(value)
    if kind == "yarn" and rope.get("factor") is None:
        out["rope_scaling_factor"] = hf_config.max_position_embeddings / out["rope_original_max_position"]
    return out


def rope_parameters_of(cfg: GPTConfig) -> dict:
    """transformers' ``rope_parameters`` of ``cfg`` (the inverse of :func:`_rope_fields`): the type's keys,
    defaults left out where transformers has the same default."""
    out: dict = dict(rope_type="default" if cfg.rope_scaling_type == "none" else cfg.rope_scaling_type,
                     rope_theta=cfg.rotary_base)
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    for key, field in ROPE_KEYS.get(cfg.rope_scaling_type, {}).items():
        value = getattr(cfg, field)
        if key == "original_max_position_embeddings":
            value = value or cfg.max_position_embeddings
        elif value is None or (key not in ("factor", "low_freq_factor", "high_freq_factor")
                               and value == defaults[field]):
            continue
        out[key] = value
    return out


def config_from_llama(hf_config, family: Family, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a config of a Llama-layout ``family`` (what its class fixes: Qwen2's QKV
    biases, Qwen3's QK norm, Llama's own ``attention_bias`` / ``mlp_bias``, where the window applies)."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UserError(f"the Hugging Face {hf_config.model_type} config has hidden_act "
                        f"{getattr(hf_config, 'hidden_act', None)!r}; tnlg's SwiGLU is silu. Nothing was written.")
    # (the classes without linear_biases never read attention_bias or mlp_bias; Qwen3's attention_bias is
    # refused by .hf_fields)
    attn_bias = family.linear_biases and getattr(hf_config, "attention_bias", False) is True
    mlp_bias = family.linear_biases and getattr(hf_config, "mlp_bias", False) is True
    every = attn_bias and mlp_bias  # biases on every linear layer: Megatron's add_bias_linear
    fields = dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
                  seq_length=hf_config.max_position_embeddings,
                  max_position_embeddings=hf_config.max_position_embeddings, vocab_size=hf_config.vocab_size,
                  ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=float(hf_config.rms_norm_eps),
                  init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
                  position_embedding_type="rope", normalization="RMSNorm", **_rope_fields(hf_config),
                  swiglu=True, add_bias_linear=every, add_qkv_bias=family.qkv_bias, add_attn_bias=attn_bias and not every,
                  add_mlp_bias=mlp_bias and not every,
                  untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
                  group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
                  attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)), hidden_dropout=0.0,
                  kv_channels=head_dim, qk_layernorm=family.qk_norm,
                  qk_layernorm_across_heads=family.qk_norm_across_heads, **_window(hf_config, family),
                  **_experts(hf_config, family))
    if family.qkv_bias_field:
        fields["add_qkv_bias"] = getattr(hf_config, "qkv_bias", False) is True
    fields.update(overrides)
    return GPTConfig(**fields)


def _experts(hf_config, family: Family) -> dict:
    """tnlg's mixture-of-experts fields of a MoE family's config (none for a dense one): the experts, top-k,
    widths, renormalisation (``norm_topk_prob``; Mixtral always), the shared expert and its gate, and which
    layers have experts (Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``)."""
    if not family.experts:
        return {}
    out: dict = dict(num_experts=getattr(hf_config, "num_local_experts", None) or hf_config.num_experts,
                     moe_router_topk=hf_config.num_experts_per_tok)
    if family.model_type == "mixtral":
        return out
    if family.model_type == "olmoe":  # (every layer's experts as wide as intermediate_size, as Mixtral's)
        return dict(out, moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False))
    out.update(moe_ffn_hidden_size=hf_config.moe_intermediate_size,
               moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False))
    if family.shared_expert:
        out.update(moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                   moe_shared_expert_gate=True)
    step, dense = hf_config.decoder_sparse_step, set(getattr(hf_config, "mlp_only_layers", None) or [])
    layers = [0 if i in dense or (i + 1) % step else 1 for i in range(hf_config.num_hidden_layers)]
    if not all(layers):
        out["moe_layer_freq"] = layers if len(layers) > 1 else [layers[0] or 1]
    return out


def _experts_config(cfg: GPTConfig, family: Family) -> dict:
    """transformers' mixture-of-experts fields of ``cfg`` (the inverse of :func:`_experts`)."""
    if not family.experts:
        return {}
    E, k = cfg.num_experts, cfg.moe_router_topk
    if family.model_type == "mixtral":
        return dict(num_local_experts=E, num_experts_per_tok=k, intermediate_size=cfg.expert_ffn_hidden_size)
    if family.model_type == "olmoe":
        return dict(num_experts=E, num_experts_per_tok=k, intermediate_size=cfg.expert_ffn_hidden_size,
                    norm_topk_prob=not cfg.moe_router_pre_softmax)
    out: dict = dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=cfg.expert_ffn_hidden_size,
                     norm_topk_prob=not cfg.moe_router_pre_softmax, decoder_sparse_step=1,
                     mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)])
    if family.shared_expert:
        out.update(shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)
    return out


def _window(hf_config, family: Family) -> dict:
    """tnlg's ``sliding_window`` and ``window_layers`` of a config: Mistral's window on every layer; Qwen2's
    and Qwen3's on the layers ``layer_types`` marks ``sliding_attention`` (the window transformers keeps only
    with ``use_sliding_window``; a sliding layer without one is refused by the field checks); none for Llama."""
    window = getattr(hf_config, "sliding_window", None)
    if family.window != "layer_types" or window is None:
        return dict(sliding_window=window if family.window == "every_layer" else None)
    kinds = list(getattr(hf_config, "layer_types", None) or [])
    layers = [1 if k == "sliding_attention" else 0 for k in kinds]
    if not any(layers):
        return dict(sliding_window=None)
    return dict(sliding_window=window, window_layers=None if all(layers) else layers)


def llama_config_from(cfg: GPTConfig, family: Union[Family, str], eod_id: Optional[int] = None):
    """transformers' config of ``cfg`` in the class of the Llama-layout ``family`` (an entry of
    :data:`~.families.FAMILIES`, or its ``model_type``)."""
    import transformers
    family = FAMILIES[family] if isinstance(family, str) else family
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_groups, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.layernorm_epsilon, rope_parameters=rope_parameters_of(cfg), hidden_act="silu",
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
        bos_token_id=eod_id, eos_token_id=eod_id)
    if cfg.kv_channels is not None or "head_dim" not in family.undeclared:  # (an undeclared one is read by getattr)
        common.update(head_dim=cfg.head_dim)
    if family.linear_biases:
        common.update(attention_bias=cfg.attn_out_bias, mlp_bias=cfg.mlp_biases)
    if family.qkv_bias_field:
        common.update(qkv_bias=cfg.add_qkv_bias)
    common.update(_experts_config(cfg, family))
    if family.window == "layer_types":
        kinds = ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.num_layers)]
        common.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                      layer_types=kinds)
    elif family.window == "every_layer":
        common.update(sliding_window=cfg.sliding_window)
        if "use_sliding_window" in family.honoured:
            common.update(use_sliding_window=cfg.sliding_window is not None)
    return getattr(transformers, family.config_class)(**common)


def _per_head(q, k, v, heads: int) -> torch.Tensor:
    """``[H d, ...]`` queries, keys, values -> tnlg's fused rows ``[head][q, k, v][d]``."""
    return torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1).flatten(0, 2)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _stacked(*ts: torch.Tensor) -> torch.Tensor:
    return torch.stack(ts)


def _grouped_kv(k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[G d, ...]`` keys and values -> tnlg's ``attn.c_kv`` ``[G, 2, d, ...]``."""
    return torch.stack([k.reshape(groups, -1, *k.shape[1:]), v.reshape(groups, -1, *v.shape[1:])], dim=1)


def llama_recipes(hf_names, cfg: GPTConfig) -> dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]:
    """``{tnlg name: (the Hugging Face names it is built from, the function of their tensors that builds it)}``
    of a Llama/Qwen2 state dict holding ``hf_names`` (:func:`tnlg.interop.hf_mapping.tnlg_recipes`)."""
    out: dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]] = {}
    fused: list[str] = []  # layers whose attention / MLP tensors are fused
    for name in hf_names:
        if name == "model.embed_tokens.weight":
            out["transformer.wte.weight"] = ((name,), _same)
        elif name == "model.norm.weight":
            out["transformer.ln_f.weight"] = ((name,), _same)
        elif name == "lm_head.weight":
            if cfg.untie_embeddings_and_output_weights:
                out["lm_head.weight"] = ((name,), _same)
        elif name.startswith("model.layers.") and not name.endswith("rotary_emb.inv_freq"):
            _, _, i, rest = name.split(".", 3)
            if rest in _LAYER:
                out[f"transformer.h.{i}.{_LAYER[rest]}"] = ((name,), _same)
            elif i not in fused:
                fused.append(i)
    heads, groups = cfg.num_attention_heads, cfg.kv_groups
    names = set(hf_names)
    for i in fused:
        pre, hf = f"transformer.h.{i}.", f"model.layers.{i}."
        moe = cfg.is_moe_layer(int(i))
        if moe:
            out.update(_expert_recipes(pre, hf, names, cfg))
        for kind in () if moe else ("weight", "bias") if cfg.mlp_biases else ("weight",):
            out[pre + f"mlp.c_fc.{kind}"] = ((hf + f"mlp.gate_proj.{kind}", hf + f"mlp.up_proj.{kind}"), _stacked)
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = (hf + f"self_attn.{x}_proj.{kind}" for x in "qkv")
            if groups == heads:
                out[pre + f"attn.c_attn.{kind}"] = ((q, k, v), functools.partial(_per_head, heads=heads))
            else:
                out[pre + f"attn.c_q.{kind}"] = ((q,), _same)
                out[pre + f"attn.c_kv.{kind}"] = ((k, v), functools.partial(_grouped_kv, groups=groups))
    return out


def _pairs(*ts: torch.Tensor) -> torch.Tensor:
    """Per-expert gate and up weights ``(g0, u0, g1, u1, ...)`` -> tnlg's ``experts.fc1`` ``[E, 2, f, h]``."""
    return torch.stack([torch.stack(ts[j:j + 2]) for j in range(0, len(ts), 2)])


def _fused_gate_up(t: torch.Tensor) -> torch.Tensor:
    """transformers' in-memory ``experts.gate_up_proj`` ``[E, 2 f, h]`` (gate rows first) -> ``[E, 2, f, h]``."""
    return t.view(t.shape[0], 2, -1, t.shape[-1])


def expert_names(family: Family, layer: int, E: int) -> dict[str, list[str]]:
    """The published per-expert names of layer ``layer``'s routed experts (what ``save_pretrained`` writes):
    ``{"gate": [...], "up": [...], "down": [...]}`` one per expert, and ``"router"``."""
    module, gate, up, down = family.experts
    base = f"model.layers.{layer}.{module}."
    return dict(router=[base + "gate.weight"], **{k: [f"{base}experts.{e}.{w}.weight" for e in range(E)]
                                                 for k, w in (("gate", gate), ("up", up), ("down", down))})


def _expert_recipes(pre: str, hf: str, names: set, cfg: GPTConfig) -> dict:
    """A MoE layer's tensors, from either spelling: transformers' in-memory fused parameters
    (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` ``[E, 2 f, h]``, ``mlp.experts.down_proj``) or the
    published per-expert ones (:func:`expert_names`: Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2``, Qwen's
    ``mlp.experts.N.gate_proj/up_proj/down_proj``); the shared expert and its gate (Qwen2-MoE)."""
    out: dict = {}
    if hf + "mlp.experts.gate_up_proj" in names:
        out[pre + "mlp.router.weight"] = ((hf + "mlp.gate.weight",), _same)
        out[pre + "mlp.experts.fc1"] = ((hf + "mlp.experts.gate_up_proj",), _fused_gate_up)
        out[pre + "mlp.experts.fc2"] = ((hf + "mlp.experts.down_proj",), _same)
    else:
        spelling = MIXTRAL if hf + "block_sparse_moe.gate.weight" in names else QWEN3_MOE  # (Qwen's names)
        per = expert_names(spelling, int(hf.split(".")[2]), cfg.num_experts or 0)
        out[pre + "mlp.router.weight"] = (tuple(per["router"]), _same)
        out[pre + "mlp.experts.fc1"] = (tuple(n for pair in zip(per["gate"], per["up"]) for n in pair), _pairs)
        out[pre + "mlp.experts.fc2"] = (tuple(per["down"]), _stacked)
    if cfg.moe_shared_expert_intermediate_size is not None:
        s = hf + "mlp.shared_expert."
        out[pre + "mlp.shared_expert.c_fc.weight"] = ((s + "gate_proj.weight", s + "up_proj.weight"), _stacked)
        out[pre + "mlp.shared_expert.c_proj.weight"] = ((s + "down_proj.weight",), _same)
        out[pre + "mlp.shared_expert_gate.weight"] = ((hf + "mlp.shared_expert_gate.weight",), _same)
    return out


def saved_spelling(expected: dict[str, tuple], family: Family, present) -> dict[str, tuple]:
    """transformers' in-memory names and shapes ``expected`` (a MoE class's fused experts) in the spelling the
    files use: where a layer's ``mlp.experts.gate_up_proj`` is not in ``present``, its published per-expert
    names and shapes (:func:`expert_names`)."""
    if not family.experts:
        return expected
    out = {}
    for name, shape in expected.items():
        if name.endswith(".mlp.gate.weight") and name.replace(".gate.weight", ".experts.gate_up_proj") not in present:
            out[expert_names(family, int(name.split(".")[2]), 0)["router"][0]] = shape
        elif name.endswith(".mlp.experts.gate_up_proj") and name not in present:
            E, two_f, h = shape
            per = expert_names(family, int(name.split(".")[2]), E)
            out.update({n: (two_f // 2, h) for n in per["gate"] + per["up"]})
        elif name.endswith(".mlp.experts.down_proj") and name.replace("down_proj", "gate_up_proj") not in present:
            E, h, f = shape
            out.update({n: (h, f) for n in expert_names(family, int(name.split(".")[2]), E)["down"]})
        else:
            out[name] = shape
    return out


def tnlg_to_llama(full: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A Llama/Qwen2 state dict of tnlg's full state dict (the inverse of :func:`llama_recipes`)."""
    back = {v: k for k, v in _LAYER.items()}
    out = {"model.embed_tokens.weight": full["transformer.wte.weight"], "model.norm.weight": full["transformer.ln_f.weight"],
           "lm_head.weight": full.get("lm_head.weight", full["transformer.wte.weight"])}
    heads = cfg.num_attention_heads
    for name, t in full.items():
        if not name.startswith("transformer.h."):
            continue
        _, _, i, rest = name.split(".", 3)
        pre = f"model.layers.{i}."
        kind = rest.rsplit(".", 1)[1]
        if rest in back:
            out[pre + back[rest]] = t
        elif rest.startswith("mlp.c_fc."):
            out[pre + f"mlp.gate_proj.{kind}"], out[pre + f"mlp.up_proj.{kind}"] = t[0], t[1]
        elif rest == "mlp.router.weight":  # (a MoE layer: transformers' in-memory names, save_pretrained converts)
            out[pre + "mlp.gate.weight"] = t
        elif rest == "mlp.experts.fc1":
            out[pre + "mlp.experts.gate_up_proj"] = t.flatten(1, 2)
        elif rest == "mlp.experts.fc2":
            out[pre + "mlp.experts.down_proj"] = t
        elif rest == "mlp.shared_expert.c_fc.weight":
            out[pre + "mlp.shared_expert.gate_proj.weight"], out[pre + "mlp.shared_expert.up_proj.weight"] = t[0], t[1]
        elif rest == "mlp.shared_expert.c_proj.weight":
            out[pre + "mlp.shared_expert.down_proj.weight"] = t
        elif rest == "mlp.shared_expert_gate.weight":
            out[pre + "mlp.shared_expert_gate.weight"] = t
        elif rest.startswith("attn.c_attn."):
            q, k, v = t.reshape(heads, 3, -1, *t.shape[1:]).unbind(1)
            for x, y in zip("qkv", (q, k, v)):
                out[pre + f"self_attn.{x}_proj.{kind}"] = y.flatten(0, 1)
        elif rest.startswith("attn.c_q."):
            out[pre + f"self_attn.q_proj.{kind}"] = t
        elif rest.startswith("attn.c_kv."):
            out[pre + f"self_attn.k_proj.{kind}"] = t[:, 0].flatten(0, 1)
            out[pre + f"self_attn.v_proj.{kind}"] = t[:, 1].flatten(0, 1)
    return {n: t.contiguous() for n, t in out.items()}
