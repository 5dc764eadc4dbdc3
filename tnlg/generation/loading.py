"""What evaluation and generation share: models and tokenizers from checkpoints.

* :func:`load_model` - a Hugging Face GPT-2 folder (``config.json`` + weights, loaded
  with :func:`tnlg.interop.hf.from_hf`) or a tnlg checkpoint (through
  :func:`load_for_inference`), sharded for this rank's TP layout; at ``--pp P``
  this stage's layers only (:func:`tnlg.model.inference.inference_model`). With ``adapter``
  (``--load-adapter``): PEFT's LoRA folder merged into the weights at load, each rank its shard
  (:func:`tnlg.interop.peft.merge_peft_adapter`).
* :func:`load_for_inference` - a tnlg checkpoint's model built at this rank's TP size (and pipeline stage), its
  weights read by :func:`tnlg.checkpoint.inference_plan` / :func:`~tnlg.checkpoint.read_weights`.
* :func:`resolve_tokenizer` - ``--tokenizer-model`` wins; else the checkpoint's.
* :func:`precheck_checkpoint` (a ``--tokenizer-model`` against the model's own tokenizer too: a checkpoint's
  record, a Hugging Face folder's files, :func:`model_tokenizers`, :func:`tnlg.data.fingerprint.check_recorded`), :func:`checkpoint_seq_length`, :func:`checkpoint_num_layers` - what the
  launching process checks from the checkpoint's metadata before any worker starts.

Starting the processes is the commands' part (:mod:`tnlg.commands.inference`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from ..checkpoint import inference_plan, read_weights, resolve
from ..checkpoint.manifest import Manifest
from ..config import GPTConfig
from ..data.fingerprint import ALLOW_FLAG, check_recorded
from ..data.tokenizer import folder_tokenizers, holds_tokenizer, load_tokenizer
from ..errors import UserError
from ..interop.hf import from_hf
from ..interop.hf_reader import check_hf_folder
from ..interop.peft import merge_peft_adapter
from ..model import GPT
from ..model.inference import inference_model
from ..parallel.state import ParallelState

__all__ = ["load_for_inference", "is_hf_folder", "hf_tokenizer_spec", "recorded_tokenizer", "loading_note",
           "checkpoint_seq_length", "checkpoint_num_layers", "load_model", "load", "check_adapter_folder",
           "resolve_tokenizer", "precheck_checkpoint", "model_tokenizers", "check_tokenizer_fits"]

_NO_TOKENIZER = ("no tokenizer: checkpoint {ckpt!r} does not name one{why}, and --tokenizer-model was not "
                 "given. Pass --tokenizer-model with a SentencePiece .model file, a tokenizer.json, a folder "
                 "holding GPT-2's vocab.json + merges.txt, or 'builtin'.")


def load_for_inference(path: str, ps: Optional[ParallelState] = None, tokenizer_override=None):
    """``(model, tokenizer or None)``: a :class:`tnlg.GPT` built at this TP size (``ps``, default one
    process) with the checkpoint's weights, in eval mode; at ``ps.pp_size > 1`` this pipeline stage's
    :class:`~tnlg.model.stage.StageModel` (its layers, loaded by the GPT's names).

    ``path`` is a checkpoint root (its ``latest`` iteration, else the newest complete one) or an
    ``iter_*`` directory. The tokenizer is ``tokenizer_override`` (a path or tokenizer) if given, else
    the one recorded in the checkpoint (its files must be unchanged), else ``None``.

    Collective, as :func:`tnlg.checkpoint.load`: rank 0 chooses the iteration and every rank checks it sees the
    same manifest (one broadcast, one all_gather_object); every rank verifies the files it reads, and a
    failure on any rank is raised on every rank (one all_gather_object). Then every rank reads its
    own slices.
    """
    ps = ps or ParallelState.single()
    tp_size = ps.tp_size
    plan = inference_plan(path, ps, lambda cfg: GPT.describe(cfg, tp_size), tokenizer_override)
    model = inference_model(plan.config, ps)  # at PP > 1 this stage's layers, under the GPT's names
    read_weights(plan, model)
    model.eval()
    return model, plan.tokenizer


def is_hf_folder(path: str) -> bool:
    """A folder written by ``save_pretrained`` (it holds ``config.json``)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def hf_tokenizer_spec(path: str) -> Optional[str]:
    """The folder itself when it holds a tokenizer's files (GPT-2's ``vocab.json`` + ``merges.txt``, one
    SentencePiece ``.model``, or a ``tokenizer.json``: :func:`tnlg.data.tokenizer.holds_tokenizer`), else ``None``."""
    return path if holds_tokenizer(path) else None


def precheck_checkpoint(checkpoint: str, tokenizer_model: Optional[str], needs_tokenizer: bool = True,
                        adapter: Optional[str] = None, allow_other_tokenizer: bool = False,
                        notes: Optional[list] = None):
    """Checks that need no model, run before any process starts: the checkpoint exists, a Hugging Face
    folder is one tnlg reads exactly (:func:`tnlg.interop.hf_reader.check_hf_folder`), an ``adapter`` folder
    (``--load-adapter``) fits the checkpoint's model (:func:`tnlg.interop.peft.check_adapter_fits`: its
    metadata, no weights), and (``needs_tokenizer``) a tokenizer can be found. A ``--tokenizer-model`` that is
    not the model's own (:func:`model_tokenizers`) is refused in one paragraph, or with
    ``allow_other_tokenizer`` noted (the line appended to ``notes``). Returns the loaded ``--tokenizer-model``
    tokenizer, or ``None``."""
    if not os.path.exists(checkpoint):
        raise UserError(f"checkpoint {checkpoint!r} does not exist; pass a Hugging Face GPT-2, Llama, Qwen2, Mistral or Qwen3 folder "
                        "(config.json + model.safetensors) or a folder written by `tnlg pretrain --save`.")
    if allow_other_tokenizer and not tokenizer_model:
        raise UserError(f"{ALLOW_FLAG} goes with --tokenizer-model (the other tokenizer to use); without it the "
                        f"checkpoint's own tokenizer is used. Drop {ALLOW_FLAG}, or name the tokenizer.")
    cfg = None
    if is_hf_folder(checkpoint):  # config.json and the weight files' headers: exactly what transformers
        cfg = check_hf_folder(checkpoint).cfg  # computes, or one paragraph (no tensor data read, no worker started)
    if adapter is not None:
        check_adapter_folder(checkpoint, adapter, cfg)
    if tokenizer_model:
        tokenizer = load_tokenizer(tokenizer_model)
        own, whose = model_tokenizers(checkpoint)
        note = check_recorded(own, tokenizer, f"checkpoint {checkpoint!r}", allow=allow_other_tokenizer, whose=whose)
        if note and notes is not None:
            notes.append(note)
        return tokenizer
    if needs_tokenizer and is_hf_folder(checkpoint) and hf_tokenizer_spec(checkpoint) is None:
        raise UserError(_NO_TOKENIZER.format(ckpt=checkpoint, why=" (a Hugging Face folder needs vocab.json "
                                                                   "+ merges.txt, one .model file or a tokenizer.json "
                                                                   "beside config.json)"))
    return None


def model_tokenizers(checkpoint: str) -> tuple[list[dict], str]:
    """The model's own tokenizer, as :meth:`~tnlg.data.tokenizer.Tokenizer.describe` records, and where they
    come from in words: a Hugging Face folder's tokenizer files (each form tnlg reads,
    :func:`~tnlg.data.tokenizer.folder_tokenizers`), or a tnlg checkpoint's record (:func:`recorded_tokenizer`);
    ``[]`` when there is none to compare with."""
    if is_hf_folder(checkpoint):
        return [t.describe() for t in folder_tokenizers(checkpoint)], "its tokenizer files"
    recorded = recorded_tokenizer(checkpoint)
    return ([recorded] if recorded else []), "recorded in the checkpoint"


def check_adapter_folder(checkpoint: str, adapter: str, cfg: Optional[GPTConfig] = None) -> None:
    """``--load-adapter`` names PEFT's LoRA folder of the checkpoint's model (``cfg``: the model's config when
    already read); one paragraph otherwise. A tnlg checkpoint whose metadata cannot be read here is left to the
    workers (which check again with the model)."""
    from ..interop.peft import CONFIG_NAME, WEIGHTS_NAME, check_adapter_fits
    if not os.path.isdir(adapter):
        raise UserError(f"--load-adapter {adapter!r} is not a folder; pass PEFT's adapter folder ({CONFIG_NAME} + "
                        f"{WEIGHTS_NAME}: peft's save_pretrained, or SAVE/adapter of `tnlg finetune --lora-rank`).")
    recorded = None
    if cfg is None:
        try:
            iter_dir = resolve(checkpoint, "checkpoint")
            manifest = Manifest.read(iter_dir) if iter_dir is not None else None
        except (UserError, OSError, ValueError):
            manifest = None
        if manifest is None or manifest.config is None:
            return
        cfg = GPTConfig.from_dict(manifest.config)
        recorded = (manifest.converted_from or {}).get("model_type")
    check_adapter_fits(cfg, adapter, recorded if isinstance(recorded, str) else None)


def recorded_tokenizer(checkpoint: str) -> Optional[dict]:
    """The tokenizer a tnlg checkpoint was trained with, its ``meta.json`` record (a :meth:`Tokenizer.describe`;
    no model read); ``None`` for a Hugging Face folder (whose tokenizer files are a default, which
    ``--tokenizer-model`` may replace), a checkpoint that records none, or metadata that cannot be read here
    (the workers report that)."""
    if is_hf_folder(checkpoint):
        return None
    try:
        iter_dir = resolve(checkpoint, "checkpoint")
        return None if iter_dir is None else Manifest.read(iter_dir).tokenizer
    except (UserError, OSError, ValueError):
        return None


def loading_note(checkpoint: str, ps: ParallelState) -> str:
    """What loading ``checkpoint`` for ``ps`` does, in words (the commands print it before the seconds it takes):
    the iteration and the layout it was saved at, resliced for this one."""
    here = f"TP {ps.tp_size}" + (f" x PP {ps.pp_size}" if ps.pp_size > 1 else "")
    if is_hf_folder(checkpoint):
        return f"loading the Hugging Face folder {checkpoint!r}, each rank its slice for {here}"
    try:
        iter_dir = resolve(checkpoint, "checkpoint")
        layout = Manifest.read(iter_dir).layout if iter_dir else None
    except (UserError, OSError, ValueError):
        layout = None
    if layout is None or layout.tp is None:
        return f"loading checkpoint {checkpoint!r} for {here}"
    saved = f"TP {layout.tp}" + (f" x PP {layout.pp_size}" if layout.pp_size > 1 else "")
    how = "its shards as saved" if (layout.tp, layout.pp_size) == (ps.tp_size, 1) else f"resharded from {saved}"
    return f"loading {iter_dir} for {here} ({how}; every file's SHA-256 checked)"


def checkpoint_seq_length(checkpoint: str) -> Optional[int]:
    """The model's positions (``max_position_embeddings``: the longest sequence it reads) from the checkpoint's
    metadata (no weights), or ``None``."""
    return _checkpoint_size(checkpoint, ("n_positions", "max_position_embeddings"),
                            ("max_position_embeddings", "seq_length"))


def checkpoint_num_layers(checkpoint: str) -> Optional[int]:
    """The model's layer count read from the checkpoint's metadata (no weights), or ``None``."""
    return _checkpoint_size(checkpoint, ("n_layer", "num_hidden_layers"), ("num_layers",))


def _checkpoint_size(checkpoint: str, hf_keys: tuple, keys: tuple) -> Optional[int]:
    try:
        if is_hf_folder(checkpoint):
            with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            return int(next(config[k] for k in hf_keys if k in config))
        iter_dir = resolve(checkpoint, "checkpoint")
        config = Manifest.read(iter_dir).config if iter_dir is not None else None
        return None if config is None else int(next(config[k] for k in keys if config.get(k) is not None))
    except Exception:  # noqa: BLE001 - best effort: the workers check again with the model
        return None


def load_model(checkpoint: str, ps: ParallelState, tokenizer_model=None, adapter: Optional[str] = None):
    """``(model, tokenizer or its spec, or None)``: the checkpoint's model sharded for ``ps``, in
    eval mode, and the tokenizer it names (``tokenizer_model`` replaces a tnlg checkpoint's
    recorded one, which then need not exist any more); with ``adapter`` (PEFT's LoRA folder) the
    adapter merged into its weights, ``W + scaling * B A``, each rank its shard
    (:func:`tnlg.interop.peft.merge_peft_adapter`). A Hugging Face folder: no collectives
    (every rank reads its own shard); a tnlg checkpoint: the ranks agree on the iteration and on
    the outcome of the checks (:func:`load_for_inference`).
    """
    recorded = None
    if is_hf_folder(checkpoint):
        model, spec = from_hf(checkpoint, ps), hf_tokenizer_spec(checkpoint)
    else:
        model, spec = load_for_inference(checkpoint, ps, tokenizer_override=tokenizer_model)
        iter_dir = resolve(checkpoint, "checkpoint") if adapter is not None else None
        if iter_dir is not None:  # the family it was converted from names PEFT's modules (Mistral's: Llama's)
            recorded = (Manifest.read(iter_dir).converted_from or {}).get("model_type")
    if adapter is not None:
        merge_peft_adapter(model, adapter, recorded if isinstance(recorded, str) else None)
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
        why = (" (a Hugging Face folder needs vocab.json + merges.txt, one .model file or a tokenizer.json)"
               if is_hf_folder(checkpoint) else "")
        raise UserError(_NO_TOKENIZER.format(ckpt=checkpoint, why=why))
    return load_tokenizer(spec)


def check_tokenizer_fits(tokenizer, model) -> None:
    """Every token id of the tokenizer must be a row of the model's embedding."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.config.vocab_size}: it was trained with another tokenizer. Pass the "
                        "model's own tokenizer with --tokenizer-model.")
