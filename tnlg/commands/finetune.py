"""``tnlg finetune``: supervised fine-tuning from a pretrained model, as Megatron-LM's ``--finetune --sft``.

The command's options are ``tnlg pretrain``'s declared fields (:mod:`tnlg.options`), read into the options of a
fine-tuning run here; the user's argument namespace is never changed:

* ``--load`` names the starting weights: a tnlg checkpoint, a Hugging Face folder (GPT-2, Llama, Qwen2, Mistral,
  Qwen3: read exactly or refused, :mod:`tnlg.interop.hf_reader`) or a Megatron-LM checkpoint. A foreign one is
  converted once, before any worker starts, into ``SAVE/base`` (a tnlg checkpoint at TP 1, weights only: any
  layout loads it), which the run then loads.
* The model's shape and its tokenizer are the checkpoint's (a model flag that says otherwise is refused, in one
  paragraph listing each difference; ``--seq-length`` is the run's, up to the model's ``max_position_embeddings``); ``--finetune``: the weights only, iteration 0, a new optimizer and LR
  schedule, the RNGs seeded (a ``--save`` that already holds this run's checkpoint is resumed whole instead).
  A ``--tokenizer-model`` that is not the model's own (a Hugging Face folder's tokenizer files, a tnlg
  checkpoint's record: compared by fingerprint) is refused unless ``--allow-other-tokenizer`` (then noted).
* ``--sft-data-path`` gives the rows (:mod:`tnlg.data.sft`); ``--calculate-per-token-loss`` is on, a line is
  logged every ``--train-iters / 20`` iterations and validation reads the whole ``--sft-valid-data-path`` set
  once (per token, as TRL's evaluation), unless given.
* Without ``--save``, a new folder ``runs/finetune-DATE-TIME``: a fine-tuning run never writes into the
  checkpoint root it started from.

**Nothing is written before everything is checked**, in this order: the flags, what ``--load`` is and whether
``--save`` belongs to a run of it, the tokenizer, the model flags against the model, every option, the
hardware, the ``--save`` root's lock and checkpoint, the rows (read, rendered and tokenized: the tokenized rows'
cache is the first thing written); then the record of the start (``SAVE/finetune_from.json``) and, last, the
conversion into ``SAVE/base``.

**What a run starts from is recorded**: ``SAVE/finetune_from.json`` holds the identity of ``--load`` (its
resolved path and a fingerprint of its weight files, :mod:`tnlg.interop.sources`), written before ``SAVE/base``
is converted. Every later launch with the same ``--save`` (a resume, a restarted group, each worker) compares
``--load`` with it and refuses another model in one paragraph: a ``SAVE/base`` converted from another folder is
never trained from, and a ``--save`` holding another run's checkpoint is never resumed in place of ``--load``.

The workers run ``tnlg finetune`` with the same arguments (and the ``--save`` chosen here); they find the record
and the converted base, and train. What rank 0 prints to resume a stopped run is that command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import TYPE_CHECKING, Optional

from ..errors import UserError
from ..runtime.launch import is_rank0, under_launcher
from .pretrain import (Command, check_hardware, check_sft_data, interruptible, launch, new_run_folder, processes,
                       start_flight_recorder)
from .pretrain_args import add_option_groups, resolve_options, user_options

if TYPE_CHECKING:
    from ..interop.sources import Source

__all__ = ["add_arguments", "run", "options", "hang_resume", "Start", "default_log_interval", "LOG_LINES", "RECORD"]

# a fine-tuning run logs about this many lines (every --train-iters / LOG_LINES iterations), unless told
LOG_LINES = 20
# the file in SAVE that records what the run starts from (the identity of --load)
RECORD = "finetune_from.json"
_DEFAULT_WORDS = {"log_interval": f"--train-iters / {LOG_LINES}, at least 1: about {LOG_LINES} lines a run",
                  "eval_iters": "the whole validation set, each sequence once"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_option_groups(p, builtin={}, defaults=_DEFAULT_WORDS)
    p.add_argument("--no-calculate-per-token-loss", dest="calculate_per_token_loss", action="store_false",
                   default=argparse.SUPPRESS, help="the loss of an iteration is the mean of its micro batches' "
                   "means (tnlg pretrain's default) instead of the per-token mean over the global batch")
    p.add_argument("--allow-other-tokenizer", action="store_true", default=argparse.SUPPRESS,
                   help="train with --tokenizer-model although it is not the model's own tokenizer (the tokenizer "
                   "files of a Hugging Face --load, or the one a tnlg checkpoint records): a vocabulary mapped onto "
                   "the model's on purpose; a note says so. Without it another tokenizer is refused, before "
                   "anything is written")
    p.description = (
        "Fine-tune a pretrained model on prompt/completion or chat rows (docs/finetune.md): --load a tnlg "
        "checkpoint, a Hugging Face folder (GPT-2, Llama, Qwen2, Mistral, Qwen3) or a Megatron-LM checkpoint, and give "
        "--sft-data-path ROWS (JSONL, Parquet or a datasets folder). The model's shape and tokenizer are the "
        "checkpoint's; the run starts at iteration 0 with a new optimizer and LR schedule (Megatron's "
        "--finetune), the loss counts the completions only (--sft-loss-on-prompt: every token), normalised per "
        "token over the global batch (--calculate-per-token-loss, on by default here), and samples are packed "
        "into sequences without attention between them (--no-packing: one per sequence). A line is logged every "
        f"--train-iters / {LOG_LINES} iterations (about {LOG_LINES} in a run; --log-interval N: every N). Every "
        "tnlg pretrain option applies (layout, precision, schedule, logging, --save, Ctrl-C and resuming). "
        "Without --save, checkpoints go to a new folder runs/finetune-DATE-TIME. Everything is checked before "
        "anything is written; a foreign --load is converted last, into SAVE/base, and SAVE records which model "
        "it started from: a later launch with another --load is refused. To resume, give the same command again.")


def default_log_interval(train_iters) -> Optional[int]:
    """A fine-tuning run's log interval: about :data:`LOG_LINES` lines a run (``None`` for a run length that is
    not a positive number: its own error comes first)."""
    if isinstance(train_iters, bool) or not isinstance(train_iters, int) or train_iters < 1:
        return None
    return max(1, train_iters // LOG_LINES)


def _command(args: argparse.Namespace) -> Command:
    return Command("finetune", add_arguments, args, checkpoint_args=False, keeps_load=True)


def hang_resume(args):
    """The command that resumes this run, for a hang report (:func:`tnlg.runtime.hang.report`)."""
    return _command(args).resume


def run(args: argparse.Namespace) -> int:
    """Check everything (:meth:`Start.of`, the options, the rows), write the start's record and convert a foreign
    ``--load``, then train as ``tnlg pretrain`` does, on workers running ``tnlg finetune``."""
    return interruptible("finetune", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    world, nproc = processes(args)
    start = Start.of(args)
    o = start.options(world)
    check_hardware(o)
    start.check_save(o)
    if not under_launcher():
        check_sft_data(o)  # the rows last: their tokens are the first thing written
    start.commit()
    o = start.options(world)
    if start.notes and is_rank0():  # (here: the workers are given --save, and find the base converted)
        print("\n".join(start.notes), flush=True)
    start_flight_recorder(o.checkpoint.save, o.precision.device)
    extra = ["--save", start.save] if not hasattr(args, "save") else []
    return launch(_command(args), o, nproc, extra=extra)


def options(args: argparse.Namespace, world_size: Optional[int] = None):
    """The :class:`~tnlg.options.Options` of the fine-tuning run ``args`` (``tnlg finetune``'s parsed arguments,
    left as they are) on ``world_size`` processes, for training from Python: every check of :func:`run` but the
    rows', then the start's record written and a foreign ``--load`` converted into ``SAVE/base``."""
    start = Start.of(args)
    o = start.options(world_size)
    start.check_save(o)
    start.commit()
    return start.options(world_size)


def _model_fields() -> set[str]:
    from ..options import ModelOptions
    from ..options.fields import option_fields
    return {f.name for f in option_fields(ModelOptions)}


@dataclasses.dataclass
class Start:
    """What a fine-tuning run starts from, checked, with nothing written yet (:meth:`of`): the user's options
    (``said``: the config file's and the flags'), the ``save`` folder, the identity of ``--load``
    (``source``), ``load`` (the tnlg checkpoint the run loads: ``--load`` itself, or ``SAVE/base``),
    ``convert`` (whether ``SAVE/base`` is still to be converted), whether ``SAVE``'s record of the start is
    still to be written (``record``), the starting model's manifest (``meta``: before a conversion, the
    model's shape and tokenizer as the conversion will record them), the tokenizer and the notes to print."""

    said: dict
    save: str
    source: "Source"
    load: str
    convert: bool
    record: bool
    meta: dict
    tokenizer_model: str
    notes: list

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Start":
        from ..checkpoint.files import last_checkpoint
        from ..interop.sources import KINDS, identify, source_kind
        said = user_options(args)
        allow_other = bool(said.pop("allow_other_tokenizer", False))  # (a check of the start, no run option)
        if said.get("load") is None:
            raise UserError("tnlg finetune needs --load: the pretrained model to start from (a tnlg checkpoint, a "
                            "Hugging Face folder, or a Megatron-LM checkpoint).")
        if said.get("sft_data_path") is None and said.get("data_path") is None:
            raise UserError("tnlg finetune needs --sft-data-path: a JSONL or Parquet file or a datasets folder of "
                            "{\"prompt\", \"completion\"} or {\"messages\"} rows (docs/finetune.md).")
        if said.get("use_checkpoint_args"):
            raise UserError("tnlg finetune takes the model's shape and tokenizer from --load already, and the run's "
                            "own options from the command line; --use-checkpoint-args would take the pretraining "
                            "run's data and schedule. To resume a fine-tuning run, give the same command again (its "
                            "--save holds the checkpoint).")
        if said.get("preset") is not None:
            raise UserError(f"--preset {said['preset']} sets a model shape, but tnlg finetune takes it from --load "
                            f"{said['load']!r}; drop --preset.")
        notes = []
        save = said.get("save")
        if save is None:
            save = new_run_folder("finetune", "tnlg finetune")
            notes.append(f"note: no --save: this fine-tuning run saves its checkpoints, metrics.jsonl and loss plot "
                         f"in {save} (--save DIR chooses the folder).")
        src = said["load"]
        kind = source_kind(src)
        source = identify(src, kind)
        record = _check_record(save, src, source, notes)
        base = src if kind == "ckpt" else os.path.join(save, "base")
        own = last_checkpoint(save) is not None  # this run's own checkpoint (the record agrees): resumed whole
        convert = kind != "ckpt" and last_checkpoint(base) is None and not own
        if convert and under_launcher():
            raise UserError(f"--load {src!r} is a {KINDS[kind]}: convert it before launching (tnlg convert --from "
                            f"{kind} {src} --to DIR, then --load DIR), or start tnlg finetune with --nproc-per-node "
                            f"instead of torchrun, which converts it once into {base}.")
        load = base if os.path.isdir(base) or not own else save  # (a resumed run needs no base; it may be gone)
        if kind != "ckpt" and not convert and load == base and not under_launcher():
            notes.append(f"note: {base} holds --load {src}, converted by an earlier launch of this run from the same "
                         f"files ({source.describe()}); using it.")
        tok = said.get("tokenizer_model")  # else a Hugging Face folder's own, when tnlg reads it; else the record
        if tok is not None or allow_other:
            _check_other_tokenizer(src, kind, tok, allow_other, notes)
        if tok is None and kind == "hf" and _loads_as_tokenizer(src):
            tok = src
        if convert:
            meta = _foreign_model(src, kind, tok)
        else:
            meta = _manifest(load)
            tok = tok or _manifest_options(meta).get("tokenizer_model")
        if tok is None:
            raise UserError(f"--load {src!r} records no tokenizer; give --tokenizer-model (the tokenizer the model "
                            f"was trained with). Nothing was written.")
        start = cls(said, save, source, load, convert, record, meta, tok, notes)
        start._check_model_flags()
        return start

    def _check_model_flags(self) -> None:
        """A model option given (flag or config file) that differs from the model's: one paragraph for all."""
        from ..options.fields import flag_of
        from ..config import arch_fields
        recorded, model = _manifest_options(self.meta), _model_fields() & set(arch_fields())  # (not --seq-length)
        wrong = [f"{flag_of(n)} {self.said[n]!r} given, the checkpoint's is {v!r}" for n, v in recorded.items()
                 if n in model and n in self.said and self.said[n] != v
                 and n not in ("hidden_dropout", "attention_dropout")]
        if wrong:
            raise UserError(f"--load {self.said['load']!r} is a model of another shape than the flags say: "
                            + "; ".join(wrong) + ". tnlg finetune takes the model's shape from the checkpoint: drop "
                            "these flags.")

    def options(self, world_size: Optional[int] = None):
        """The run's options: the user's, over the model's shape and tokenizer, with ``--finetune``, ``--load``
        (before the conversion: ``--load`` as given, a folder, for the checks), ``--save`` and fine-tuning's
        defaults (:data:`LOG_LINES`, the per-token loss)."""
        fields = _model_fields()
        model = {n: v for n, v in _manifest_options(self.meta).items() if n in fields and n not in self.said}
        values = {**self.said, **model, "finetune": True, "save": self.save, "tokenizer_model": self.tokenizer_model,
                  "load": self.said["load"] if self.convert else self.load}
        defaults: dict = {"calculate_per_token_loss": True, "eval_iters": None}  # (None: the whole set once)
        interval = default_log_interval(self.said.get("train_iters"))
        if interval is not None:
            defaults["log_interval"] = interval
        o = resolve_options(values, world_size, defaults=defaults)
        from ..interop.peft import check_adapter_options
        from ..options import model_config
        check_adapter_options(o.adapters, model_config(o, vocab_size=1))  # (targets and rank: the model's)
        return o

    def check_save(self, o) -> None:
        """``--save``: no other job holds it, and a checkpoint it holds (this run's own) fits these options."""
        from ..checkpoint.files import lock_root
        from ..training.checkpointing import check_resume
        if self.convert:  # (SAVE holds no checkpoint, and the base to load is not there yet)
            lock_root(os.path.abspath(self.save), probe=True)
        elif not under_launcher():  # (the workers check again when they load)
            check_resume(o)

    def commit(self) -> None:
        """The start's record (when ``SAVE`` has none), then the conversion of a foreign ``--load`` into
        ``SAVE/base``; after it, the base's manifest is the start's."""
        from ..io import atomic_write
        if self.record and is_rank0():
            os.makedirs(self.save, exist_ok=True)
            atomic_write(os.path.join(self.save, RECORD), json.dumps(self.source.to_dict(), indent=1) + "\n")
            self.record = False
        if not self.convert:
            return
        src, kind = self.said["load"], self.source.kind
        _remove_unfinished(self.load)
        if kind == "hf":
            from ..interop.hf_checkpoint import hf_to_checkpoint
            from .convert import check_hf_packages
            check_hf_packages("tnlg finetune --load HF_FOLDER")
            out = hf_to_checkpoint(src, self.load, tokenizer_model=self.tokenizer_model)
        else:
            from ..data.tokenizer import load_tokenizer
            from ..interop.megatron import megatron_to_checkpoint
            out = megatron_to_checkpoint(src, self.load, tokenizer=load_tokenizer(self.tokenizer_model))
        print(f"converted --load {src} ({kind}) into {out}", flush=True)
        self.convert, self.meta = False, _manifest(self.load)


