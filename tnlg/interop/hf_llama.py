"""Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` <-> tnlg full state dicts and configs.

Layouts (transformers' module names on the left): ``q_proj`` ``[H d, h]`` is tnlg's ``attn.c_q.weight``
under grouped-query attention; ``k_proj`` / ``v_proj`` ``[G d, h]`` together are ``attn.c_kv.weight``
``[G, 2, d, h]`` (group, then key / value); with ``G = H`` the three are tnlg's fused ``attn.c_attn.weight``,
rows ``[head][q, k, v][d]``. ``gate_proj`` and ``up_proj`` are ``mlp.c_fc.weight`` ``[2, f, h]`` (gate
first), ``down_proj`` ``mlp.c_proj.weight``, ``o_proj`` ``attn.c_proj.weight``; ``input_layernorm``,
``post_attention_layernorm`` and ``model.norm`` are ``ln_1``, ``ln_2`` and ``ln_f``; ``embed_tokens`` is
``transformer.wte`` and ``lm_head`` is ``lm_head`` (untied), or the embedding (tied). Qwen2 adds the
query/key/value biases (``add_qkv_bias``). Rope is transformers' default (rotate-half, ``rope_theta``);
a scaled rope (``rope_type`` other than ``default``) is refused.

``MistralForCausalLM`` is Llama with a sliding window on every layer (``sliding_window``: tnlg's); its
``head_dim`` (as Llama's and Qwen2's) is tnlg's ``kv_channels``. ``Qwen3ForCausalLM`` adds ``q_norm`` /
``k_norm`` (``attn.q_norm.weight`` / ``attn.k_norm.weight``: ``qk_layernorm``) and, like Qwen2, a window
on the layers ``layer_types`` marks ``sliding_attention`` (tnlg's ``window_layers``; transformers sets
the window only with ``use_sliding_window``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import GPTConfig
from ..errors import UserError

__all__ = ["LLAMA_TYPES", "hf_kind", "config_from_llama", "llama_config_from", "llama_to_tnlg", "tnlg_to_llama"]

LLAMA_TYPES = ("llama", "qwen2", "mistral", "qwen3")
_LAYER = {"input_layernorm.weight": "ln_1.weight", "post_attention_layernorm.weight": "ln_2.weight",
          "self_attn.o_proj.weight": "attn.c_proj.weight", "mlp.down_proj.weight": "mlp.c_proj.weight",
          "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight"}


def hf_kind(cfg: GPTConfig) -> str:
    """The Hugging Face ``model_type`` whose class is this architecture: ``gpt2``, ``llama``, ``qwen2``
    (QKV biases), ``qwen3`` (QK norm) or ``mistral`` (a sliding window on every layer); a :class:`UserError`
    for a mix that none of them is."""
    plain = cfg.kv_channels is None and not cfg.qk_layernorm and cfg.sliding_window is None
    gpt2 = (cfg.position_embedding_type == "learned_absolute" and cfg.normalization == "LayerNorm"
            and not cfg.swiglu and cfg.add_bias_linear and cfg.kv_groups == cfg.num_attention_heads)
    if gpt2 and plain:
        return "gpt2"
    llama = (cfg.position_embedding_type == "rope" and cfg.normalization == "RMSNorm" and cfg.swiglu
             and not cfg.add_bias_linear and cfg.rotary_percent == 1.0)
    every_layer = cfg.window_layers is None or all(cfg.window_layers)
    if llama and cfg.qk_layernorm and not cfg.add_qkv_bias:
        return "qwen3"
    if llama and not cfg.qk_layernorm and cfg.add_qkv_bias:
        return "qwen2"
    if llama and not cfg.qk_layernorm and (cfg.sliding_window is None or every_layer):
        return "llama" if cfg.sliding_window is None else "mistral"
    raise UserError("this model has no Hugging Face class: GPT2LMHeadModel is learned positions, LayerNorm, GELU, "
                    "full multi-head attention and biases; LlamaForCausalLM is rope over whole heads, RMSNorm, "
                    "SwiGLU and no biases (Qwen2ForCausalLM: plus QKV biases; Qwen3ForCausalLM: plus QK norm; "
                    "MistralForCausalLM: a sliding window on every layer; per-layer windows: Qwen2's or Qwen3's); "
                    f"this one is position_embedding_type={cfg.position_embedding_type}, normalization="
                    f"{cfg.normalization}, swiglu={cfg.swiglu}, add_bias_linear={cfg.add_bias_linear}, "
                    f"add_qkv_bias={cfg.add_qkv_bias}, qk_layernorm={cfg.qk_layernorm}, rotary_percent="
                    f"{cfg.rotary_percent}, kv_channels={cfg.kv_channels}, sliding_window={cfg.sliding_window}, "
                    f"window_layers={cfg.window_layers}. Nothing was written.")


def _rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        raise UserError(f"the Hugging Face {hf_config.model_type} config scales rope (rope_type {kind!r}); tnlg's "
                        "rope is the unscaled default (rope_theta only). Nothing was written.")
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def config_from_llama(hf_config, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a ``LlamaConfig`` / ``Qwen2Config``."""
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if getattr(hf_config, "hidden_act", "silu") != "silu" or getattr(hf_config, "mlp_bias", False):
        raise UserError(f"the Hugging Face {hf_config.model_type} config has hidden_act "
                        f"{getattr(hf_config, 'hidden_act', None)!r} / mlp_bias {getattr(hf_config, 'mlp_bias', False)}"
                        "; tnlg's SwiGLU is silu without MLP biases. Nothing was written.")
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    fields = dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
                  seq_length=hf_config.max_position_embeddings, vocab_size=hf_config.vocab_size,
                  ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=float(hf_config.rms_norm_eps),
                  init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
                  position_embedding_type="rope", rotary_base=_rope_theta(hf_config), normalization="RMSNorm",
                  swiglu=True, add_bias_linear=False, add_qkv_bias=qkv_bias,
                  untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
                  group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
                  attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)), hidden_dropout=0.0,
                  kv_channels=head_dim, qk_layernorm=hf_config.model_type == "qwen3", **_window(hf_config))
    fields.update(overrides)
    return GPTConfig(**fields)


