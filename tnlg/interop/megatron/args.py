"""Megatron-LM's saved ``args`` <-> :class:`tnlg.config.GPTConfig`.

A Megatron checkpoint carries the ``argparse.Namespace`` of the run that wrote it (``args``);
the architecture comes from there. The mapping is read from :class:`~tnlg.config.GPTConfig`'s
declarations: every architecture field is the Megatron argument its declaration names (``megatron``,
default the field's name: ``position_embedding_type``, ``rotary_base``, ``rotary_percent``,
``normalization``, ``norm_epsilon``, ``swiglu``, ``group_query_attention``, ``num_query_groups``,
``add_bias_linear``, ``add_qkv_bias``, ``untie_embeddings_and_output_weights``, ``max_position_embeddings``
and ``seq_length`` by the same names, ...); an argument a run did not save has Megatron-LM's default
(:data:`_MEGATRON_DEFAULTS` where it differs from tnlg's). Arguments that describe an architecture tnlg
does not model (experts, multi-latent attention, squared ReLU, QK norms, scaled or interleaved rope,
...: :data:`.core_fields.REFUSED`) are refused, one clear error naming the argument.

Sliding windows: Megatron's ``window_size`` ``(left, right)`` lets the query at ``p`` see the keys
``p - left .. p + right`` (``-1``: unbounded); tnlg's ``sliding_window`` ``w`` is ``(w - 1, 0)``.
``window_attn_skip_freq`` picks the sliding layers: an integer ``N`` makes every ``N``-th layer (1-based)
full, a list holds 1 for each sliding layer (tnlg's ``window_layers``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from ...config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, GPTConfig, padded_vocab_size
from ...errors import UserError
from .core_fields import check_refused
from .safe_load import shown

__all__ = ["MegatronLayout", "MEGATRON_LLAMA3", "check_megatron_expressible", "check_sizes", "or_default", "whole",
           "check_supported", "known_vocab_size", "layout_of", "config_from_args", "args_for"]

# the values tnlg models of Megatron arguments that select among several (one clear error for the others)
_CHOICES = (("position_embedding_type", POSITION_EMBEDDING_TYPES), ("normalization", NORMALIZATIONS))

# Megatron-LM's defaults where they differ from GPTConfig's (an argument an older run did not save)
_MEGATRON_DEFAULTS = dict(openai_gelu=False, hidden_dropout=0.1, attention_dropout=0.1)
# GPTConfig's architecture fields read otherwise than by their declared argument (config_from_args)
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
_DERIVED = ("vocab_size", "ffn_hidden_size", "max_position_embeddings", "num_query_groups", "layernorm_epsilon", "sliding_window",
            "window_layers", "moe_layer_freq")
# GPTConfig's mixture-of-experts fields (read only with num_experts: a dense run saves Megatron's defaults of them)
_MOE_FIELDS = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name.startswith("moe_"))

# tokenizers whose size Megatron computes from a fixed vocabulary
_TOKENIZER_SIZES = {"GPT2BPETokenizer": 50257}


@dataclass(frozen=True)
class MegatronLayout:
    """How a Megatron checkpoint splits the model: TP and PP sizes and the padded vocabulary rows."""
    tp: int
    pp: int
    padded_vocab_size: int
    iteration: int
    checkpoint_version: float
    ep: int = 1  # expert_model_parallel_size: the legacy files' split of the experts (mp_rank_TT[_PPP]_EEE)


# the saved args' sizes: each a whole number in [1, limit] (a limit no model reaches, which keeps every
# check of them cheap: the layer count is then checked against the files before anything is built)
_SIZES = (("num_layers", 1 << 16), ("hidden_size", 1 << 20), ("num_attention_heads", 1 << 16),
          ("ffn_hidden_size", 1 << 22), ("kv_channels", 1 << 20), ("num_query_groups", 1 << 16),
          ("max_position_embeddings", 1 << 31), ("seq_length", 1 << 31), ("padded_vocab_size", 1 << 31),
          ("vocab_size", 1 << 31), ("make_vocab_size_divisible_by", 1 << 20), ("tensor_model_parallel_size", 1 << 16),
          ("pipeline_model_parallel_size", 1 << 16), ("global_batch_size", 1 << 40))


def whole(value, name: str, where: str, low: int = 1, high: int = 1 << 62) -> int:
    """``value`` (read from a checkpoint: any type) as an int in ``[low, high]``, else one
    :class:`UserError` naming it; an integral float counts (older Megatron runs saved some as floats)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise UserError(f"{where}: {name} is {shown(value)}, not a whole number from {low} to {high}; the checkpoint "
                        "is damaged or was not written by Megatron-LM. Nothing was written.")
    return value


