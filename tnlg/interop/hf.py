"""Hugging Face interop: models and folders of the families of :mod:`tnlg.interop.families`
(``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``Qwen3ForCausalLM``)
<-> tnlg models. Folders are read by :mod:`tnlg.interop.hf_reader` (exactly the model transformers
computes, or one paragraph); configs and state dicts are mapped by :mod:`tnlg.interop.hf_mapping` (GPT-2)
and :mod:`tnlg.interop.hf_llama` (re-exported here). No network access: give a model object or a local
folder.

An exported folder (:func:`write_hf_folder`, behind :func:`to_hf` and ``tnlg convert
--to hf``) is written under a temporary name beside the destination and renamed into
place; a destination that exists and is not empty is refused, never deleted. With a
tokenizer it also carries ``tokenizer.json`` + ``tokenizer_config.json`` +
``special_tokens_map.json`` (:func:`tnlg.data.hf_tokenizer.hf_tokenizer_files`), which encode every text to the
ids tnlg's tokenizer gives, with the end-of-document token as ``bos``/``eos`` (docs/hf.md).
"""

from __future__ import annotations

import dataclasses
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
from .families import family_named, family_of
from .hf_mapping import config_from_hf, hf_config_from, hf_to_tnlg_state_dict, tnlg_to_hf_state_dict
from .hf_reader import read_hf_folder

__all__ = ["from_hf", "to_hf", "config_from_hf", "hf_config_from", "hf_to_tnlg_state_dict", "tnlg_to_hf_state_dict",
           "build_hf_model", "write_hf_folder"]

def _hf_model_state(model) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """tnlg's config and full state dict of a ``transformers`` model object (its config checked as a
    folder's is); an ``lm_head`` unlike the embedding is read untied, whatever the config says."""
    cfg = config_from_hf(model.config)
    sd = model.state_dict()
    embed = family_named(model.config.model_type, "the model").embedding
    if (not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in sd
            and not torch.equal(sd["lm_head.weight"], sd[embed])):
        cfg = config_from_hf(model.config, untie_embeddings_and_output_weights=True)
    return cfg, hf_to_tnlg_state_dict(sd, cfg)


def from_hf(model_or_dir, ps: Optional[ParallelState] = None, **overrides):
    """A TP-sharded :class:`tnlg.GPT` with the weights of a model object or ``save_pretrained`` folder of a
    family tnlg reads (:data:`~.families.FAMILIES`) (read by :func:`tnlg.interop.hf_reader.read_hf_folder`:
    exactly the model transformers computes from it, or one paragraph); ``overrides``: other
    :class:`~tnlg.config.GPTConfig` fields (how it runs). At ``ps.pp_size > 1`` this pipeline stage's
    :class:`~tnlg.model.stage.StageModel` (its layers, by the GPT's names). Each rank keeps its
    slice; no communication."""
    ps = ps or ParallelState.single()
    if isinstance(model_or_dir, (str, os.PathLike)):
        cfg, full = read_hf_folder(os.fspath(model_or_dir))
    else:
        cfg, full = _hf_model_state(model_or_dir)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    model = inference_model(cfg, ps)
    if ps.pp_size > 1:  # this stage's parameters only (a name the stage lacks is still a mismatch)
        full = {name: full[name] for name, _ in model.named_parameters() if name in full}
    load_full_state_dict(model, full, ps)
    return model


def build_hf_model(full: dict, cfg: GPTConfig, eod_id: Optional[int] = None, where: str = "the model",
                   family: Optional[str] = None):
    """The Hugging Face model of ``cfg``'s class holding the tnlg full state dict ``full``: the class of the
    family ``family`` (a ``model_type``: the one a checkpoint was converted from) where it computes ``cfg``,
    else the first family's that does (:func:`~.families.family_of`)."""
    import transformers
    chosen = family_of(cfg, family)
    hf = getattr(transformers, chosen.model_class)(hf_config_from(cfg, eod_id, chosen))
    missing, unexpected = hf.load_state_dict(tnlg_to_hf_state_dict(full, cfg), strict=False)
    missing = [m for m in missing if not m.endswith((".attn.bias", ".attn.masked_bias"))]
    if chosen.layout == "llama" and not cfg.untie_embeddings_and_output_weights:
        missing = [m for m in missing if m != "lm_head.weight"]  # tied: the embedding
    if missing or unexpected:
        raise UserError(f"{where} does not map onto {chosen.model_class}: missing {missing[:4]}, unexpected "
                        f"{unexpected[:4]}.")
    return hf


def to_hf(model, out_dir: Optional[str] = None, tokenizer=None):
    """Gather a tnlg model into a Hugging Face model of its class (:func:`build_hf_model`; collective over TP); optionally write it
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