def _window(hf_config) -> dict:
    """tnlg's ``sliding_window`` and ``window_layers`` of a config: Mistral's window on every layer; Qwen2's
    and Qwen3's on the layers ``layer_types`` marks ``sliding_attention`` (the window transformers keeps only
    with ``use_sliding_window``; a sliding layer without one is refused by the field checks)."""
    window = getattr(hf_config, "sliding_window", None)
    if hf_config.model_type == "mistral" or window is None:
        return dict(sliding_window=window if hf_config.model_type == "mistral" else None)
    kinds = list(getattr(hf_config, "layer_types", None) or [])
    layers = [1 if k == "sliding_attention" else 0 for k in kinds]
    if not any(layers):
        return dict(sliding_window=None)
    return dict(sliding_window=window, window_layers=None if all(layers) else layers)


def llama_config_from(cfg: GPTConfig, kind: str, eod_id: Optional[int] = None):
    """The ``LlamaConfig`` / ``Qwen2Config`` of ``cfg`` (``kind``: :func:`hf_kind`)."""
    import transformers
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=cfg.kv_groups, max_position_embeddings=cfg.seq_length,
                  rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rotary_base, hidden_act="silu",
                  tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                  attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
                  bos_token_id=eod_id, eos_token_id=eod_id)
    if cfg.kv_channels is not None or kind != "qwen2":  # (Qwen2 reads an undeclared head_dim by getattr)
        common.update(head_dim=cfg.head_dim)
    if kind in ("qwen2", "qwen3"):
        kinds = ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.num_layers)]
        window = dict(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                      layer_types=kinds)
        if kind == "qwen2":
            return transformers.Qwen2Config(**window, **common)
        return transformers.Qwen3Config(attention_bias=False, **window, **common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=cfg.sliding_window, **common)
    return transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def _per_head(q, k, v, heads: int) -> torch.Tensor:
    """``[H d, ...]`` queries, keys, values -> tnlg's fused rows ``[head][q, k, v][d]``."""
    return torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1).flatten(0, 2)


def llama_to_tnlg(hf_sd: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """tnlg's full state dict of a Llama/Qwen2 state dict."""
    out, attn = {}, {}
    for name, t in hf_sd.items():
        t = t.detach().float()
        if name == "model.embed_tokens.weight":
            out["transformer.wte.weight"] = t
        elif name == "model.norm.weight":
            out["transformer.ln_f.weight"] = t
        elif name == "lm_head.weight":
            if cfg.untie_embeddings_and_output_weights:
                out["lm_head.weight"] = t
        elif name.startswith("model.layers.") and not name.endswith("rotary_emb.inv_freq"):
            _, _, i, rest = name.split(".", 3)
            if rest in _LAYER:
                out[f"transformer.h.{i}.{_LAYER[rest]}"] = t
            else:
                attn.setdefault(i, {})[rest] = t
    heads, groups = cfg.num_attention_heads, cfg.kv_groups
    for i, p in attn.items():
        pre = f"transformer.h.{i}."
        out[pre + "mlp.c_fc.weight"] = torch.stack([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]])
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = (p[f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            if groups == heads:
                out[pre + f"attn.c_attn.{kind}"] = _per_head(q, k, v, heads)
            else:
                kv = torch.stack([k.reshape(groups, -1, *k.shape[1:]), v.reshape(groups, -1, *v.shape[1:])], dim=1)
                out[pre + f"attn.c_q.{kind}"], out[pre + f"attn.c_kv.{kind}"] = q, kv
    return {n: t.contiguous() for n, t in out.items()}


def tnlg_to_llama(full: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A Llama/Qwen2 state dict of tnlg's full state dict (the inverse of :func:`llama_to_tnlg`)."""
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
        elif rest == "mlp.c_fc.weight":
            out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = t[0], t[1]
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