def _check_other_tokenizer(src: str, kind: str, tok: Optional[str], allow: bool, notes: list) -> None:
    """``--tokenizer-model`` against the model's own tokenizer (a Hugging Face folder's tokenizer files, a tnlg
    checkpoint's record: :func:`tnlg.generation.loading.model_tokenizers`); another one is refused in one
    paragraph, or with ``--allow-other-tokenizer`` noted (once for the job). Nothing is written either way."""
    from ..data.fingerprint import ALLOW_FLAG, check_recorded
    from ..data.tokenizer import load_tokenizer
    from ..generation.loading import model_tokenizers
    from ..runtime.launch import speaks_for_job
    if tok is None:
        raise UserError(f"{ALLOW_FLAG} goes with --tokenizer-model (the other tokenizer to train with); without "
                        f"it the model's own tokenizer is used. Drop {ALLOW_FLAG}, or name the tokenizer. Nothing "
                        f"was written.")
    if kind not in ("hf", "ckpt"):
        return  # (a Megatron-LM checkpoint holds no tokenizer files to compare with: --tokenizer-model is its own)
    own, whose = model_tokenizers(src)
    note = check_recorded(own, load_tokenizer(tok), f"--load {src!r}", allow=allow, whose=whose,
                          after="Nothing was written.")
    if note and speaks_for_job():
        notes.append(note)


