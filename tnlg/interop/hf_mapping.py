"""Hugging Face configs and state dicts <-> tnlg's: ``GPT2LMHeadModel`` here, the Llama layout
(``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``Qwen3ForCausalLM``) in
:mod:`tnlg.interop.hf_llama`; each family's entry of :mod:`tnlg.interop.families` says which. ``config.json``'s
``model_type`` picks the class read (:func:`~.families.family_named`); the architecture (and the family a
checkpoint records) picks the class written (:func:`~.families.family_of`).

GPT-2 stores linear weights as ``Conv1D`` (``[in, out]``, transposed) and its fused QKV as ``[q | k | v]``
over all heads, where tnlg lays QKV out per head (``[head][q, k, v][head_dim]``) so a contiguous TP split
gives whole heads. No collectives, no files: :mod:`tnlg.interop.hf_reader` reads folders,
:mod:`tnlg.interop.hf` builds models and writes folders.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from ..config import GPTConfig
from ..errors import UserError
from .families import Family, family_named, family_of
from .hf_fields import check_fields
from .hf_llama import config_from_llama, llama_config_from, llama_recipes, tnlg_to_llama

__all__ = ["TNLG_DTYPE", "Recipe", "config_from_hf", "hf_config_from", "tnlg_recipes", "build_tensor",
           "hf_to_tnlg_state_dict", "tnlg_to_hf_state_dict"]

_TANH_GELU, _EXACT_GELU = ("gelu_new", "gelu_pytorch_tanh"), ("gelu",)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


TNLG_DTYPE = torch.float32  # every tensor a Hugging Face model converts to (a bf16 folder's too)


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a config of a family tnlg reads (``model_type`` picks: :data:`~.families.FAMILIES`)."""
    family = family_named(getattr(hf_config, "model_type", None), "the model")
    check_fields(hf_config, family, "the Hugging Face model")
    if family.layout == "llama":
        return config_from_llama(hf_config, family, **overrides)
    return _config_from_gpt2(hf_config, **overrides)


def _config_from_gpt2(hf_config, **overrides) -> GPTConfig:
    act = getattr(hf_config, "activation_function", "gelu_new")
    if act not in _TANH_GELU + _EXACT_GELU:
        raise UserError(f"GPT-2 activation {act!r} is not supported; tnlg has GELU in tanh form (activation_function "
                        f"{' or '.join(map(repr, _TANH_GELU))}) or exact ({' or '.join(map(repr, _EXACT_GELU))}).")
    fields = dict(openai_gelu=act in _TANH_GELU,
                  untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True),
                  num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                  num_attention_heads=hf_config.n_head, seq_length=hf_config.n_positions,
                  max_position_embeddings=hf_config.n_positions,
                  vocab_size=hf_config.vocab_size, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                  hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                  layernorm_epsilon=hf_config.layer_norm_epsilon, init_method_std=hf_config.initializer_range,
                  scale_attn_weights=hf_config.scale_attn_weights,
                  scale_attn_by_inverse_layer_idx=hf_config.scale_attn_by_inverse_layer_idx)
    fields.update(overrides)
    return GPTConfig(**fields)


def hf_config_from(cfg: GPTConfig, eod_id: Optional[int] = None, family: Optional[Family] = None):
    """The Hugging Face config of ``cfg`` in ``family``'s class (default :func:`~.families.family_of` ``cfg``);
    ``bos``/``eos`` are the end-of-document id (GPT-2 uses ``<|endoftext|>`` for both), or unset without
    a tokenizer (GPT-2's default 50256 is outside most tnlg vocabularies)."""
    family = family or family_of(cfg)
    if family.layout == "llama":
        return llama_config_from(cfg, family, eod_id)
    from transformers import GPT2Config
    return GPT2Config(bos_token_id=eod_id, eos_token_id=eod_id,
                      n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
                      n_positions=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                      n_inner=None if cfg.ffn_hidden_size == 4 * cfg.hidden_size else cfg.ffn_hidden_size,
                      resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
                      attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
                      initializer_range=cfg.init_method_std,
                      activation_function=_TANH_GELU[0] if cfg.openai_gelu else _EXACT_GELU[0],
                      tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
                      scale_attn_weights=cfg.scale_attn_weights,
                      scale_attn_by_inverse_layer_idx=cfg.scale_attn_by_inverse_layer_idx)


def _qkv_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[3h, ...]`` rows in ``[q|k|v]`` order -> per-head ``[head][q,k,v][hd]`` order."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_from_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


class Recipe(NamedTuple):
    """How one tnlg tensor is built: the Hugging Face tensors it is made of (the names transformers' model
    gives them) and the function of those tensors, each as :data:`TNLG_DTYPE`, that builds it
    (:func:`build_tensor`)."""
    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor]


def _gpt2_tensor(t: torch.Tensor, conv1d: bool, heads: Optional[int]) -> torch.Tensor:
    """One GPT-2 tensor in tnlg's layout: a ``Conv1D`` weight transposed, the fused QKV per head."""
    t = t.t() if conv1d else t
    return t if heads is None else _qkv_to_per_head(t, heads)


def tnlg_recipes(hf_names, cfg: GPTConfig) -> dict[str, Recipe]:
    """``{tnlg name: its Recipe}`` of a Hugging Face state dict holding ``hf_names``: the one name mapping
    both :func:`hf_to_tnlg_state_dict` (every tensor at hand) and :class:`tnlg.interop.hf_reader.HFTensors`
    (each read from the files when looked up) build with. A tied ``lm_head`` and GPT-2's causal-mask
    buffers are no tnlg tensor."""
    if family_of(cfg).layout == "llama":
        return {n: Recipe(*r) for n, r in llama_recipes(hf_names, cfg).items()}
    out = {}
    for name in hf_names:
        if name == "lm_head.weight" and cfg.untie_embeddings_and_output_weights:
            out[name] = Recipe((name,), functools.partial(_gpt2_tensor, conv1d=False, heads=None))
        elif name.startswith("transformer.") and not name.endswith((".attn.bias", ".attn.masked_bias")):
            qkv = name.endswith(("attn.c_attn.weight", "attn.c_attn.bias"))
            out[name] = Recipe((name,), functools.partial(_gpt2_tensor, conv1d=name.endswith(_CONV1D),
                                                          heads=cfg.num_attention_heads if qkv else None))
    return out


def build_tensor(recipe: Recipe, tensors) -> torch.Tensor:
    """The tnlg tensor ``recipe`` builds from ``tensors`` (its sources' tensors, in order): contiguous,
    :data:`TNLG_DTYPE`."""
    return recipe.build(*(t.detach().to(TNLG_DTYPE) for t in tensors)).contiguous()


def hf_to_tnlg_state_dict(hf_sd: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """tnlg's full state dict of a Hugging Face state dict (:func:`tnlg_recipes`)."""
    return {n: build_tensor(r, [hf_sd[s] for s in r.sources]) for n, r in tnlg_recipes(hf_sd, cfg).items()}


def tnlg_to_hf_state_dict(full: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    if family_of(cfg).layout == "llama":
        return tnlg_to_llama(full, cfg)
    out = {}
    for name, t in full.items():
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            t = _qkv_from_per_head(t, cfg.num_attention_heads)
        if name.endswith(_CONV1D):
            t = t.t()
        out[name] = t.contiguous()
    if not cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
