"""``tnlg pretrain`` options: Megatron flag names, presets with their published recipes, config files.

The options are typed dataclasses (:mod:`tnlg.options`); the parser, the config-file keys and
:data:`DEFAULTS` are read from their fields. Precedence, lowest first: defaults (Megatron-LM's; the
built-in job's tuned :data:`BUILTIN_JOB` values without ``--data-path`` and with no ``--preset`` or a
:data:`BUILTIN_SHAPES` one)
< ``--preset`` (model shape and recipe) < ``--config FILE`` (TOML or YAML; keys are flag names with
``_`` or ``-``) < flags given on the command line; with ``--use-checkpoint-args`` the options the
checkpoint recorded come between the preset and the config file (:mod:`tnlg.options.recorded`).
Everything is validated here, in the launching process, before any worker starts or anything is written.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from ..config import PRESETS
from ..errors import UserError, closest
from ..options import COMPONENTS, DEFAULT_NPROC, OPTION_NAMES, ModelOptions, Options, model_config, option_defaults
from ..options.checks import is_int
from ..options.fields import add_options, option_fields, shown
from ..options.recipes import RECIPES
from ..layout import data_parallel_size
from ..options.recorded import checkpoint_args

__all__ = ["add_arguments", "add_option_groups", "resolve", "user_options", "resolve_options", "read_config_file",
           "model_config", "DEFAULTS", "BUILTIN_JOB", "RECIPES", "DEFAULT_NPROC"]

# Every run's defaults, read from the option dataclasses: Megatron-LM's where Megatron has one (no warmup,
# decay over --train-iters, linear decay to --min-lr 0, Adam beta2 0.999, dropout 0.1, TP 1, global batch
# = micro batch x DP, a log line every 100 iterations, 100 validation batches every 1000). Megatron
# requires the model shape, the micro batch and --lr; here they default to a small GPT, 8 and 6e-4 (GPT-3
# Small's peak). --train-iters has no default outside the built-in job (Megatron requires it too).
DEFAULTS = option_defaults()

# The built-in job (no --data-path and no --preset): a small GPT on the built-in corpus, TP=2 x DP=2,
# ZeRO-1, tuned to learn in a few minutes on 2 CPU cores. These values apply to it only; where the user
# sets what they depend on, they follow (see _builtin_scaled): --lr-warmup-iters is a tenth of the
# schedule (30 of 300), --min-lr a tenth of --lr, TP 1 on an odd number of processes.
BUILTIN_JOB = dict(
    hidden_dropout=0.0, attention_dropout=0.0, global_batch_size=16, train_iters=300, lr=2e-3,
    lr_decay_style="cosine", adam_beta2=0.95, tensor_model_parallel_size=2, log_interval=10,
    eval_interval=100, eval_iters=4, save_interval=100, sample_prompt="ROMEO:",
    # the corpus is 49 whole works: Megatron's 969,30,1 would validate on one play (Winter's Tale);
    # 90,10,0 validates on the last five (44 works train, no test split)
    split="90,10,0",
)

# what --help says of the built-in job's defaults that are not a plain value
_BUILTIN_WORDS = {
    "lr_warmup_iters": "a tenth of the schedule, 30",
    "min_lr": "--lr / 10",
    "tensor_model_parallel_size": "2; 1 on an odd number of processes",
}

# the shapes the built-in job runs with (no --data-path): its own, or a CPU-sized preset's
BUILTIN_SHAPES = (None, "llama-tiny")

_MODEL_KEYS = tuple(f.name for f in option_fields(ModelOptions))


def _builtin_presets() -> str:
    return " or ".join(f"--preset {name}" for name in BUILTIN_SHAPES if name)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Pretrain a GPT with tensor parallelism (TP) inside groups of processes and ZeRO data parallelism "
        "(DP) across them. Without --data-path (and without --preset, or with the CPU-sized "
        f"{_builtin_presets()}): the built-in job, a small GPT (or that preset's shape) on the built-in "
        "Shakespeare+Milton corpus, TP=2 x DP=2, ZeRO stage 1, 4 local gloo processes, a few minutes on 2 "
        "CPU cores.\n\n"
        "Defaults: the values marked 'built-in job' below are tuned for that job and apply to it only; any "
        "other run (--data-path, or another --preset) gets Megatron-LM's defaults where it says nothing: no warmup, "
        "decay over --train-iters (which it must give), linear decay to --min-lr 0, Adam beta2 0.999, "
        "dropout 0.1, TP 1, global batch = micro batch x DP, validation of 100 batches every 1000 "
        "iterations. A recipe (--preset tnlg-17b, megatron-8.3b) brings its own values.\n\n"
        "Saving: with --save DIR, checkpoints, metrics.jsonl and the loss plot go to DIR, and a run whose DIR "
        "holds a checkpoint resumes from it. Without --save, the built-in job saves to a new folder "
        "runs/pretrain-DATE-TIME (under torchrun: runs/pretrain-RUN_ID, the launcher's run id); a run with "
        "--load saves back into the checkpoint root it loaded from; any other run saves nothing, and says so "
        "when it starts and when it ends.\n\n"
        "Stopping: Ctrl-C (SIGINT), SIGTERM (a scheduler's preemption) and SIGHUP (also as forwarded by "
        "torchrun) finish the current iteration, save a checkpoint of it (when the run has a save root) and "
        "stop. Rank 0 then prints the iteration, the last checkpoint and the command that resumes the run; a "
        "second Ctrl-C stops at once, without a save.\n\n"
        "Logged every --log-interval iterations: loss, lr, grad norm, ms/iter, tokens/s, model TFLOP/s per "
        "rank (the primary figure), MFU and, with recomputation, HFU. Model FLOPs per iteration (Narayanan et "
        "al. 2021, eq. 3, any --ffn-hidden-size): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) for ffn = 4h; MFU = "
        "model FLOP/s / peak, HFU = executed FLOP/s (recomputation included) / peak. The peak is measured at "
        "start on every rank at once (dense matmuls in the training dtype, best of 5) and printed with the "
        "MFU, unless --peak-tflops gives it. With full recomputation the executed FLOPs are "
        "96 B s l h^2 (1 + s/(6h) + V/(16 l h)) for ffn = 4h.")
    add_option_groups(p, {**{k: shown(v) for k, v in BUILTIN_JOB.items()}, **_BUILTIN_WORDS})


def add_option_groups(p: argparse.ArgumentParser, builtin: dict, defaults: Optional[dict] = None) -> None:
    """Every declared option's flag (:data:`tnlg.options.COMPONENTS`) with ``--preset`` and ``--config``, in
    their --help groups. ``builtin``: what --help says of the built-in job's values (by field name);
    ``defaults``: what it says of a default instead of the declared one (a command's own defaults)."""
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=list(PRESETS), default=argparse.SUPPRESS, help="model shape (and, for "
                   "tnlg-17b / megatron-8.3b, the published training recipe); flags override it")
    g.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="TOML or YAML file of options (flag names); flags override it")
    groups: dict = {"model": g}
    for _, cls, title in COMPONENTS:
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        add_options(groups[title], cls, builtin, defaults=defaults)