def or_default(value, default):
    """Megatron's ``value or default`` for a value read from a file: ``default`` for ``None``, ``False``
    and zero, else the value (a tensor or container is left for the checks to name)."""
    if value is None or value is False or (isinstance(value, (int, float)) and value == 0):
        return default
    return value


def _plain(args, name: str, where: str):
    """The saved argument ``name``: a plain value (``None``, a bool, number or string) or one :class:`UserError`."""
    value = _arg(args, name)
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise UserError(f"{where}: the saved args' {name} is {shown(value)}, not a value Megatron-LM saves there; "
                        "the checkpoint is damaged. Nothing was written.")
    return value


def check_sizes(args, where: str) -> None:
    """The saved args' sizes that are set are whole numbers within reason (:data:`_SIZES`)."""
    for name, limit in _SIZES:
        if _arg(args, name) is not None:
            whole(_arg(args, name), f"the saved args' {name}", where, 1, limit)


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


def _required(args, name: str, where: str):
    value = getattr(args, name, None)
    if value is None:
        raise UserError(f"{where}: the saved args have no {name!r}, which tnlg needs to rebuild the model; the "
                        "checkpoint was not written by Megatron-LM's pretrain_gpt.py, or its args were stripped. "
                        "Nothing was written.")
    return value


def check_supported(args, where: str) -> None:
    """One :class:`UserError` naming the first argument that selects an architecture tnlg does not model."""
    check_refused(args, where)
    glu, swiglu = _plain(args, "gated_linear_unit", where), bool(_plain(args, "swiglu", where))
    if glu is not None and bool(glu) != swiglu:
        raise UserError(f"{where}: the checkpoint's args set gated_linear_unit={glu!r} with swiglu={swiglu!r}; "
                        "Megatron-LM then gates the MLP with another activation than SiLU (or not at all), which "
                        "tnlg does not compute (it models gated_linear_unit equal to swiglu). Nothing was written.")
    for name, valid in _CHOICES:
        value = _plain(args, name, where)
        if value is not None and value not in valid:
            raise UserError(f"{where}: the checkpoint's args set {name}={shown(value)}, which tnlg does not model "
                            f"(it models {name} {' or '.join(map(repr, valid))}). Nothing was written.")
    if _plain(args, "add_position_embedding", where) is False and _position_type(args, where) == "learned_absolute":
        raise UserError(f"{where}: the checkpoint's args set add_position_embedding=False with learned_absolute "
                        "positions (a model without positions); tnlg reads it as position_embedding_type='none' only "
                        "when the args say so. Nothing was written.")
    _window(args, where)


