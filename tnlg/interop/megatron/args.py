"""Megatron-LM's saved ``args`` <-> :class:`tnlg.config.GPTConfig`.

A Megatron checkpoint carries the ``argparse.Namespace`` of the run that wrote it (``args``);
the architecture comes from there (argument names of ``megatron/training/arguments.py``):
``num_layers``, ``hidden_size``, ``num_attention_heads``, ``ffn_hidden_size``,
``max_position_embeddings`` (the learned positions: tnlg's ``seq_length``), ``padded_vocab_size``
and ``make_vocab_size_divisible_by``, ``layernorm_epsilon``, ``openai_gelu`` and
``untie_embeddings_and_output_weights``. Arguments that describe an architecture tnlg does not
model (rotary positions, SwiGLU, RMSNorm, grouped-query attention, experts, ...) are refused,
one clear error naming the argument.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from ...config import GPTConfig, padded_vocab_size
from ...errors import UserError
from .safe_load import shown

__all__ = ["MegatronLayout", "check_sizes", "or_default", "whole", "check_supported", "known_vocab_size", "layout_of",
           "config_from_args", "args_for"]

# (argument, the value tnlg models, what the argument selects otherwise); a missing argument has
# Megatron-LM's default, which is the supported value
_MUST_BE = (
    ("position_embedding_type", "learned_absolute", "rotary or other position embeddings"),
    ("use_rotary_position_embeddings", False, "rotary position embeddings"),
    ("swiglu", False, "a SwiGLU MLP"),
    ("squared_relu", False, "a squared-ReLU MLP"),
    ("normalization", "LayerNorm", "another normalisation than LayerNorm"),
    ("apply_layernorm_1p", False, "LayerNorm weights stored as weight - 1 (layernorm 1p)"),
    ("group_query_attention", False, "grouped-query attention"),
    ("multi_latent_attention", False, "multi-latent attention"),
    ("num_experts", None, "a mixture of experts"),
    ("add_bias_linear", True, "linear layers without biases"),
    ("qk_layernorm", False, "LayerNorms on queries and keys"),
    ("apply_residual_connection_post_layernorm", False, "the residual taken after the LayerNorm"),
    ("add_position_embedding", True, "no position embedding"),
    ("num_layers_per_virtual_pipeline_stage", None, "an interleaved (virtual) pipeline schedule's layout"),
    ("virtual_pipeline_model_parallel_size", None, "an interleaved (virtual) pipeline schedule's layout"),
    ("decoder_first_pipeline_num_layers", None, "an uneven pipeline split"),
    ("decoder_last_pipeline_num_layers", None, "an uneven pipeline split"),
    ("account_for_embedding_in_pipeline_split", False, "an uneven pipeline split"),
    ("account_for_loss_in_pipeline_split", False, "an uneven pipeline split"),
    ("context_parallel_size", 1, "context parallelism"),
    ("expert_model_parallel_size", 1, "expert parallelism"),
    ("mtp_num_layers", None, "multi-token prediction layers"),
)

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
    for name, supported, what in _MUST_BE:
        value = _plain(args, name, where)  # None: not set (an older Megatron), so its default
        if value is not None and value != supported and not (supported is None and value == 0):
            raise UserError(f"{where}: the checkpoint's args set {name}={shown(value)}, {what}, which tnlg does not "
                            "model "
                            f"(it supports {name}={supported!r}: a GPT-2-style model with learned positions, "
                            "LayerNorm, GELU and biases). Nothing was written.")
    kv = _arg(args, "kv_channels")
    heads, hidden = _required(args, "num_attention_heads", where), _required(args, "hidden_size", where)
    if kv is not None and kv * heads != hidden:
        raise UserError(f"{where}: the checkpoint's args set kv_channels={kv} with {heads} heads, so the attention "
                        f"width {kv * heads} differs from hidden_size={hidden}; tnlg needs kv_channels = hidden_size / "
                        "num_attention_heads. Nothing was written.")
    if _arg(args, "num_query_groups") not in (None, heads) and _plain(args, "group_query_attention", where):
        raise UserError(f"{where}: num_query_groups={args.num_query_groups}: grouped-query attention is not "
                        "modelled by tnlg. Nothing was written.")


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
    return MegatronLayout(tp, pp, padded, iteration, float(version))


def config_from_args(args, where: str, vocab_size: Optional[int] = None) -> GPTConfig:
    """The :class:`GPTConfig` of a Megatron run's ``args``; ``vocab_size``: the tokenizer's real size
    (default: :func:`known_vocab_size`, else the padded size, whose extra rows then stay logits)."""
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{where}: the checkpoint's 'args' is a {type(args).__name__}, not Megatron-LM's "
                        "argparse.Namespace. Nothing was written.")
    check_sizes(args, where)
    check_supported(args, where)
    hidden = int(_required(args, "hidden_size", where))
    padded = int(_required(args, "padded_vocab_size", where))
    vocab = vocab_size or known_vocab_size(args) or padded
    if vocab > padded:
        raise UserError(f"{where}: the tokenizer has {vocab} tokens but the checkpoint's embedding only "
                        f"{padded} rows (padded_vocab_size); it is not this model's tokenizer. Nothing was written.")
    try:
        return GPTConfig(
            num_layers=int(_required(args, "num_layers", where)), hidden_size=hidden,
            num_attention_heads=int(_required(args, "num_attention_heads", where)),
            seq_length=int(_arg(args, "max_position_embeddings") or _required(args, "seq_length", where)),
            vocab_size=int(vocab), ffn_hidden_size=int(_arg(args, "ffn_hidden_size") or 4 * hidden),
            hidden_dropout=float(_arg(args, "hidden_dropout", 0.1)),
            attention_dropout=float(_arg(args, "attention_dropout", 0.1)),
            init_method_std=float(_arg(args, "init_method_std", 0.02)),
            layernorm_epsilon=float(_arg(args, "layernorm_epsilon", 1e-5)),
            make_vocab_size_divisible_by=int(_arg(args, "make_vocab_size_divisible_by", 128)),
            seed=int(_arg(args, "seed", 1234)), openai_gelu=bool(_arg(args, "openai_gelu", False)),
            untie_embeddings_and_output_weights=bool(_arg(args, "untie_embeddings_and_output_weights", False)))
    except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
        raise UserError(f"{where}: the saved args do not describe a valid model: {str(exc)[:300]} Nothing was "
                        "written.") from None


def _tokenizer_args(tokenizer: Optional[dict]) -> dict:
    """Megatron's tokenizer arguments for a tnlg checkpoint's recorded tokenizer (``describe()``)."""
    if not tokenizer:
        return dict(tokenizer_type=None)
    if tokenizer.get("kind") == "gpt2bpe":
        return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=tokenizer.get("vocab_file"),
                    merge_file=tokenizer.get("merges_file"))
    return dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=tokenizer.get("path"))


# the GPTConfig fields whose non-default values (the Llama family's) Megatron conversion does not carry yet
_NOT_CARRIED = ("position_embedding_type", "rotary_base", "rotary_percent", "normalization", "swiglu",
                "group_query_attention", "num_query_groups", "add_bias_linear", "add_qkv_bias")


def _check_exportable(cfg: GPTConfig) -> None:
    """One :class:`UserError` naming the architecture fields a Megatron export would lose."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    set_ = [f"{n}={getattr(cfg, n)!r}" for n in _NOT_CARRIED if getattr(cfg, n) != defaults[n]]
    if set_:
        raise UserError(f"the checkpoint's model sets {', '.join(set_)}; tnlg's Megatron export carries GPT-2-style "
                        "models (learned positions, LayerNorm, GELU, full multi-head attention, biases) only, so "
                        "rope, RMSNorm, SwiGLU, grouped-query attention and bias-free models are not exported yet "
                        "(export them with --to hf instead). Nothing was written.")


