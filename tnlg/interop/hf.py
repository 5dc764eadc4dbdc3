"""Hugging Face interop: ``GPT2LMHeadModel``, ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` <-> tnlg
full state dicts, and exported folders. ``config.json``'s ``model_type`` picks the class read; the
architecture picks the class written (:func:`tnlg.interop.hf_llama.hf_kind`); any other ``model_type`` is
refused in one paragraph (:func:`check_model_type`). The Llama family's layouts: :mod:`tnlg.interop.hf_llama`.

Differences handled here: GPT-2 stores linear weights as ``Conv1D`` (``[in, out]``,
transposed) and its fused QKV as ``[q | k | v]`` over all heads, where tnlg lays
QKV out per head (``[head][q, k, v][head_dim]``) so a contiguous TP split gives
whole heads. No network access: give a model object or a local folder.

An exported folder (:func:`write_hf_folder`, behind :func:`to_hf` and ``tnlg convert
--to hf``) is written under a temporary name beside the destination and renamed into
place; a destination that exists and is not empty is refused, never deleted. With a
tokenizer it also carries ``tokenizer.json`` + ``tokenizer_config.json`` +
``special_tokens_map.json`` (:func:`tnlg.data.hf_tokenizer.hf_tokenizer_files`), which encode every text to the
ids tnlg's tokenizer gives, with the end-of-document token as ``bos``/``eos`` (docs/hf.md).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from ..config import GPTConfig
from ..data.hf_tokenizer import hf_tokenizer_files
from ..data.tokenizer import load_tokenizer
from ..errors import UserError
from ..io import fsync_dir, give_umask_mode, temporary_name
from ..model.inference import inference_model
from ..parallel.sharding import full_state_dict, load_full_state_dict
from ..parallel.state import ParallelState
from .hf_llama import LLAMA_TYPES, config_from_llama, hf_kind, llama_config_from, llama_to_tnlg, tnlg_to_llama

__all__ = ["from_hf", "to_hf", "config_from_hf", "check_model_type", "hf_folder_type", "hf_config_from", "hf_to_tnlg_state_dict", "tnlg_to_hf_state_dict",
           "build_hf_model", "write_hf_folder"]

_TANH_GELU, _EXACT_GELU = ("gelu_new", "gelu_pytorch_tanh"), ("gelu",)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def check_model_type(model_type, where: str) -> str:
    """``model_type`` when tnlg reads it (``gpt2``, ``llama``, ``qwen2``), else one :class:`UserError`."""
    if model_type not in _CLASSES:
        raise UserError(f"{where} is a Hugging Face {model_type!r} model (config.json's model_type); tnlg reads "
                        "and writes GPT2LMHeadModel (model_type 'gpt2'), LlamaForCausalLM ('llama') and "
                        "Qwen2ForCausalLM ('qwen2', Llama with QKV biases) folders. Nothing was loaded or written.")
    return model_type


def hf_folder_type(folder: str) -> str:
    """The checked ``model_type`` of a ``save_pretrained`` folder's ``config.json``."""
    import json
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"Hugging Face folder {folder!r}: {path!r} cannot be read as JSON ({exc}).") from None
    return check_model_type(model_type, f"Hugging Face folder {folder!r}")


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    """The :class:`GPTConfig` of a GPT-2, Llama or Qwen2 config (``model_type`` picks)."""
    kind = check_model_type(getattr(hf_config, "model_type", None), "the model")
    if kind in LLAMA_TYPES:
        return config_from_llama(hf_config, **overrides)
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
                  vocab_size=hf_config.vocab_size, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                  hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                  layernorm_epsilon=hf_config.layer_norm_epsilon, init_method_std=hf_config.initializer_range)
    fields.update(overrides)
    return GPTConfig(**fields)


def hf_config_from(cfg: GPTConfig, eod_id: Optional[int] = None):
    """The Hugging Face config of ``cfg``'s class (GPT-2, Llama or Qwen2: :func:`~.hf_llama.hf_kind`);
    ``bos``/``eos`` are the end-of-document id (GPT-2 uses ``<|endoftext|>`` for both), or unset without
    a tokenizer (GPT-2's default 50256 is outside most tnlg vocabularies)."""
    kind = hf_kind(cfg)
    if kind != "gpt2":
        return llama_config_from(cfg, kind, eod_id)
    from transformers import GPT2Config
    return GPT2Config(bos_token_id=eod_id, eos_token_id=eod_id,
                      n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
                      n_positions=cfg.seq_length, vocab_size=cfg.vocab_size, n_inner=cfg.ffn_hidden_size,
                      resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
                      attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
                      initializer_range=cfg.init_method_std,
                      activation_function=_TANH_GELU[0] if cfg.openai_gelu else _EXACT_GELU[0],
                      tie_word_embeddings=not cfg.untie_embeddings_and_output_weights)


def _qkv_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[3h, ...]`` rows in ``[q|k|v]`` order -> per-head ``[head][q,k,v][hd]`` order."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_from_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def hf_to_tnlg_state_dict(hf_sd: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    if hf_kind(cfg) != "gpt2":
        return llama_to_tnlg(hf_sd, cfg)
    out = {}
    for name, t in hf_sd.items():
        if name == "lm_head.weight" and cfg.untie_embeddings_and_output_weights:
            out[name] = t.detach().float().contiguous()
            continue
        if not name.startswith("transformer.") or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # a tied lm_head is wte; attn.bias is GPT-2's causal-mask buffer
        t = t.detach().float()
        if name.endswith(_CONV1D):
            t = t.t()
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            t = _qkv_to_per_head(t, cfg.num_attention_heads)
        out[name] = t.contiguous()
    return out


