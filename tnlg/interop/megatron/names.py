"""Parameter names and layouts: tnlg <-> Megatron-LM (megatron-core and the legacy model).

One row per tnlg parameter role: how Megatron splits it over TP (``split``: 0 column-parallel,
1 row-parallel, ``None`` replicated) and its names in each Megatron naming:

* megatron-core, local spec (``get_gpt_layer_local_spec``): ``decoder.layers.N.input_layernorm``,
  ``self_attention.linear_qkv``, ``self_attention.linear_proj``, ``pre_mlp_layernorm``,
  ``mlp.linear_fc1``, ``mlp.linear_fc2``; ``embedding.word_embeddings``,
  ``embedding.position_embeddings``, ``decoder.final_layernorm``, ``output_layer``;
* megatron-core, Transformer Engine spec: the LayerNorms fused into the next linear layer
  (``linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``); the ``torch_dist`` format
  uses these names for both specs (``sharded_state_dict`` maps the local spec onto them);
* legacy (``megatron/legacy/model``, before megatron-core): ``language_model.encoder.layers.N.``
  (older: ``language_model.transformer.``) with ``self_attention.query_key_value``
  (older: ``attention.``), ``self_attention.dense``, ``post_attention_layernorm``,
  ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``; ``language_model.embedding.*``,
  ``language_model.output_layer``.

Transformer Engine's ``_extra_state`` entries (FP8 scaling state) hold no weights and are ignored.

QKV rows (``checkpoint_version`` of the legacy checkpoint; ``megatron/training/checkpointing.py``,
``fix_query_key_value_ordering``), per TP rank with ``np`` heads of ``hn`` rows:
version 0 ``[3, np, hn]``, version 1.0 ``[np, hn, 3]``, version >= 2.0 ``[np, 3, hn]``. megatron-core
(version 3.0) and tnlg both use ``[np, 3, hn]`` (per head: its query, key and value rows), so
ranks' shards concatenate into tnlg's fused QKV unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Role", "LAYER_ROLES", "GLOBAL_ROLES", "CORE_LAYER_PREFIX", "LEGACY_LAYER_PREFIXES", "LOCAL_EXTRA_STATE",
           "VOCAB_PARAMS", "tnlg_name", "qkv_to_current"]


@dataclass(frozen=True)
class Role:
    """One tnlg parameter (``tnlg``: its name, ``{i}`` the layer) and its Megatron names."""
    tnlg: str
    split: Optional[int]
    core: tuple[str, ...]      # megatron-core names (local spec first, then Transformer Engine)
    legacy: tuple[str, ...]    # legacy names

    @property
    def dist_key(self) -> str:
        """The ``torch_dist`` key (layer-stacked for layer roles: ``decoder.layers.<name>``)."""
        return self.core[-1]


def _ln(tnlg: str, local: str, te: str, legacy: str) -> tuple[Role, Role]:
    weight, bias = (Role(f"{tnlg}.{p}", None, (f"{local}.{p}", f"{te}_{p}"), (f"{legacy}.{p}",))
                    for p in ("weight", "bias"))
    return weight, bias


def _linear(tnlg: str, split: int, core: str, legacy: tuple[str, ...], bias_split: Optional[int]) -> tuple[Role, Role]:
    return (Role(f"{tnlg}.weight", split, (f"{core}.weight",), tuple(f"{n}.weight" for n in legacy)),
            Role(f"{tnlg}.bias", bias_split, (f"{core}.bias",), tuple(f"{n}.bias" for n in legacy)))


# roles inside transformer layer N (names relative to the layer's prefix)
LAYER_ROLES: tuple[Role, ...] = (
    *_ln("ln_1", "input_layernorm", "self_attention.linear_qkv.layer_norm", "input_layernorm"),
    *_linear("attn.c_attn", 0, "self_attention.linear_qkv",
             ("self_attention.query_key_value", "attention.query_key_value"), 0),
    *_linear("attn.c_proj", 1, "self_attention.linear_proj", ("self_attention.dense", "attention.dense"), None),
    *_ln("ln_2", "pre_mlp_layernorm", "mlp.linear_fc1.layer_norm", "post_attention_layernorm"),
    *_linear("mlp.c_fc", 0, "mlp.linear_fc1", ("mlp.dense_h_to_4h",), 0),
    *_linear("mlp.c_proj", 1, "mlp.linear_fc2", ("mlp.dense_4h_to_h",), None),
)
CORE_LAYER_PREFIX = "decoder.layers."
LEGACY_LAYER_PREFIXES = ("language_model.encoder.layers.", "language_model.transformer.layers.")

GLOBAL_ROLES: tuple[Role, ...] = (
    Role("transformer.wte.weight", 0, ("embedding.word_embeddings.weight",),
         ("language_model.embedding.word_embeddings.weight",)),
    Role("transformer.wpe.weight", None, ("embedding.position_embeddings.weight",),
         ("language_model.embedding.position_embeddings.weight",)),
    Role("transformer.ln_f.weight", None, ("decoder.final_layernorm.weight",),
         ("language_model.encoder.final_layernorm.weight", "language_model.transformer.final_layernorm.weight")),
    Role("transformer.ln_f.bias", None, ("decoder.final_layernorm.bias",),
         ("language_model.encoder.final_layernorm.bias", "language_model.transformer.final_layernorm.bias")),
    Role("lm_head.weight", 0, ("output_layer.weight",), ("language_model.output_layer.weight",)),
)

# the parameters with a row per vocabulary entry (Megatron pads them, tnlg stores the real rows)
VOCAB_PARAMS = ("transformer.wte.weight", "lm_head.weight")

# the linear layers whose ``_extra_state`` megatron-core's local spec keeps (None) in its state dict
LOCAL_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def tnlg_name(role: Role, layer: Optional[int]) -> str:
    return role.tnlg if layer is None else f"transformer.h.{layer}.{role.tnlg}"


def qkv_to_current(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """One TP rank's fused QKV rows (``heads`` of its heads) from checkpoint ``version``'s order to
    ``[np, 3, hn]`` (module docstring); versions >= 2.0 are returned as they are."""
    if version >= 2.0:
        return t
    rest = t.shape[1:]
    if version == 0:
        return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)
    if version == 1.0:
        return t.reshape(heads, -1, 3, *rest).transpose(1, 2).reshape(t.shape)
    raise ValueError(f"checkpoint_version {version} has no known QKV order (0, 1.0, or 2.0 and later)")