def _check_record(save: str, src: str, source, notes: list) -> bool:
    """``SAVE``'s record of what its run started from, against ``--load`` (``source``): another model is refused
    in one paragraph, a folder moved is noted; without a record, a ``SAVE`` that holds a checkpoint or a
    converted base (which no record ties to ``--load``) is refused. Whether the record is still to be
    written."""
    from ..checkpoint.files import last_checkpoint
    from ..interop.sources import Source
    path = os.path.join(save, RECORD)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                recorded = Source.from_dict(json.load(f))
        except (OSError, ValueError) as exc:
            raise UserError(f"{path!r} is not a record of what a fine-tuning run started from ({exc}); it was "
                            f"damaged or written by something else. Give this run another --save.") from None
        if not recorded.same_model(source):
            what = ("the same folder, whose weight files changed since (another size or modification time)"
                    if recorded.path == source.path else "another model")
            raise UserError(f"--save {save!r} belongs to a fine-tuning run that started from {recorded.describe()}, "
                            f"but --load {src!r} is {source.describe()}: {what}. Going on would train from the "
                            f"other model's weights (its converted {os.path.join(save, 'base')!r}, or its "
                            f"checkpoints) and ignore --load. Give this run another --save, or give --load the model "
                            f"that run started from. Nothing was written.")
        if recorded.path != source.path:
            notes.append(f"note: --load {src!r} holds the same files (names, sizes, times) as {recorded.path}, "
                         f"which this run in {save} started from; going on.")
        return False
    last = last_checkpoint(save)
    if last is not None:
        raise UserError(f"--save {save!r} holds a checkpoint (iteration {last}) that records no fine-tuning start "
                        f"(no {RECORD}: written by tnlg pretrain, or another run), so tnlg finetune cannot tell "
                        f"whether it started from --load {src!r}; resuming it would ignore --load. Give this run "
                        f"another --save; to go on with that run as it was, use `tnlg pretrain --save {save} "
                        f"--use-checkpoint-args`. Nothing was written.")
    base = os.path.join(save, "base")
    if os.path.isdir(base) and os.listdir(base):
        raise UserError(f"{base!r} holds a model converted by an earlier launch that records no source (no "
                        f"{os.path.join(save, RECORD)}), so tnlg finetune cannot tell whether it is --load {src!r}. "
                        f"Remove {base!r} (it is then converted again from --load), or give another --save. "
                        f"Nothing was written.")
    return True


