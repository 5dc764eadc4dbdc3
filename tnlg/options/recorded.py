"""``--use-checkpoint-args`` (Megatron-LM's flag): the options a checkpoint recorded, taken for this run.

Every checkpoint records its run's options (``meta.json``, ``"options"``; one ``tnlg convert`` wrote records
none, and its model shape and tokenizer are read from its architecture and tokenizer records instead:
:func:`manifest_options`). With the flag, a run takes
from the checkpoint that ``--load`` names (else the one ``--save`` holds) what the run is: the model
shape, the data and tokenizer, the layout (TP, sequence parallelism, PP with its pipeline schedule and
layer split, ZeRO), the schedule (batch, run
length, learning rate, AdamW), the precision and the intervals of logging, validation and saving
(:data:`TAKEN`). Not taken (:data:`THIS_LAUNCH`): where this launch reads and writes, and how it runs
on this machine. Precedence: defaults < preset < the checkpoint < config file < flags; each value given
that differs from the recorded one is reported as an override. A layout option given replaces the
record's as ``--tp`` does; ``--pp 1`` also drops the record's pipeline schedule and layer split (they
describe stages this run does not have), and any of them given (``--pipeline-schedule``,
``--num-layers-per-virtual-pipeline-stage``, ``--decoder-first/last-pipeline-num-layers``) replaces all
of the record's (a recorded virtual-stage size would turn ``--pipeline-schedule 1f1b`` back into
interleaving, a recorded first-stage size refuse ``--pipeline-schedule interleaved``).
"""

from __future__ import annotations

import os
from typing import Optional

from ..errors import UserError
from .components import COMPONENTS
from .fields import flag_of, option_fields

__all__ = ["TAKEN", "THIS_LAUNCH", "checkpoint_args", "manifest_options", "describe"]

# where this launch reads and writes, and how it runs on this machine, whatever the checkpoint's did
THIS_LAUNCH = ("save", "load", "finetune", "use_checkpoint_args", "metrics_file", "plot", "data_cache_path", "tensorboard_dir",
               "wandb_project", "wandb_exp_name", "wandb_save_dir", "nproc_per_node", "max_restarts",
               "distributed_timeout_minutes", "device", "peak_tflops")
TAKEN = tuple(f.name for _, cls, _ in COMPONENTS for f in option_fields(cls) if f.name not in THIS_LAUNCH)
# options that say one thing together: a value given for one of them replaces the record's for all
# the pipeline's schedule and layer split (only a pipeline has them: not taken by a run given --pp 1)
_PIPELINE_ONLY = ("pipeline_schedule", "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                  "decoder_last_pipeline_num_layers")
_TOGETHER = (("bf16", "fp16"), ("recompute_activations", "recompute_granularity"), _PIPELINE_ONLY)
# architecture-record fields that are no choice of the model (how the run that wrote it ran)
_NOT_FROM_CONFIG = ("sequence_parallel", "recompute_activations", "recompute_granularity", "seed")


def checkpoint_args(said: dict) -> tuple[dict, dict]:
    """``(values, info)`` for the options ``said`` (from a config file and the command line):
    ``values`` the recorded options to apply, ``info`` the checkpoint's iteration directory (``path``),
    whether it was the built-in job (``builtin_job``: then its corpus is found again, not taken from the
    record), the names taken and the ``overrides`` (flag, recorded value, value given)."""
    from ..checkpoint.files import read_meta, resolve  # (torch: not imported for --help)
    where = said.get("load") or said.get("save")
    origin = "--load" if said.get("load") else "--save"
    iter_dir = resolve(where, origin) if where and (said.get("load") or os.path.isdir(where)) else None
    if iter_dir is None:
        held = (f"{origin} {where!r} holds no checkpoint" if where else "neither --load nor --save is given")
        raise UserError(f"--use-checkpoint-args takes the model, data, tokenizer, layout and schedule from a "
                        f"checkpoint, but {held}. Give --load DIR (a checkpoint root or an iter_* folder), or a "
                        f"--save DIR that holds a checkpoint; or drop --use-checkpoint-args and give the options.")
    meta = read_meta(iter_dir)
    recorded = {**manifest_options(meta), **(meta.get("options") or {})}
    builtin = bool(recorded.get("builtin_job")) and said.get("data_path") is None and said.get("preset") is None
    skip = {n for group in _TOGETHER if any(n in said for n in group) for n in group}
    if said.get("pipeline_model_parallel_size") == 1:
        skip |= set(_PIPELINE_ONLY)
    if builtin:
        skip |= {"data_path", "tokenizer_model"}
    values = {n: recorded[n] for n in TAKEN if n in recorded and n not in skip}
    overrides = [(flag_of(n), values[n], said[n]) for n in values if n in said and said[n] != values[n]]
    return values, dict(path=iter_dir, builtin_job=builtin, taken=sorted(values), overrides=overrides)


def manifest_options(meta: dict) -> dict:
    """The options a checkpoint's manifest implies beside its recorded run options: its model shape (the
    architecture record, ``config``) and its tokenizer (``tokenizer``: a SentencePiece model's path, or a
    GPT-2 BPE vocab.json with its merges.txt beside it, or a tokenizer.json). A checkpoint ``tnlg convert`` wrote records no
    run options (no run made it): these are what ``--use-checkpoint-args`` takes from it; a trained
    checkpoint's recorded options say the same and take precedence."""
    config, tok = meta.get("config"), meta.get("tokenizer")
    config, tok = (config if isinstance(config, dict) else {}), (tok if isinstance(tok, dict) else {})
    out = {n: v for n, v in config.items() if n in TAKEN and n not in _NOT_FROM_CONFIG}
    if tok.get("kind") == "sentencepiece" and isinstance(tok.get("path"), str):
        out["tokenizer_model"] = "builtin" if tok.get("builtin") else tok["path"]
    elif tok.get("kind") == "gpt2bpe" and isinstance(tok.get("vocab_file"), str) and isinstance(
            tok.get("merges_file"), str) and os.path.join(os.path.dirname(tok["vocab_file"]), "merges.txt") == \
            tok["merges_file"]:
        out["tokenizer_model"] = tok["vocab_file"]  # (vocab.json with merges.txt beside it)
    elif tok.get("kind") == "tokenizer-json" and isinstance(tok.get("path"), str):
        out["tokenizer_model"] = tok["path"]  # (a Hugging Face tokenizer.json)
    return out


def describe(info: Optional[dict]) -> list[str]:
    """The lines a run with ``--use-checkpoint-args`` prints: what it took, and each override."""
    if not info:
        return []
    lines = [f"note: --use-checkpoint-args: {len(info['taken'])} options (model, data, tokenizer, layout, schedule, "
             f"precision, intervals) from {info['path']}"]
    lines += [f"note: {flag} {_typed(given)} given, overriding the checkpoint's {flag} {_typed(value)}"
              for flag, value, given in info["overrides"]]
    return lines


def _typed(value) -> str:
    """A value as it is typed on the command line (``None``: not set, the option's default applies)."""
    if value is None:
        return "(not set)"
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