def _window(args, where: str) -> dict:
    """tnlg's ``sliding_window`` and ``window_layers`` of the saved ``window_size`` and
    ``window_attn_skip_freq`` (module docstring), or one :class:`UserError` for a window tnlg does not compute
    (one that looks ahead)."""
    size, freq = _arg(args, "window_size"), _arg(args, "window_attn_skip_freq")
    if size is None:
        return dict(sliding_window=None, window_layers=None)
    ok = isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                    and x >= -1 for x in size)
    if ok and tuple(size) == (-1, 0):  # unbounded on the left: plain causal attention
        return dict(sliding_window=None, window_layers=None)
    if not ok or size[1] != 0 or size[0] == -1:
        raise UserError(f"{where}: the checkpoint's args set window_size={shown(size)}; tnlg computes causal sliding "
                        "windows, window_size (left, 0) with left >= 0 (a query sees itself and the left positions "
                        "before it). Nothing was written.")
    layers = _arg(args, "num_layers")
    if freq is None:
        return dict(sliding_window=size[0] + 1, window_layers=None)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0 and isinstance(layers, int):
        return dict(sliding_window=size[0] + 1, window_layers=[int((i + 1) % freq != 0) for i in range(layers)])
    if isinstance(freq, (list, tuple)) and len(freq) == layers and all(x in (0, 1) for x in freq):
        return dict(sliding_window=size[0] + 1, window_layers=[int(x) for x in freq])
    raise UserError(f"{where}: the checkpoint's args set window_attn_skip_freq={shown(freq)}, which is neither a "
                    f"positive integer nor a list of 0 / 1 per layer ({shown(layers)} layers). Nothing was written.")


def _position_type(args, where: str) -> str:
    """``position_embedding_type``, ``rope`` for an older run's ``use_rotary_position_embeddings``."""
    if _plain(args, "use_rotary_position_embeddings", where):
        return "rope"
    return _plain(args, "position_embedding_type", where) or "learned_absolute"


def _declared(args, where: str) -> dict:
    """GPTConfig's architecture fields from the arguments their declarations name (Megatron's defaults
    for those not saved); the fields of :data:`_DERIVED` are left to :func:`config_from_args`."""
    out = {}
    for f in dataclasses.fields(GPTConfig):
        if not f.metadata.get("arch") or f.name in _DERIVED or f.metadata.get("megatron") == "":
            continue  # (a field no Megatron argument carries keeps its default; the rope scaling: _rope_scaling)
        value = _plain(args, f.metadata.get("megatron", f.name), where)
        if value is None:
            value = _required(args, f.name, where) if f.name in _REQUIRED else _MEGATRON_DEFAULTS.get(f.name, f.default)
        if isinstance(f.default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif isinstance(value, float) and value.is_integer() and isinstance(f.default, int):
            value = int(value)  # an older run's integral float (check_sizes has checked the sizes)
        out[f.name] = value
    out["position_embedding_type"] = _position_type(args, where)
    out.update(_rope_scaling(args, where))
    out.update(_experts(args, where, out))
    return out


def _experts(args, where: str, declared: dict) -> dict:
    """The mixture-of-experts fields of the saved args (docs/moe.md): with ``num_experts`` unset (or 0) a dense
    model, whose saved MoE arguments (Megatron's defaults) are dropped; else ``moe_layer_freq`` (an integer or a
    list of 0 / 1 per layer) read here, and the MoE choices tnlg does not compute refused by name. megatron-core's
    own field ``num_moe_experts``, where saved, must agree with Megatron-LM's ``num_experts``."""
    core = _arg(args, "num_moe_experts")
    if core is not None and core != (declared.get("num_experts") or None):
        raise UserError(f"{where}: the checkpoint's args set num_moe_experts={shown(core)} (megatron-core's field of "
                        f"a mixture of experts) but num_experts={shown(declared.get('num_experts'))} (Megatron-LM's "
                        "argument that sets it): the args contradict themselves, which tnlg does not model. Nothing "
                        "was written.")
    if not declared.get("num_experts"):
        return dict({name: dataclasses.fields(GPTConfig)[_FIELD_INDEX[name]].default for name in _MOE_FIELDS},
                    num_experts=None)
    kind = declared.get("moe_router_load_balancing_type")
    if kind not in (None, "aux_loss", "seq_aux_loss", "none"):
        raise UserError(f"{where}: the checkpoint's args set moe_router_load_balancing_type={shown(kind)}; tnlg "
                        "computes the aux_loss, seq_aux_loss or none balancing (not sinkhorn, global_aux_loss or "
                        "a list of several): converted, a training run would balance the experts otherwise. "
                        "Nothing was written.")
    if declared.get("moe_router_enable_expert_bias"):
        raise UserError(f"{where}: the checkpoint's args set moe_router_enable_expert_bias=True: its routers' "
                        "expert_bias picks each token's experts, and tnlg checkpoints do not hold that bias yet "
                        "(a converted model would route from a zero bias, another model). Nothing was written.")
    etp, tp = _arg(args, "expert_tensor_parallel_size"), or_default(_arg(args, "tensor_model_parallel_size"), 1)
    if etp is not None and etp != tp:
        raise UserError(f"{where}: the checkpoint's args set expert_tensor_parallel_size={shown(etp)} with "
                        f"tensor_model_parallel_size={shown(tp)}: tnlg reads experts split over TP as the dense "
                        "layers (expert_tensor_parallel_size unset or equal to TP). Nothing was written.")
    freq = _arg(args, "moe_layer_freq")
    if isinstance(freq, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in freq):
        return dict(moe_layer_freq=[int(x) for x in freq])
    if freq is None or (isinstance(freq, int) and not isinstance(freq, bool)):
        return dict(moe_layer_freq=None if freq in (None, 1) else [freq])
    raise UserError(f"{where}: the checkpoint's args set moe_layer_freq={shown(freq)}, neither a positive integer "
                    "nor a list of 0 / 1 per layer. Nothing was written.")


_FIELD_INDEX = {f.name: i for i, f in enumerate(dataclasses.fields(GPTConfig))}


# megatron-core's RotaryEmbedding._apply_scaling: Llama 3.1's scaling with these fixed (only the factor is an argument)
MEGATRON_LLAMA3 = dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192)