def args_for(cfg: GPTConfig, tp: int, pp: int, iteration: int, consumed_samples: int = 0,
             fmt: str = "torch_dist", params_dtype=None, tokenizer: Optional[dict] = None) -> argparse.Namespace:
    """The ``args`` a Megatron-LM run needs to rebuild ``cfg`` at TP ``tp`` x PP ``pp`` (what
    ``--use-checkpoint-args`` reads and ``check_checkpoint_args`` compares); ``tokenizer``: the tnlg
    checkpoint's recorded one, named in Megatron's tokenizer arguments."""
    import torch
    _check_exportable(cfg)
    divisible = cfg.make_vocab_size_divisible_by
    return argparse.Namespace(**_tokenizer_args(tokenizer), **dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.head_dim, num_query_groups=cfg.num_attention_heads,
        group_query_attention=False, seq_length=cfg.seq_length, max_position_embeddings=cfg.seq_length,
        position_embedding_type="learned_absolute", add_position_embedding=True, use_rotary_position_embeddings=False,
        add_bias_linear=True, add_qkv_bias=True, swiglu=False, normalization="LayerNorm", apply_layernorm_1p=False,
        layernorm_epsilon=cfg.layernorm_epsilon, openai_gelu=cfg.openai_gelu, squared_relu=False,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=divisible,
        padded_vocab_size=padded_vocab_size(cfg.vocab_size, tp, divisible),
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std, seed=cfg.seed,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, expert_model_parallel_size=1, context_parallel_size=1,
        num_experts=None, iteration=iteration, consumed_train_samples=consumed_samples, consumed_valid_samples=0,
        ckpt_format=fmt, use_dist_ckpt=fmt == "torch_dist", params_dtype=params_dtype or torch.float32,
        fp16=params_dtype == torch.float16, bf16=params_dtype == torch.bfloat16))
