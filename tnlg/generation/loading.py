"""What evaluation and generation share: models and tokenizers from checkpoints.

* :func:`load_model` - a Hugging Face GPT-2 folder (``config.json`` + weights, loaded
  with :func:`tnlg.interop.hf.from_hf`) or a tnlg checkpoint (through
  ``tnlg.checkpoint.load_for_inference``), sharded for this rank's TP layout; at ``--pp P``
  this stage's layers only (:func:`tnlg.model.inference.inference_model`).
* :func:`resolve_tokenizer` - ``--tokenizer-model`` wins; else the checkpoint's.
* :func:`precheck_checkpoint`, :func:`checkpoint_seq_length`, :func:`checkpoint_num_layers` - what the
  launching process checks from the checkpoint's metadata before any worker starts.

Starting the processes is the commands' part (:mod:`tnlg.commands.inference`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..checkpoint import load_for_inference, resolve
from ..checkpoint.manifest import Manifest
from ..data.tokenizer import load_tokenizer
from ..errors import UserError
from ..interop.hf import from_hf, hf_folder_type
from ..parallel.state import ParallelState

__all__ = ["is_hf_folder", "hf_tokenizer_spec", "checkpoint_seq_length", "checkpoint_num_layers", "load_model", "load",
           "resolve_tokenizer", "precheck_checkpoint", "check_tokenizer_fits"]

_NO_TOKENIZER = ("no tokenizer: checkpoint {ckpt!r} does not name one{why}, and --tokenizer-model was not "
                 "given. Pass --tokenizer-model with a SentencePiece .model file, a folder holding GPT-2's "
                 "vocab.json + merges.txt, or 'builtin'.")


def is_hf_folder(path: str) -> bool:
    """A folder written by ``save_pretrained`` (it holds ``config.json``)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def hf_tokenizer_spec(path: str) -> Optional[str]:
    """The folder itself when it holds GPT-2's ``vocab.json`` + ``merges.txt``, else ``None``."""
    has = all(os.path.isfile(os.path.join(path, f)) for f in ("vocab.json", "merges.txt"))
    return path if has else None


def precheck_checkpoint(checkpoint: str, tokenizer_model: Optional[str], needs_tokenizer: bool = True):
    """Checks that need no model, run before any process starts: the checkpoint exists and
    (``needs_tokenizer``) a tokenizer can be found. Returns the loaded ``--tokenizer-model``
    tokenizer, or ``None``."""
    if not os.path.exists(checkpoint):
        raise UserError(f"checkpoint {checkpoint!r} does not exist; pass a Hugging Face GPT-2, Llama or Qwen2 folder "
                        "(config.json + model.safetensors) or a folder written by `tnlg pretrain --save`.")
    if is_hf_folder(checkpoint):
        hf_folder_type(checkpoint)  # a model_type tnlg reads (gpt2, llama, qwen2), or one paragraph
    if tokenizer_model:
        return load_tokenizer(tokenizer_model)
    if needs_tokenizer and is_hf_folder(checkpoint) and hf_tokenizer_spec(checkpoint) is None:
        raise UserError(_NO_TOKENIZER.format(ckpt=checkpoint, why=" (a Hugging Face folder needs vocab.json "
                                                                   "+ merges.txt beside config.json)"))
    return None


def checkpoint_seq_length(checkpoint: str) -> Optional[int]:
    """The model's ``seq_length`` read from the checkpoint's metadata (no weights), or ``None``."""
    return _checkpoint_size(checkpoint, ("n_positions", "max_position_embeddings"), "seq_length")


def checkpoint_num_layers(checkpoint: str) -> Optional[int]:
    """The model's layer count read from the checkpoint's metadata (no weights), or ``None``."""
    return _checkpoint_size(checkpoint, ("n_layer", "num_hidden_layers"), "num_layers")


def _checkpoint_size(checkpoint: str, hf_keys: tuple, key: str) -> Optional[int]:
    try:
        if is_hf_folder(checkpoint):
            with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            return int(next(config[k] for k in hf_keys if k in config))
        return int(Manifest.read(resolve(checkpoint, "checkpoint")).config[key])
    except Exception:  # noqa: BLE001 - best effort: the workers check again with the model
        return None


def load_model(checkpoint: str, ps: ParallelState, tokenizer_model=None):
    """``(model, tokenizer or its spec, or None)``: the checkpoint's model sharded for ``ps``, in
    eval mode, and the tokenizer it names (``tokenizer_model`` replaces a tnlg checkpoint's
    recorded one, which then need not exist any more). A Hugging Face folder: no collectives
    (every rank reads its own shard); a tnlg checkpoint: the ranks agree on the iteration and on
    the outcome of the checks (:func:`tnlg.checkpoint.load_for_inference`).
    """
    if is_hf_folder(checkpoint):
        model, spec = from_hf(checkpoint, ps), hf_tokenizer_spec(checkpoint)
    else:
        model, spec = load_for_inference(checkpoint, ps, tokenizer_override=tokenizer_model)
    model.eval()
    return model, spec


def load(checkpoint: str, ps: ParallelState | None = None):
    """The model of a tnlg checkpoint folder or a Hugging Face GPT-2 folder, sharded for ``ps`` (one
    process, :meth:`ParallelState.single`, when None), in eval mode: ``model(tokens)`` gives this rank's
    vocabulary shard of the logits ``[b, s, vocab / tp]``, :func:`tnlg.gather_logits` the full ones.
    Collectives: as :func:`load_model` (none for a Hugging Face folder)."""
    return load_model(checkpoint, ParallelState.single() if ps is None else ps)[0]


def resolve_tokenizer(tokenizer_model, spec, checkpoint: str):
    """``--tokenizer-model`` (a path or an already loaded tokenizer) wins; else the checkpoint's spec."""
    if tokenizer_model is not None:
        return load_tokenizer(tokenizer_model)
    if spec is None:
        why = " (a Hugging Face folder needs vocab.json + merges.txt)" if is_hf_folder(checkpoint) else ""
        raise UserError(_NO_TOKENIZER.format(ckpt=checkpoint, why=why))
    return load_tokenizer(spec)


def check_tokenizer_fits(tokenizer, model) -> None:
    """Every token id of the tokenizer must be a row of the model's embedding."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.config.vocab_size}: it was trained with another tokenizer. Pass the "
                        "model's own tokenizer with --tokenizer-model.")
