"""``tnlg finetune``: supervised fine-tuning from a pretrained model, as Megatron-LM's ``--finetune --sft``.

A fine-tuning run is a ``tnlg pretrain`` run whose options say so, resolved here in the launching process:

* ``--load`` names the starting weights: a tnlg checkpoint, a Hugging Face folder (GPT-2, Llama, Qwen2, Mistral, Qwen3: read
  exactly or refused, :mod:`tnlg.interop.hf_reader`) or a Megatron-LM checkpoint. A foreign one is converted
  once, before any worker starts, into ``SAVE/base`` (a tnlg checkpoint at TP 1, weights only: any layout loads
  it), which the run then loads.
* The model's shape and its tokenizer are the checkpoint's (a model flag that says otherwise is refused, in one
  paragraph listing each difference); ``--finetune``: the weights only, iteration 0, a new optimizer and LR
  schedule, the RNGs seeded (a ``--save`` that already holds this run's checkpoint is resumed whole instead).
* ``--sft-data-path`` gives the rows (:mod:`tnlg.data.sft`), and ``--calculate-per-token-loss`` is on unless
  given: the loss is the global batch's per-token mean over the counted tokens.
* Without ``--save``, a new folder ``runs/finetune-DATE-TIME``: a fine-tuning run never writes into the
  checkpoint root it started from.

The workers then run ``tnlg pretrain`` with these options spelled out (what rank 0 prints to resume a stopped
run is that command).
"""

from __future__ import annotations

import argparse
import os
import weakref

from ..errors import UserError
from ..runtime.launch import under_launcher
from . import pretrain
from .pretrain_args import add_arguments as add_pretrain_arguments

__all__ = ["add_arguments", "run", "preflight", "prepare", "hang_resume"]

hang_resume = pretrain.hang_resume
# the argument namespaces prepare() turned into pretrain options already, by id while each lives (a Namespace is
# unhashable; an id alone outlives its object, and a new namespace at a freed one's address was once taken for
# prepared: its run then trained from random weights)
_PREPARED: "weakref.WeakValueDictionary[int, argparse.Namespace]" = weakref.WeakValueDictionary()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_pretrain_arguments(p)
    p.add_argument("--no-calculate-per-token-loss", dest="calculate_per_token_loss", action="store_false",
                   default=argparse.SUPPRESS, help="the loss of an iteration is the mean of its micro batches' "
                   "means (tnlg pretrain's default) instead of the per-token mean over the global batch")
    p.description = (
        "Fine-tune a pretrained model on prompt/completion or chat rows (docs/finetune.md): --load a tnlg "
        "checkpoint, a Hugging Face folder (GPT-2, Llama, Qwen2, Mistral, Qwen3) or a Megatron-LM checkpoint, and give "
        "--sft-data-path ROWS (JSONL, Parquet or a datasets folder). The model's shape and tokenizer are the "
        "checkpoint's; the run starts at iteration 0 with a new optimizer and LR schedule (Megatron's "
        "--finetune), the loss counts the completions only (--sft-loss-on-prompt: every token), normalised per "
        "token over the global batch (--calculate-per-token-loss, on by default here), and samples are packed "
        "into sequences without attention between them (--no-packing: one per sequence). Every tnlg pretrain "
        "option applies (layout, precision, schedule, logging, --save, Ctrl-C and resuming). Without --save, "
        "checkpoints go to a new folder runs/finetune-DATE-TIME.")


def run(args: argparse.Namespace) -> int:
    """Resolve the fine-tuning options (:func:`prepare`), then run them as ``tnlg pretrain`` does."""
    prepare(args)
    return pretrain.run(args)


def preflight(args: argparse.Namespace) -> None:
    prepare(args)
    pretrain.preflight(args)


def prepare(args: argparse.Namespace) -> None:
    """Turn ``tnlg finetune``'s arguments into the ``tnlg pretrain`` options of the same run (in place; done once:
    a second call changes nothing). Converts a foreign ``--load`` into ``SAVE/base`` first."""
    if _PREPARED.get(id(args)) is args:
        return
    if getattr(args, "load", None) is None:
        raise UserError("tnlg finetune needs --load: the pretrained model to start from (a tnlg checkpoint, a Hugging "
                        "Face folder, or a Megatron-LM checkpoint).")
    if getattr(args, "sft_data_path", None) is None and getattr(args, "data_path", None) is None:
        raise UserError("tnlg finetune needs --sft-data-path: a JSONL or Parquet file or a datasets folder of "
                        "{\"prompt\", \"completion\"} or {\"messages\"} rows (docs/finetune.md).")
    if getattr(args, "use_checkpoint_args", False):
        raise UserError("tnlg finetune takes the model's shape and tokenizer from --load already, and the run's own "
                        "options from the command line; --use-checkpoint-args would take the pretraining run's data "
                        "and schedule. To resume a fine-tuning run, give the same command again (its --save holds "
                        "the checkpoint), or `tnlg pretrain --save DIR --use-checkpoint-args`.")
    if not hasattr(args, "save"):
        args.save = pretrain.new_run_folder("finetune", "tnlg finetune")
        print(f"note: no --save: this fine-tuning run saves its checkpoints, metrics.jsonl and loss plot in "
              f"{args.save} (--save DIR chooses the folder).", flush=True)
    args.load = _as_tnlg_checkpoint(args)
    _take_model_from_checkpoint(args)
    args.finetune = True
    if not hasattr(args, "calculate_per_token_loss"):
        args.calculate_per_token_loss = True
    _PREPARED[id(args)] = args