def _rope_scaling(args, where: str) -> dict:
    """``--use-rope-scaling --rope-scaling-factor F`` (megatron-core 0.16.1: Llama 3.1's scaling, low / high
    frequency factors 1 and 4, original length 8192) as GPTConfig's llama3 rope fields."""
    if not _plain(args, "use_rope_scaling", where):
        return {}
    factor = _plain(args, "rope_scaling_factor", where)
    factor = 8.0 if factor is None else factor  # (Megatron-LM's default)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise UserError(f"{where}: the checkpoint's args set use_rope_scaling with rope_scaling_factor="
                        f"{shown(factor)}, not a positive number. Nothing was written.")
    return dict(rope_scaling_type="llama3", rope_scaling_factor=float(factor), **MEGATRON_LLAMA3)


def check_megatron_expressible(cfg: GPTConfig) -> None:
    """One :class:`UserError` when Megatron-LM's arguments cannot carry ``cfg``: a field no Megatron argument
    carries (``megatron=""`` in its declaration) away from its default, except Llama 3.1's rope scaling
    with megatron-core's fixed frequency factors and length (``--use-rope-scaling``)."""
    if cfg.moe_router_enable_expert_bias:
        raise UserError("the model routes with an expert bias (moe_router_enable_expert_bias), which tnlg checkpoints "
                        "do not hold yet; a Megatron-LM model loaded from the export would route from a zero bias. "
                        "Nothing was written.")
    llama3 = cfg.rope_scaling_type == "llama3" and all(getattr(cfg, k) == v for k, v in MEGATRON_LLAMA3.items())
    rope = set(MEGATRON_LLAMA3) | {"rope_scaling_type", "rope_scaling_factor"}
    off = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(GPTConfig)
           if f.metadata.get("megatron") == "" and getattr(cfg, f.name) != f.default
           and not (llama3 and f.name in rope)]
    if off:
        raise UserError(f"the model sets {', '.join(off)}, which no Megatron-LM argument carries (megatron-core "
                        "scales rope as Llama 3.1 with low_freq_factor 1, high_freq_factor 4 and original length "
                        "8192 only, --use-rope-scaling, and has no attention-only or MLP-only biases nor GPT-2's "
                        "attention scalings); a Megatron run would compute another model. Nothing was written.")