def _remove_unfinished(base: str) -> None:
    """What a conversion into ``base`` that was killed left (folders its save marked as in progress): the
    record says ``base`` is this run's, converted from this ``--load``, so it is converted again whole."""
    from ..checkpoint.files import is_ours, remove_tree
    for name in os.listdir(base) if os.path.isdir(base) else ():
        if is_ours(os.path.join(base, name)):
            remove_tree(os.path.join(base, name))


def _manifest(load: str) -> dict:
    from ..checkpoint.files import read_meta, resolve
    iter_dir = resolve(load, "--load")
    if iter_dir is None:
        raise UserError(f"--load {load!r} holds no checkpoint.")
    return read_meta(iter_dir)


def _manifest_options(meta: dict) -> dict:
    from ..options.recorded import manifest_options
    return manifest_options(meta)


def _foreign_model(src: str, kind: str, tokenizer_model: Optional[str]) -> dict:
    """The manifest of a foreign ``--load`` as its conversion will record it (its config and the tokenizer
    ``tokenizer_model``), every check of the folder and the tokenizer made, nothing written."""
    from ..data.tokenizer import load_tokenizer
    if kind == "hf":
        from ..interop.hf_reader import open_hf_folder
        from .convert import check_hf_packages
        check_hf_packages("tnlg finetune --load HF_FOLDER")
        cfg, _ = open_hf_folder(src)
    tok = load_tokenizer(tokenizer_model) if tokenizer_model else None
    if kind == "megatron":
        from ..interop.megatron.importer import open_megatron
        _, cfg, _ = open_megatron(src, tok.vocab_size if tok else None)
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise UserError(f"--tokenizer-model {tokenizer_model!r} has {tok.vocab_size} tokens but the model's "
                        f"vocabulary has {cfg.vocab_size}; it is not this model's tokenizer. Nothing was written.")
    return {"config": cfg.to_dict(), "tokenizer": tok.describe() if tok else None}


def _loads_as_tokenizer(path: str) -> bool:
    from ..data.tokenizer import load_tokenizer
    try:
        load_tokenizer(path)
    except UserError:
        return False
    return True
