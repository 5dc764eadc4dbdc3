"""What a checkpoint records about the run, and the checks that a resumed run is the same job.

Must match the checkpoint (else a :class:`UserError` naming every difference):

* the architecture: ``num_layers``, ``hidden_size``, ``num_attention_heads``,
  ``max_position_embeddings``, ``ffn_hidden_size``, ``vocab_size`` (from the tokenizer),
  ``layernorm_epsilon``, the dropout rates (training settings, not the shape, named as such in the
  error: a resume keeps them), the GELU form, whether the output layer is untied, and the
  Llama family's choices (positions, normalisation, SwiGLU, KV groups, biases): every field
  :class:`~tnlg.config.GPTConfig` declares ``arch``;
* the data: the ``--data-path`` datasets (same files: same resolved prefix, or
  the same ``.bin``/``.idx`` sizes when the files were moved; ``X.bin``, ``X.idx``
  and ``X`` are the same prefix, also in checkpoints saved before paths were
  normalised) and weights,
  ``--split``, ``--seed``, ``--seq-length``, ``--eod-mask-loss``, ``--reset-position-ids``,
  ``--reset-attention-mask``, and the tokenizer (same file contents, by SHA-256).

Free to change: the run length (``--train-iters``), the layout (TP, DP,
process count, ZeRO stage, micro batch), intervals, logging, precision flags,
and optimizer hyper-parameters (the LR schedule is a function of the restored
step count and the current ``--lr*`` flags).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Optional

from ..config import GPTConfig, arch_fields, flag_of
from ..data.gpt_dataset import parse_data_path
from ..data.indexed import dataset_prefix
from ..errors import UserError
from .manifest import Manifest

__all__ = ["ARCH_FIELDS", "options_record", "data_record", "check_compatible"]

ARCH_FIELDS = arch_fields()  # declared in GPTConfig
# an architecture field a checkpoint does not record was added after it was written: it has the default,
# which is what that checkpoint's model was (tanh GELU, tied output layer, learned positions, LayerNorm, ...)
_LATER_FIELDS = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name in ARCH_FIELDS
                 and f.default is not dataclasses.MISSING}


def options_record(o) -> dict:
    """The run's options (:class:`tnlg.options.Options`, or any namespace) as JSON-able values (what
    ``tnlg checkpoint info`` shows)."""
    if o is None:
        return {}
    out: dict[str, Any] = {}
    for k, v in sorted(_by_name(o).items()):
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
            out[k] = list(v)
    return out


def _by_name(o) -> dict:
    """Every option of ``o`` (:class:`tnlg.options.Options`, or any namespace) by its name."""
    return o.flat() if hasattr(o, "flat") else dict(o) if isinstance(o, dict) else vars(o)


def data_record(o) -> Optional[dict]:
    """The datasets of ``--data-path``: resolved prefixes, byte sizes of their files, weights."""
    data_path = _by_name(o).get("data_path") if o is not None else None
    if not data_path:
        return None
    prefixes, weights = parse_data_path(data_path)
    files = []
    for p in prefixes:
        rec: dict[str, Any] = dict(prefix=os.path.realpath(p))
        for ext in ("idx", "bin"):
            path = f"{p}.{ext}"
            rec[f"{ext}_bytes"] = os.path.getsize(path) if os.path.isfile(path) else None
        files.append(rec)
    return dict(files=files, weights=weights)


def _saved_files(record: dict) -> list[dict]:
    """The checkpoint's datasets with each path read as its prefix: runs saved before paths were
    normalised may record ``X.bin`` (and no sizes, looked up at ``X.bin.idx``)."""
    return [dict(f, prefix=dataset_prefix(f["prefix"])) for f in record["files"]]


def _sizes(f: dict) -> str:
    if f.get("idx_bytes") is None:
        return "no file sizes recorded"
    return f".idx {f['idx_bytes']:,} + .bin {f['bin_bytes']:,} bytes"


def _data_differences(saved: dict, now: dict) -> list[str]:
    """Why the checkpoint's datasets are not this run's, one phrase each; none when they are the
    same: the same weights and, dataset by dataset, the same resolved prefix, or the same
    ``.idx``/``.bin`` sizes at a new path (the files were moved or copied)."""
    old, new = _saved_files(saved), now["files"]
    if len(old) != len(new):
        return [f"--data-path names {len(old)} dataset(s) in the checkpoint ({', '.join(f['prefix'] for f in old)}) "
                f"vs {len(new)} now ({', '.join(f['prefix'] for f in new)})"]
    out = []
    if saved.get("weights") != now.get("weights"):
        out.append(f"--data-path weights {saved.get('weights')} in the checkpoint vs {now.get('weights')} now")
    for x, y in zip(old, new):
        moved_copy = x.get("idx_bytes") is not None and (x["idx_bytes"], x["bin_bytes"]) == (y["idx_bytes"],
                                                                                             y["bin_bytes"])
        if x["prefix"] != y["prefix"] and not moved_copy:
            out.append(f"--data-path {x['prefix']} in the checkpoint ({_sizes(x)}) vs {y['prefix']} now "
                       f"({_sizes(y)}): another path whose files differ in size")
    return out


# recorded and compared with the architecture, but not the model's shape: rates that only training uses
TRAINING_FIELDS = ("hidden_dropout", "attention_dropout")


def _arch_difference(name: str, saved, now) -> str:
    if name not in TRAINING_FIELDS:
        return f"{name} {saved!r} in the checkpoint vs {now!r} now"
    return (f"{name} {saved!r} in the checkpoint vs {now!r} now (a training setting, not the architecture, which "
            f"a resume keeps so that it continues the same run: give {flag_of(name)} {saved!r}, or "
            f"--use-checkpoint-args, which takes it from the checkpoint)")


def check_compatible(meta, where: str, config: GPTConfig, options,
                     tokenizer, origin: str = "--load", must_match: Iterable[str] = (),
                     weights_only: bool = False) -> None:
    """Raise one :class:`UserError` listing every model- or data-defining difference between the
    checkpoint (``meta``: its :class:`~.manifest.Manifest` or dict) and this run (``config``, ``options``,
    ``tokenizer``). The options come as data: ``options`` by name (a mapping, a namespace, or an object
    whose ``flat()`` gives them: :class:`tnlg.options.Options`), and ``must_match`` the names of those that
    define the samples (:data:`tnlg.options.MUST_MATCH`), which must be the checkpoint's. ``weights_only``
    (fine-tuning from it, ``--finetune``): the architecture and the tokenizer only; how the checkpoint's run
    trained (dropout, :data:`TRAINING_FIELDS`) and its data may differ."""
    manifest = Manifest.of(meta)
    saved_cfg = {**_LATER_FIELDS, **(manifest.config or {})}
    if saved_cfg.get("max_position_embeddings") is None:  # (written before the positions had a field of their own)
        saved_cfg["max_position_embeddings"] = saved_cfg.get("seq_length")
    have = config.to_dict()
    changed = [k for k in ARCH_FIELDS if k in saved_cfg and saved_cfg[k] != have[k]
               and not (weights_only and k in TRAINING_FIELDS)]
    diffs = [_arch_difference(k, saved_cfg[k], have[k]) for k in changed]
    arch = any(k not in TRAINING_FIELDS for k in changed)
    saved_opts = manifest.options or {}
    if options is not None:
        now_opts = _by_name(options)
        for k in must_match:
            if k in saved_opts and k in now_opts and saved_opts[k] != now_opts[k]:
                diffs.append(f"{flag_of(k)} {saved_opts[k]!r} in the checkpoint vs {now_opts[k]!r} now")
        saved_data, now_data = manifest.data, data_record(options)
        if saved_data and now_data:
            diffs += _data_differences(saved_data, now_data)
    saved_tok = manifest.tokenizer
    if saved_tok and tokenizer is not None:
        now_tok = tokenizer.describe()
        if saved_tok.get("sha256") != now_tok.get("sha256") or saved_tok.get("kind") != now_tok.get("kind"):
            where_tok = saved_tok.get("path") or saved_tok.get("vocab_file")
            diffs.append(f"the tokenizer ({saved_tok.get('kind')} {where_tok!r} in the checkpoint vs "
                         f"{now_tok.get('kind')} {now_tok.get('path') or now_tok.get('vocab_file')!r} now, "
                         f"different file contents)")
    if not diffs:
        return
    hint = (" (found in --save and resumed automatically: use another --save directory to start a new run)"
            if origin == "--save" else "")
    if weights_only:
        raise UserError(f"checkpoint {where!r} ({origin}, whose weights this run fine-tunes) does not match this "
                        f"run: " + "; ".join(diffs) + ". Fine-tuning takes the model's shape and tokenizer from "
                        "the checkpoint: drop the model flags that differ (or give the checkpoint's values), "
                        "and give the tokenizer it was trained with. Nothing was loaded or written.")
    raise UserError(
        f"checkpoint {where!r}{hint} does not match this run: " + "; ".join(diffs) + ". "
        + ("It was saved from a different architecture. " if arch else "")
        + "Flags that define the model or the data must be the same when resuming; flags about the run's "
          "length and layout (--train-iters, --tensor-model-parallel-size, process count, intervals) may change. "
          "Nothing was loaded or overwritten.")