def known_vocab_size(args) -> Optional[int]:
    """The tokenizer's real vocabulary size when the saved args determine it (GPT-2 BPE: 50257;
    ``NullTokenizer``: ``vocab_size`` + its end-of-document id; else ``vocab_size``, "the size of the
    vocabulary before padding", when given), else ``None``."""
    kind, size = _arg(args, "tokenizer_type"), or_default(_arg(args, "vocab_size"), None)
    if isinstance(kind, str) and kind in _TOKENIZER_SIZES:
        return _TOKENIZER_SIZES[kind]
    if size is not None:
        return whole(size, "the saved args' vocab_size", "Megatron checkpoint") + (1 if kind == "NullTokenizer" else 0)
    return None


def layout_of(args, where: str, checkpoint: dict) -> MegatronLayout:
    """The TP/PP layout and padded vocabulary the checkpoint was written with."""
    check_sizes(args, where)
    tp, pp = (whole(or_default(_arg(args, name), 1), name, where, 1, 1 << 16)
              for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    padded = whole(_required(args, "padded_vocab_size", where), "padded_vocab_size", where, 1, 1 << 31)
    version = or_default(checkpoint.get("checkpoint_version"), 0)
    if not isinstance(version, (int, float)) or isinstance(version, bool) or not 0 <= version < 100:
        raise UserError(f"{where}: checkpoint_version is {shown(version)}, not a number (Megatron-LM writes 0 "
                        "to 3.0); the checkpoint is damaged. Nothing was written.")
    iteration = whole(or_default(checkpoint.get("iteration"), 0), "iteration", where, 0)
    ep = whole(or_default(_arg(args, "expert_model_parallel_size"), 1), "expert_model_parallel_size", where, 1, 1 << 16)
    return MegatronLayout(tp, pp, padded, iteration, float(version), ep)


def config_from_args(args, where: str, vocab_size: Optional[int] = None) -> GPTConfig:
    """The :class:`GPTConfig` of a Megatron run's ``args``; ``vocab_size``: the tokenizer's real size
    (default: :func:`known_vocab_size`, else the padded size, whose extra rows then stay logits)."""
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{where}: the checkpoint's 'args' is a {type(args).__name__}, not Megatron-LM's "
                        "argparse.Namespace. Nothing was written.")
    check_sizes(args, where)
    check_supported(args, where)
    padded = int(_required(args, "padded_vocab_size", where))
    vocab = vocab_size or known_vocab_size(args) or padded
    if vocab > padded:
        raise UserError(f"{where}: the tokenizer has {vocab} tokens but the checkpoint's embedding only "
                        f"{padded} rows (padded_vocab_size); it is not this model's tokenizer. Nothing was written.")
    gqa = bool(_plain(args, "group_query_attention", where))
    eps = _plain(args, "norm_epsilon", where)
    try:
        return GPTConfig(
            **_declared(args, where), vocab_size=int(vocab),
            ffn_hidden_size=int(ffn) if isinstance(ffn := _arg(args, "ffn_hidden_size"), (int, float)) and ffn else None,
            **_lengths(args, where),
            num_query_groups=int(_required(args, "num_query_groups", where)) if gqa else None,
            layernorm_epsilon=float(eps if eps is not None else _arg(args, "layernorm_epsilon", 1e-5)),
            init_method_std=float(_arg(args, "init_method_std", 0.02)),
            make_vocab_size_divisible_by=int(_arg(args, "make_vocab_size_divisible_by", 128)),
            seed=int(_arg(args, "seed", 1234)), **_window(args, where))
    except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
        raise UserError(f"{where}: the saved args do not describe a valid model: {str(exc)[:300]} Nothing was "
                        "written.") from None


def _lengths(args, where: str) -> dict:
    """``seq_length`` (Megatron's ``--seq-length``, the run's samples) and ``max_position_embeddings`` (the
    model's positions; Megatron's default: the sequence length). A rope run may train on sequences longer than
    its ``--max-position-embeddings`` (megatron-core's rope reads no table): then the positions are the
    sequence length."""
    seq = _arg(args, "seq_length") or _arg(args, "max_position_embeddings") or _required(args, "seq_length", where)
    positions = _arg(args, "max_position_embeddings") or seq
    return dict(seq_length=int(seq), max_position_embeddings=max(int(positions), int(seq)))


