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

The Llama family (:func:`layer_roles`, :func:`global_roles` list the tensors a configuration has):
RMSNorm has no bias; rope no position embedding; ``--disable-bias-linear`` no linear biases (QKV's
kept with ``--add-qkv-bias``). Grouped-query attention (``G`` groups of ``q = H / G`` heads): Megatron's
``linear_qkv`` rows are ``[G, q + 2, hn]`` (per group its query heads, then its key, then its value;
``G % TP == 0``, so each rank's shard is whole groups and the shards concatenate), tnlg's ``attn.c_q``
``[H hn]`` and ``attn.c_kv`` ``[G, 2, hn]`` (roles with ``take`` ``"q"`` / ``"kv"``, both read from
``linear_qkv``). SwiGLU: Megatron's ``linear_fc1`` holds ``[gate_r; up_r]`` per TP rank; its
``torch_dist`` tensor is ``[gate; up]`` ``[2 f, h]`` (``apply_swiglu_sharded_factory``), which is
tnlg's ``mlp.c_fc.weight`` ``[2, f, h]`` flattened (``take="swiglu"``); the legacy files' per-rank
halves are paired by :func:`swiglu_join` / :func:`swiglu_shard`.

Mixtures of experts (megatron-core only; a layer :meth:`~tnlg.config.GPTConfig.is_moe_layer` names): the MLP
slot holds ``mlp.router.weight`` ``[E, h]`` (replicated), the routed experts and, with a shared expert,
``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` (split as the dense MLP's) and its gate
``mlp.shared_experts.gate_weight`` ``[1, h]`` (replicated). A legacy file of TP rank ``t`` and EP rank ``r``
holds the ``E_l = E / EP`` experts ``r E_l .. (r + 1) E_l - 1`` (TP shard ``t`` of each), in one of two layouts:
``SequentialMLP`` ``mlp.experts.local_experts.<j>.linear_fc1.weight`` ``[2 f_t, h]`` (SwiGLU: ``[gate_t; up_t]``)
and ``linear_fc2.weight`` ``[h, f_t]``; the legacy ``GroupedMLP`` ``mlp.experts.weight1`` ``[h, E_l 2 f_t]`` and
``weight2`` ``[E_l f_t, h]``, whose memory is ``[E_l, h, 2 f_t]`` and ``[E_l, f_t, h]`` (its forward views them so):
expert ``j``'s ``linear_fc1`` is ``weight1.view(E_l, h, -1)[j].T``, its ``linear_fc2`` ``weight2.view(E_l, -1,
h)[j].T``. The full Megatron tensors of the roles ``take="experts_fc1"`` / ``"experts_fc2"`` are ``[E, 2 f, h]``
(``[gate; up]`` per expert) and ``[E, h, f]``: tnlg's ``mlp.experts.fc1`` ``[E, 2, f, h]`` flattened and
``mlp.experts.fc2`` as they are. ``torch_dist`` stores exactly these, EP- and TP-independent (``SequentialMLP``'s
and ``GroupedMLP``'s ``sharded_state_dict`` alike), under ``mlp.experts.experts.linear_fc1.weight`` /
``linear_fc2.weight`` (the roles' last core name): stacked over the layers ``[L, E, ...]``, or per layer
``decoder.layers.<l>.mlp.experts.experts.*`` ``[E, ...]`` where megatron-core saves every tensor per layer
(:func:`per_layer_keys`: a ``moe_layer_freq`` that mixes dense and MoE layers).

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

__all__ = ["Role", "LAYER_ROLES", "MOE_ROLES", "EXPERT_TAKES", "local_expert_names", "expert_rank_shards",
           "grouped_expert_tensor", "per_layer_keys", "GLOBAL_ROLES", "CORE_LAYER_PREFIX", "LEGACY_LAYER_PREFIXES",
           "LOCAL_EXTRA_STATE", "VOCAB_PARAMS", "tnlg_name", "qkv_to_current", "layer_roles", "global_roles",
           "megatron_shape", "to_tnlg", "qkv_from_tnlg", "swiglu_join", "swiglu_shard"]


@dataclass(frozen=True)
class Role:
    """One tnlg parameter (``tnlg``: its name, ``{i}`` the layer) and its Megatron names."""
    tnlg: str
    split: Optional[int]
    core: tuple[str, ...]      # megatron-core names (local spec first, then Transformer Engine)
    legacy: tuple[str, ...]    # legacy names
    take: Optional[str] = None  # how tnlg's tensor is laid out in Megatron's: "q", "kv" (of linear_qkv), "swiglu"

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
    # qk_layernorm (megatron-core only; both specs' name), last so that the indices above stay
    *(Role(f"attn.{x}_norm.{p}", None, (f"self_attention.{x}_layernorm.{p}",), (f"self_attention.{x}_layernorm.{p}",))
      for x in "qk" for p in ("weight", "bias")),
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

# the roles of a mixture-of-experts MLP slot (names relative to the layer's prefix; the experts' names are of local
# expert <j> in a SequentialMLP, then the GroupedMLP tensor that holds them all)
MOE_ROLES: tuple[Role, ...] = (
    Role("mlp.router.weight", None, ("mlp.router.weight",), ()),
    Role("mlp.experts.fc1", 0, ("mlp.experts.local_experts.<j>.linear_fc1.weight", "mlp.experts.weight1",
                                "mlp.experts.experts.linear_fc1.weight"), (), "experts_fc1"),
    Role("mlp.experts.fc2", 1, ("mlp.experts.local_experts.<j>.linear_fc2.weight", "mlp.experts.weight2",
                                "mlp.experts.experts.linear_fc2.weight"), (), "experts_fc2"),
    Role("mlp.shared_expert.c_fc.weight", 0, ("mlp.shared_experts.linear_fc1.weight",), ()),
    Role("mlp.shared_expert.c_proj.weight", 1, ("mlp.shared_experts.linear_fc2.weight",), ()),
    Role("mlp.shared_expert_gate.weight", None, ("mlp.shared_experts.gate_weight",), ()),
)
EXPERT_TAKES = ("experts_fc1", "experts_fc2")

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


def _gqa(role: Role, take: str) -> Role:
    """The grouped-query role ``take`` (``"q"``/``"kv"``) of the fused QKV ``role`` (Megatron's ``linear_qkv``)."""
    part = "c_q" if take == "q" else "c_kv"
    return Role(role.tnlg.replace("c_attn", part), role.split, role.core, role.legacy, take)


def _has(role: Role, cfg) -> bool:
    """Whether the configuration has this layer role's tensor (the model's biases and norms)."""
    name = role.tnlg
    if name.startswith(("attn.q_norm.", "attn.k_norm.")):
        return cfg.qk_layernorm and (name.endswith(".weight") or cfg.normalization == "LayerNorm")
    if name.endswith("ln_1.bias") or name.endswith("ln_2.bias"):
        return cfg.normalization == "LayerNorm"
    if name == "attn.c_attn.bias":
        return cfg.qkv_bias
    if name.endswith(".bias"):
        return cfg.add_bias_linear
    return True


def _moe_roles(cfg) -> list[Role]:
    """The roles of a mixture-of-experts MLP slot of ``cfg`` (the shared expert and its gate where it has them)."""
    out = []
    for role in MOE_ROLES:
        if role.tnlg.startswith("mlp.shared_expert.") and cfg.moe_shared_expert_intermediate_size is None:
            continue
        if role.tnlg.startswith("mlp.shared_expert_gate") and not cfg.moe_shared_expert_gate:
            continue
        swiglu = role.tnlg == "mlp.shared_expert.c_fc.weight" and cfg.swiglu
        out.append(Role(role.tnlg, role.split, role.core, role.legacy, "swiglu") if swiglu else role)
    return out


def layer_roles(cfg, layer: Optional[int] = None) -> tuple[Role, ...]:
    """The roles of transformer layer ``layer`` of ``cfg`` (a :class:`~tnlg.config.GPTConfig`; ``None``: a dense
    layer's), in tnlg's order; grouped-query attention gives two roles (``c_q``, ``c_kv``) per Megatron
    ``linear_qkv`` tensor; a mixture of experts its MLP slot's roles (:data:`MOE_ROLES`)."""
    out: list[Role] = []
    moe = layer is not None and cfg.is_moe_layer(layer)
    for role in LAYER_ROLES:
        if moe and role.tnlg.startswith("mlp.c_proj"):
            continue
        if moe and role.tnlg.startswith("mlp.c_fc"):
            if role.tnlg.endswith(".weight"):
                out += _moe_roles(cfg)
            continue
        if not _has(role, cfg):
            continue
        if role.tnlg.startswith("attn.c_attn") and cfg.kv_groups != cfg.num_attention_heads:
            out += [_gqa(role, "q"), _gqa(role, "kv")]
        elif role.tnlg.startswith("mlp.c_fc") and cfg.swiglu:
            out.append(Role(role.tnlg, role.split, role.core, role.legacy, "swiglu"))
        else:
            out.append(role)
    return tuple(out)


def global_roles(cfg) -> tuple[tuple[Role, ...], tuple[Role, ...]]:
    """``(first stage's, last stage's)`` roles outside the layers: the embedding (and learned positions);
    the final norm's weight (and LayerNorm's bias) and an untied output layer."""
    first = GLOBAL_ROLES[:2] if cfg.position_embedding_type == "learned_absolute" else GLOBAL_ROLES[:1]
    last = GLOBAL_ROLES[2:4] if cfg.normalization == "LayerNorm" else GLOBAL_ROLES[2:3]
    return first, last + ((GLOBAL_ROLES[4],) if cfg.untie_embeddings_and_output_weights else ())


def megatron_shape(role: Role, cfg, shape: tuple) -> tuple:
    """The full shape of Megatron's tensor for the role whose tnlg tensor has ``shape``."""
    if role.take in ("q", "kv"):
        rows = (cfg.num_attention_heads + 2 * cfg.kv_groups) * cfg.head_dim
        return (rows, *shape[(1 if role.take == "q" else 3):])
    if role.take == "swiglu":
        return (2 * shape[1], *shape[2:])
    if role.take == "experts_fc1" and len(shape) == 4:  # SwiGLU experts [E, 2, f, h] -> [E, 2 f, h]
        return (shape[0], 2 * shape[2], shape[3])
    return tuple(shape)


def _grouped(t: torch.Tensor, cfg) -> torch.Tensor:
    """Megatron's ``linear_qkv`` rows ``[(H + 2G) hn, ...]`` as ``[G, q + 2, hn, ...]``."""
    return t.reshape(cfg.kv_groups, cfg.num_attention_heads // cfg.kv_groups + 2, cfg.head_dim, *t.shape[1:])


def to_tnlg(role: Role, t: torch.Tensor, cfg) -> torch.Tensor:
    """Megatron's full tensor of ``role`` in tnlg's layout (``take``; others unchanged)."""
    if role.take == "q":  # [G, q, hn, ...] -> [H hn, ...]
        return _grouped(t, cfg)[:, :-2].flatten(0, 2)
    if role.take == "kv":  # [G, 2, hn, ...]
        return _grouped(t, cfg)[:, -2:].clone()
    if role.take == "swiglu":  # [gate; up] -> [2, f, ...]
        return t.reshape(2, -1, *t.shape[1:])
    if role.take == "experts_fc1" and cfg.swiglu:  # [E, 2 f, h] ([gate; up] per expert) -> [E, 2, f, h]
        return t.reshape(t.shape[0], 2, -1, t.shape[-1])
    return t


def qkv_from_tnlg(q: torch.Tensor, kv: torch.Tensor, cfg) -> torch.Tensor:
    """Megatron's ``linear_qkv`` ``[(H + 2G) hn, ...]`` of tnlg's ``c_q`` ``[H hn, ...]`` and ``c_kv``
    ``[G, 2, hn, ...]`` (the inverse of :func:`to_tnlg`)."""
    per = q.reshape(cfg.kv_groups, cfg.num_attention_heads // cfg.kv_groups, cfg.head_dim, *q.shape[1:])
    return torch.cat([per, kv], dim=1).flatten(0, 2)


def swiglu_join(shards: list) -> torch.Tensor:
    """The TP shards of a SwiGLU ``linear_fc1`` (each ``[gate_r; up_r]``) as ``[gate; up]``."""
    halves = [s.reshape(2, -1, *s.shape[1:]) for s in shards]
    return torch.cat(halves, dim=1).flatten(0, 1)


def swiglu_shard(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s ``[gate_r; up_r]`` of a SwiGLU ``linear_fc1`` ``[gate; up]`` (:func:`swiglu_join`'s inverse)."""
    return t.reshape(2, -1, *t.shape[1:]).chunk(tp, dim=1)[rank].flatten(0, 1).clone()


def per_layer_keys(moe_layer_freq) -> bool:
    """Whether megatron-core's ``torch_dist`` save keys every layer's tensors per layer
    (``decoder.layers.<l>.<name>``) rather than stacked over the layers (``decoder.layers.<name>``
    ``[L, ...]``): for a Megatron ``moe_layer_freq`` (the saved args') that is a list or an integer above 1, as
    ``TransformerBlock.sharded_state_dict`` decides (``non_homogeneous_layers``)."""
    return isinstance(moe_layer_freq, list) or (isinstance(moe_layer_freq, int) and moe_layer_freq > 1)


def grouped_expert_tensor(role: Role, experts: list[torch.Tensor]) -> torch.Tensor:
    """One rank's ``GroupedMLP`` tensor (``weight1`` ``[h, E_l 2 f_t]`` / ``weight2`` ``[E_l f_t, h]``) of its local
    experts' ``linear_fc1`` ``[2 f_t, h]`` / ``linear_fc2`` ``[h, f_t]`` (:func:`expert_rank_shards`' inverse)."""
    stacked = torch.stack([x.t() for x in experts]).contiguous()  # [E_l, h, 2 f_t] / [E_l, f_t, h]
    hidden = experts[0].shape[1 if role.take == "experts_fc1" else 0]
    return stacked.view(hidden, -1) if role.take == "experts_fc1" else stacked.view(-1, hidden)


def local_expert_names(role: Role, local: int) -> list[str]:
    """A ``SequentialMLP``'s names of ``role`` (an expert role) for its ``local`` experts, in order."""
    return [role.core[0].replace("<j>", str(j)) for j in range(local)]


def expert_rank_shards(role: Role, grouped: torch.Tensor, local: int, hidden: int) -> list[torch.Tensor]:
    """One rank's ``GroupedMLP`` tensor (``weight1`` ``[h, E_l 2 f_t]`` or ``weight2`` ``[E_l f_t, h]``) as its
    ``local`` experts' ``linear_fc1`` ``[2 f_t, h]`` / ``linear_fc2`` ``[h, f_t]`` (module docstring)."""
    if role.take == "experts_fc1":
        return list(grouped.reshape(local, hidden, -1).transpose(1, 2))
    return list(grouped.reshape(local, -1, hidden).transpose(1, 2))