def _kind(path: str) -> str:
    """``ckpt`` (tnlg), ``hf`` or ``megatron``: what ``--load`` holds."""
    from ..checkpoint.files import resolve
    from ..checkpoint.manifest import META
    if not os.path.isdir(path):
        raise UserError(f"--load {path!r} is not a directory; give a tnlg checkpoint, a Hugging Face folder or a "
                        f"Megatron-LM checkpoint.")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if os.path.isfile(os.path.join(path, META)) or any(
            os.path.isfile(os.path.join(path, d, META)) for d in os.listdir(path) if d.startswith("iter_")):
        resolve(path, "--load")  # a tnlg root: its pointer and iterations checked (one paragraph if broken)
        return "ckpt"
    return "megatron"  # (Megatron-LM's layout: the same pointer file, iter_* folders without meta.json)


def _as_tnlg_checkpoint(args: argparse.Namespace) -> str:
    """``--load`` as a tnlg checkpoint: itself, or ``SAVE/base`` converted from a Hugging Face folder or a
    Megatron-LM checkpoint (once: a later launch of the same run finds it there)."""
    src = args.load
    kind = _kind(src)
    if kind == "ckpt":
        return src
    base = os.path.join(args.save, "base")
    if os.path.isdir(base) and os.listdir(base):
        print(f"note: --load {src!r} was converted into {base} by an earlier launch of this run; using it.",
              flush=True)
        return base
    if under_launcher():
        raise UserError(f"--load {src!r} is a {'Hugging Face folder' if kind == 'hf' else 'Megatron-LM checkpoint'}: "
                        f"convert it before launching (tnlg convert --from {kind} {src} --to {base}), or start "
                        f"tnlg finetune with --nproc-per-node instead of torchrun, which converts it once.")
    from ..data.tokenizer import load_tokenizer
    tok_path = getattr(args, "tokenizer_model", None)
    if kind == "hf":
        from .convert import check_hf_packages
        from ..interop.hf_checkpoint import hf_to_checkpoint
        check_hf_packages("tnlg finetune --load HF_FOLDER")
        if tok_path is None and _loads_as_tokenizer(src):
            tok_path = args.tokenizer_model = src
        out = hf_to_checkpoint(src, base, tokenizer_model=tok_path)
    else:
        from ..interop.megatron import megatron_to_checkpoint
        out = megatron_to_checkpoint(src, base, tokenizer=load_tokenizer(tok_path) if tok_path else None)
    print(f"converted --load {src} ({kind}) into {out}", flush=True)
    return out


def _loads_as_tokenizer(path: str) -> bool:
    from ..data.tokenizer import load_tokenizer
    try:
        load_tokenizer(path)
    except UserError:
        return False
    return True


def _take_model_from_checkpoint(args: argparse.Namespace) -> None:
    """The model's shape and tokenizer from ``--load``'s checkpoint; model flags given that differ are refused."""
    from ..checkpoint.files import read_meta, resolve
    from ..options import ModelOptions
    from ..options.fields import flag_of, option_fields
    from ..options.recorded import _from_manifest
    iter_dir = resolve(args.load, "--load")
    if iter_dir is None:
        raise UserError(f"--load {args.load!r} holds no checkpoint.")
    recorded = _from_manifest(read_meta(iter_dir))
    model_fields = {f.name for f in option_fields(ModelOptions)}
    wrong = [f"{flag_of(n)} {getattr(args, n)!r} given, the checkpoint's is {v!r}" for n, v in recorded.items()
             if n in model_fields and hasattr(args, n) and getattr(args, n) != v
             and n not in ("hidden_dropout", "attention_dropout")]
    if wrong:
        raise UserError(f"--load {args.load!r} is a model of another shape than the flags say: " + "; ".join(wrong)
                        + ". tnlg finetune takes the model's shape from the checkpoint: drop these flags.")
    if getattr(args, "preset", None) is not None:
        raise UserError(f"--preset {args.preset} sets a model shape, but tnlg finetune takes it from --load "
                        f"{args.load!r}; drop --preset.")
    for n, v in recorded.items():
        if n in model_fields and not hasattr(args, n):
            setattr(args, n, v)
    if not hasattr(args, "tokenizer_model") or args.tokenizer_model is None:
        if recorded.get("tokenizer_model") is None:
            raise UserError(f"--load {args.load!r} records no tokenizer; give --tokenizer-model (the tokenizer the "
                            f"model was trained with).")
        args.tokenizer_model = recorded["tokenizer_model"]