def _tokenizer_args(tokenizer: Optional[dict]) -> dict:
    """Megatron's tokenizer arguments for a tnlg checkpoint's recorded tokenizer (``describe()``)."""
    if not tokenizer:
        return dict(tokenizer_type=None)
    if tokenizer.get("kind") == "tokenizer-json" and isinstance(tokenizer.get("path"), str):
        return dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.dirname(tokenizer["path"]))
    if tokenizer.get("kind") == "gpt2bpe":
        return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=tokenizer.get("vocab_file"),
                    merge_file=tokenizer.get("merges_file"))
    return dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=tokenizer.get("path"))


def _declared_args(cfg: GPTConfig) -> dict:
    """The Megatron arguments of ``cfg``'s architecture fields, under their declared names (and the
    older names Megatron-LM also reads: ``layernorm_epsilon``, ``use_rotary_position_embeddings``,
    ``add_position_embedding``)."""
    out = {f.metadata.get("megatron", f.name): getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig)
           if f.metadata.get("arch") and f.name not in ("vocab_size", "sliding_window", "window_layers")}
    out = {k: v for k, v in out.items() if k}  # (the fields no Megatron argument carries: "")
    window = None if cfg.sliding_window is None else (cfg.sliding_window - 1, 0)
    out.update(use_rope_scaling=cfg.rope_scaling_type == "llama3",
               rope_scaling_factor=cfg.rope_scaling_factor if cfg.rope_scaling_type == "llama3" else 8.0)
    out.update(kv_channels=cfg.head_dim, window_size=window, window_attn_skip_freq=cfg.window_layers,
               layernorm_epsilon=cfg.layernorm_epsilon, num_query_groups=cfg.kv_groups,
               use_rotary_position_embeddings=cfg.position_embedding_type == "rope",
               add_position_embedding=cfg.position_embedding_type == "learned_absolute",
               moe_layer_freq=cfg.moe_layer_freq if cfg.moe_layer_freq and len(cfg.moe_layer_freq) > 1 else
               (cfg.moe_layer_freq or [1])[0])
    return out


def args_for(cfg: GPTConfig, tp: int, pp: int, iteration: int, consumed_samples: int = 0,
             fmt: str = "torch_dist", params_dtype=None, tokenizer: Optional[dict] = None,
             ep: int = 1, grouped_gemm: bool = False) -> argparse.Namespace:
    """The ``args`` a Megatron-LM run needs to rebuild ``cfg`` at TP ``tp`` x PP ``pp`` (what
    ``--use-checkpoint-args`` reads and ``check_checkpoint_args`` compares); ``tokenizer``: the tnlg
    checkpoint's recorded one, named in Megatron's tokenizer arguments; ``ep``: the experts' split over EP
    (``expert_model_parallel_size``); ``grouped_gemm``: the experts in the legacy ``GroupedMLP``'s layout
    (``moe_grouped_gemm`` and ``moe_use_legacy_grouped_gemm``, which a MoE run is then built with)."""
    import torch
    check_megatron_expressible(cfg)
    divisible = cfg.make_vocab_size_divisible_by
    return argparse.Namespace(**_tokenizer_args(tokenizer), **_declared_args(cfg), **dict(
        seq_length=cfg.seq_length, apply_layernorm_1p=False, squared_relu=False,
        vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=divisible,
        padded_vocab_size=padded_vocab_size(cfg.vocab_size, tp, divisible),
        init_method_std=cfg.init_method_std, seed=cfg.seed,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, expert_model_parallel_size=ep, context_parallel_size=1,
        iteration=iteration, consumed_train_samples=consumed_samples, consumed_valid_samples=0,
        ckpt_format=fmt, use_dist_ckpt=fmt == "torch_dist", params_dtype=params_dtype or torch.float32,
        fp16=params_dtype == torch.float16, bf16=params_dtype == torch.bfloat16,
        **(dict(moe_grouped_gemm=grouped_gemm, moe_use_legacy_grouped_gemm=grouped_gemm) if cfg.num_experts else {})))