def read_config_file(path: str) -> dict:
    """The options of a ``--config`` file (TOML or YAML; keys are flag names with ``_`` or ``-``), by option
    name; an unknown key is one paragraph with the closest valid ones."""
    if not os.path.isfile(path):
        raise UserError(f"--config {path!r} does not exist.")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            import tomllib
            data = tomllib.loads(raw.decode())
        else:
            import yaml
            data = yaml.safe_load(raw) or {}
    except Exception as exc:  # noqa: BLE001 - any parse error is a user error
        raise UserError(f"--config {path!r} could not be parsed: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path!r} must hold a mapping of option names to values.")
    keys = ("preset",) + OPTION_NAMES
    out = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k not in keys:
            near = closest(k, keys)
            raise UserError(f"--config {path!r}: unknown key {key!r}"
                            + (f"; did you mean {' or '.join(near)}?" if near else ".")
                            + f" Valid keys: {', '.join(sorted(keys))}.")
        out[k] = value
    return out


def resolve(args: argparse.Namespace, world_size: int | None = None) -> Options:
    """Merge defaults, preset, config file and flags; validate; return the run's :class:`Options`.

    ``world_size`` is the number of processes when known (under torchrun, or from
    ``--nproc-per-node``); layout checks and the defaults that follow the layout
    (global batch = micro batch x DP) need it. ``o.builtin_job`` says whether the
    built-in job's defaults applied (no ``--data-path``; no ``--preset``, or one of :data:`BUILTIN_SHAPES`).
    """
    return resolve_options(user_options(args), world_size)