def tnlg_to_hf_state_dict(full: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    if hf_kind(cfg) != "gpt2":
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


def _load_hf_model(model_or_dir):
    if isinstance(model_or_dir, (str, os.PathLike)):
        if not os.path.isdir(model_or_dir):
            raise UserError(f"Hugging Face model folder {str(model_or_dir)!r} does not exist; give a folder "
                            f"written by save_pretrained (config.json + model.safetensors).")
        import transformers
        cls = getattr(transformers, _CLASSES[hf_folder_type(os.fspath(model_or_dir))])
        return cls.from_pretrained(model_or_dir, local_files_only=True)
    check_model_type(getattr(model_or_dir.config, "model_type", None), "the model")
    return model_or_dir


def from_hf(model_or_dir, ps: Optional[ParallelState] = None, **overrides):
    """A TP-sharded :class:`tnlg.GPT` with the weights of a GPT-2 model or folder (``overrides``: other
    :class:`~tnlg.config.GPTConfig` fields); at ``ps.pp_size > 1`` this pipeline stage's
    :class:`~tnlg.model.stage.StageModel` (its layers, by the GPT's names). Each rank keeps its
    slice; no communication."""
    ps = ps or ParallelState.single()
    hf = _load_hf_model(model_or_dir)
    cfg = config_from_hf(hf.config, **overrides)
    model = inference_model(cfg, ps)
    full = hf_to_tnlg_state_dict(hf.state_dict(), cfg)
    if ps.pp_size > 1:  # this stage's parameters only (a name the stage lacks is still a mismatch)
        full = {name: full[name] for name, _ in model.named_parameters() if name in full}
    load_full_state_dict(model, full, ps)
    return model


def build_hf_model(full: dict, cfg: GPTConfig, eod_id: Optional[int] = None, where: str = "the model"):
    """The Hugging Face model of ``cfg``'s class (``GPT2LMHeadModel``, ``LlamaForCausalLM`` or
    ``Qwen2ForCausalLM``) holding the tnlg full state dict ``full``."""
    import transformers
    kind = hf_kind(cfg)
    hf = getattr(transformers, _CLASSES[kind])(hf_config_from(cfg, eod_id))
    missing, unexpected = hf.load_state_dict(tnlg_to_hf_state_dict(full, cfg), strict=False)
    missing = [m for m in missing if not m.endswith((".attn.bias", ".attn.masked_bias"))]
    if kind != "gpt2" and not cfg.untie_embeddings_and_output_weights:
        missing = [m for m in missing if m != "lm_head.weight"]  # tied: the embedding
    if missing or unexpected:
        raise UserError(f"{where} does not map onto {_CLASSES[kind]}: missing {missing[:4]}, unexpected "
                        f"{unexpected[:4]}.")
    return hf


def to_hf(model, out_dir: Optional[str] = None, tokenizer=None):
    """Gather a tnlg model into a ``GPT2LMHeadModel`` (collective over TP); optionally write it
    to the new folder ``out_dir`` from the first rank only (:func:`write_hf_folder`: safetensors,
    and the tokenizer files when ``tokenizer`` is given - a :class:`tnlg.data.tokenizer.Tokenizer`
    or anything :func:`~tnlg.data.tokenizer.load_tokenizer` takes). An ``out_dir`` that exists
    and is not empty is refused with a :class:`UserError` (after the gather, on the first rank)."""
    tok = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        _check_fits(tok, model.config)
    full = full_state_dict(model, model.ps)
    hf = build_hf_model(full, model.config, None if tok is None else tok.eod_id)
    if out_dir is not None and model.ps.rank == 0:
        write_hf_folder(hf, out_dir, tok)
    return hf


def _check_fits(tok, cfg: GPTConfig) -> None:
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer {tok!r} has {tok.vocab_size} tokens but the model only {cfg.vocab_size}: "
                        "it is not this model's tokenizer.")


# --------------------------------------------------------------------------- folders

def _not_empty(out: str) -> UserError:
    return UserError(f"Hugging Face folder {out!r} already exists and is not empty; choose a new folder or empty "
                     "it first (an export never deletes or overwrites files it did not write).")


def write_hf_folder(hf, out_dir: str, tokenizer=None) -> str:
    """``save_pretrained(hf)`` (safetensors) plus, with ``tokenizer`` (a tnlg tokenizer or the
    dict of :func:`tnlg.data.hf_tokenizer.hf_tokenizer_files`), the tokenizer files, into the new folder ``out_dir``.

    Everything is written to ``<out_dir>.tmp-<pid>`` beside it, then renamed to ``out_dir``,
    so the folder appears complete or not at all. ``out_dir`` must not exist or be an empty
    folder (the rename replaces only an empty one); a failed write removes only the temporary
    folder this call created. Returns the absolute path.
    """
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise _not_empty(out)
    files = tokenizer
    if tokenizer is not None and not isinstance(tokenizer, dict):
        files = hf_tokenizer_files(tokenizer, getattr(hf.config, "n_positions", None)
                                   or hf.config.max_position_embeddings)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = temporary_name(out)
    try:
        os.mkdir(tmp)
    except FileExistsError:  # not created by this call, so not ours to reuse or remove
        raise UserError(f"temporary folder {tmp!r} already exists (left by an interrupted export?); remove it "
                        "and export again.") from None
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        for name, data in (files or {}).items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        give_umask_mode(tmp)  # save_pretrained leaves model.safetensors at mkstemp's 0600
        try:
            os.replace(tmp, out)  # POSIX rename: replaces an empty folder, refuses a non-empty one
        except OSError:
            if os.path.isdir(out) and not os.listdir(out):
                os.rmdir(out)
                os.replace(tmp, out)
            else:
                raise _not_empty(out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the temporary folder created above, nothing else
        raise
    fsync_dir(os.path.dirname(out))
    return out