def user_options(args: argparse.Namespace) -> dict:
    """What the user set, by option name: the ``--config`` file's values, then the flags given over them."""
    given = {k: v for k, v in vars(args).items() if k not in ("command",)}
    from_file = read_config_file(given["config"]) if given.get("config") else {}
    return {**from_file, **given}


def resolve_options(said: dict, world_size: int | None = None, defaults: Optional[dict] = None) -> Options:
    """:func:`resolve` of the options ``said`` (:func:`user_options`); ``defaults``: a command's own defaults,
    over every run's (:data:`DEFAULTS`) and under everything else."""
    recorded, info = checkpoint_args(said) if said.get("use_checkpoint_args") else ({}, None)
    preset = said.get("preset")
    builtin = info["builtin_job"] if info else (preset in BUILTIN_SHAPES and said.get("data_path") is None
                                                and said.get("sft_data_path") is None)
    opts = {**DEFAULTS, **(defaults or {})}
    if builtin:
        opts.update(BUILTIN_JOB)
    if preset:
        shape = PRESETS[preset]
        opts.update({k: v for k, v in shape.items() if k in _MODEL_KEYS})
        opts["seq_length"] = shape["seq_length"]
        opts.update(RECIPES.get(preset, {}))
        said_or_recipe = set(said) | set(recorded) | set(RECIPES.get(preset, {}))
    else:
        said_or_recipe = set(said) | set(recorded)
    opts.update(recorded)
    opts.update(said)
    if builtin:
        _builtin_scaled(opts, {**recorded, **said}, world_size)
    _batch_defaults(opts, said_or_recipe, world_size)
    o = Options.from_flat(opts, preset=preset, config=opts.get("config"), builtin_job=builtin, checkpoint_args=info)
    o.check(world_size)
    return o


def _builtin_scaled(opts: dict, said: dict, world_size: int | None) -> None:
    """The built-in job's defaults that depend on other options follow them when the user sets those:
    warmup a tenth of the schedule, --min-lr a tenth of --lr, TP 1 on an odd number of processes."""
    iters, decay = opts["train_iters"], opts["lr_decay_iters"]
    if "lr_warmup_iters" not in said and is_int(iters) and iters > 0:
        opts["lr_warmup_iters"] = min(iters, decay if is_int(decay) and decay > 0 else iters) // 10
    if "min_lr" not in said and isinstance(opts["lr"], (int, float)) and not isinstance(opts["lr"], bool):
        opts["min_lr"] = opts["lr"] / 10
    if "tensor_model_parallel_size" not in said and world_size is not None and world_size % 2:
        opts["tensor_model_parallel_size"] = 1


def _batch_defaults(opts: dict, said: set, world_size: int | None) -> None:
    """Megatron's global batch default (micro batch x DP); and when only the global batch is set, the
    largest micro batch up to the default that divides it over DP (never an error about a flag the user
    did not give)."""
    micro, gbs = opts["micro_batch_size"], opts["global_batch_size"]
    dp = data_parallel_size(world_size, opts["tensor_model_parallel_size"], opts.get("pipeline_model_parallel_size", 1),
                            opts.get("context_parallel_size", 1))  # (CP ranks read the same samples)
    if dp is None or not (is_int(micro) and micro > 0):
        return
    if gbs is None:
        opts["global_batch_size"] = micro * dp
    elif "micro_batch_size" not in said and is_int(gbs) and gbs > 0 and gbs % (micro * dp) and gbs % dp == 0:
        per_rank = gbs // dp
        opts["micro_batch_size"] = max(m for m in range(1, micro + 1) if per_rank % m == 0)
