"""``tnlg pretrain`` options: Megatron flag names, presets with their published recipes, config files.

Precedence, lowest first: defaults (:data:`DEFAULTS`, Megatron-LM's; the
built-in job's tuned :data:`BUILTIN_JOB` values when neither ``--data-path`` nor
``--preset`` is given) < ``--preset`` (model shape and recipe) < ``--config
FILE`` (TOML or YAML; keys are flag names with ``_`` or ``-``) < flags given on
the command line. Everything is validated here, in the launching process,
before any worker starts or anything is written.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

from .config import PRESETS, GPTConfig
from .errors import UserError

__all__ = ["add_arguments", "resolve", "DEFAULTS", "BUILTIN_JOB", "RECIPES", "DEFAULT_NPROC"]

# Every run's defaults: Megatron-LM's where Megatron has one (no warmup, decay over --train-iters, linear
# decay to --min-lr 0, Adam beta2 0.999, dropout 0.1, TP 1, global batch = micro batch x DP, a log line
# every 100 iterations, 100 validation batches every 1000). Megatron requires the model shape, the micro
# batch and --lr; here they default to a small GPT, 8 and 6e-4 (GPT-3 Small's peak). --train-iters has no
# default outside the built-in job (Megatron requires it too).
DEFAULTS = dict(
    preset=None, config=None,
    num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, ffn_hidden_size=None,
    hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
    micro_batch_size=8, global_batch_size=None, train_iters=None,
    lr=6e-4, min_lr=0.0, lr_warmup_iters=0, lr_decay_iters=None, lr_decay_style="linear",
    weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
    tensor_model_parallel_size=1, zero_stage=1, zero_impl="tnlg", nproc_per_node=None, max_restarts=0,
    data_path=None, split="969,30,1", tokenizer_model=None, data_cache_path=None,
    eod_mask_loss=False, reset_position_ids=False, reset_attention_mask=False,
    seed=1234, bf16=False, fp16=False, accumulate_allreduce_grads_in_fp32=False, device=None,
    recompute_activations=False, recompute_granularity=None, sequence_parallel=False,
    log_interval=100, eval_interval=1000, eval_iters=100,
    save=None, save_interval=None, load=None, keep_last=None, metrics_file=None, plot=True,
    peak_tflops=None, sample_prompt="", sample_tokens=48, distributed_timeout_minutes=10,
    bucket_size_mb=25.0,
)

# The built-in job (no --data-path and no --preset): a small GPT on the built-in corpus, TP=2 x DP=2,
# ZeRO-1, tuned to learn in a few minutes on 2 CPU cores. These values apply to it only; where the user
# sets what they depend on, they follow (see _builtin_scaled): --lr-warmup-iters is a tenth of the
# schedule (30 of 300), --min-lr a tenth of --lr, TP 1 on an odd number of processes.
BUILTIN_JOB = dict(
    hidden_dropout=0.0, attention_dropout=0.0, global_batch_size=16, train_iters=300, lr=2e-3,
    lr_decay_style="cosine", adam_beta2=0.95, tensor_model_parallel_size=2, log_interval=10,
    eval_interval=100, eval_iters=4, save_interval=100, sample_prompt="ROMEO:",
)

DEFAULT_NPROC = 4  # local processes when not under torchrun and --nproc-per-node is not given

# what --help says of defaults that are not a plain value: (every run, the built-in job)
_DEFAULT_WORDS = {
    "train_iters": ("none: required", None),
    "global_batch_size": ("micro batch x DP", None),
    "lr_decay_iters": ("--train-iters", None),
    "lr_warmup_iters": (None, "a tenth of the schedule, 30"),
    "min_lr": (None, "--lr / 10"),
    "tensor_model_parallel_size": (None, "2; 1 on an odd number of processes"),
    "ffn_hidden_size": ("4 x hidden size", None),
    "nproc_per_node": (f"one per GPU when GPUs are present, else {DEFAULT_NPROC}", None),
    "sample_prompt": ("none", None),
    "save_interval": ("only at the end", None),
}

# Published recipes (REFERENCE.md): T-NLG as reported; Megatron 8.3B's.
RECIPES = {
    "tnlg-17b": dict(global_batch_size=512, micro_batch_size=1, train_iters=300_000, lr=1.5e-4, min_lr=1e-5,
                     lr_warmup_iters=3200, lr_decay_iters=500_000, lr_decay_style="cosine", weight_decay=0.01,
                     clip_grad=1.0, fp16=True, tensor_model_parallel_size=4, zero_stage=1,
                     hidden_dropout=0.1, attention_dropout=0.1),
    "megatron-8.3b": dict(global_batch_size=512, micro_batch_size=1, train_iters=300_000, lr=1.5e-4,
                          min_lr=1e-5, lr_warmup_iters=3000, lr_decay_style="cosine", weight_decay=0.01,
                          clip_grad=1.0, fp16=True, tensor_model_parallel_size=8, zero_stage=0,
                          hidden_dropout=0.1, attention_dropout=0.1),
}

_MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "ffn_hidden_size",
               "hidden_dropout", "attention_dropout", "init_method_std")


def _shown(v) -> str:
    return f"{v:g}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)


def _flag(p, *names, **kw):
    """An option whose default lives in :data:`DEFAULTS` (absent from the namespace unless given);
    its help ends with the default of every run and, where it differs, the built-in job's."""
    dest = kw.get("dest") or names[0].lstrip("-").replace("-", "_")
    if kw.get("action") not in ("store_true", "store_false") and dest in DEFAULTS:
        every, builtin = _DEFAULT_WORDS.get(dest, (None, None))
        if every is None and DEFAULTS[dest] is not None:
            every = _shown(DEFAULTS[dest])
        if builtin is None and dest in BUILTIN_JOB:
            builtin = _shown(BUILTIN_JOB[dest])
        parts = ([f"default {every}"] if every else []) + ([f"built-in job {builtin}"] if builtin else [])
        if parts:
            kw["help"] = (kw.get("help", "") + f" ({'; '.join(parts)})").strip()
    p.add_argument(*names, default=argparse.SUPPRESS, **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Pretrain a GPT with tensor parallelism (TP) inside groups of processes and ZeRO data parallelism "
        "(DP) across them. Without --data-path and --preset: the built-in job, a small GPT on the built-in "
        "Shakespeare+Milton corpus, TP=2 x DP=2, ZeRO stage 1, 4 local gloo processes, a few minutes on 2 "
        "CPU cores.\n\n"
        "Defaults: the values marked 'built-in job' below are tuned for that job and apply to it only; any "
        "other run (--data-path or --preset) gets Megatron-LM's defaults where it says nothing: no warmup, "
        "decay over --train-iters (which it must give), linear decay to --min-lr 0, Adam beta2 0.999, "
        "dropout 0.1, TP 1, global batch = micro batch x DP, validation of 100 batches every 1000 "
        "iterations. A recipe (--preset tnlg-17b, megatron-8.3b) brings its own values.\n\n"
        "Saving: with --save DIR, checkpoints, metrics.jsonl and the loss plot go to DIR, and a run whose DIR "
        "holds a checkpoint resumes from it. Without --save, the built-in job saves to a new "
        "runs/pretrain-DATE-TIME; a run with --load saves back into the checkpoint root it loaded from; any "
        "other run saves nothing, and says so when it starts and when it ends.\n\n"
        "Stopping: Ctrl-C (SIGINT) stops at the end of the current iteration; SIGTERM (a scheduler's "
        "preemption) does too, after saving a checkpoint of that iteration. Rank 0 then prints the "
        "iteration, the last checkpoint and the command that resumes the run; a second signal stops at "
        "once.\n\n"
        "Logged every --log-interval iterations: loss, lr, grad norm, ms/iter, tokens/s, model TFLOP/s per "
        "rank (the primary figure), MFU and, with recomputation, HFU. Model FLOPs per iteration (Narayanan et "
        "al. 2021, eq. 3, any --ffn-hidden-size): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) for ffn = 4h; MFU = "
        "model FLOP/s / peak, HFU = executed FLOP/s (recomputation included) / peak. The peak is measured at "
        "start on every rank at once (dense matmuls in the training dtype, best of 5) and printed with the "
        "MFU, unless --peak-tflops gives it. 72 B s l h^2 (1 + s/(6h) + V/(12 l h)); "
        "96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation.")
    g = p.add_argument_group("model")
    _flag(g, "--preset", choices=list(PRESETS), help="model shape (and, for tnlg-17b / megatron-8.3b, the "
          "published training recipe); flags override it")
    _flag(g, "--config", metavar="FILE", help="TOML or YAML file of options (flag names); flags override it")
    for name, typ in (("num-layers", int), ("hidden-size", int), ("num-attention-heads", int),
                      ("seq-length", int), ("ffn-hidden-size", int), ("hidden-dropout", float),
                      ("attention-dropout", float), ("init-method-std", float)):
        _flag(g, f"--{name}", type=typ)
    g = p.add_argument_group("batch and schedule")
    _flag(g, "--micro-batch-size", type=int, help="samples per rank per micro step")
    _flag(g, "--global-batch-size", type=int, help="samples per iteration = micro x DP x accumulation steps")
    _flag(g, "--train-iters", type=int)
    _flag(g, "--lr", type=float, help="peak learning rate")
    _flag(g, "--min-lr", type=float)
    _flag(g, "--lr-warmup-iters", type=int, help="linear warmup from 0 over this many iterations")
    _flag(g, "--lr-decay-iters", type=int, help="decay ends here; --min-lr after")
    _flag(g, "--lr-decay-style", choices=["cosine", "linear", "constant"])
    _flag(g, "--weight-decay", type=float, help="AdamW decay on matrices (2-D parameters) only")
    _flag(g, "--clip-grad", type=float, help="clip by the global norm across TP and DP (0: off)")
    _flag(g, "--adam-beta1", type=float)
    _flag(g, "--adam-beta2", type=float)
    _flag(g, "--adam-eps", type=float)
    g = p.add_argument_group("parallelism")
    _flag(g, "--tensor-model-parallel-size", "--tp", type=int, help="TP size (any size up to the head count)")
    _flag(g, "--sequence-parallel", action="store_true", help="with TP > 1: split the activations between "
          "the TP regions along the sequence (LayerNorm, dropout, residual on 1/TP of the tokens; "
          "all-gather/reduce-scatter instead of all-reduce; any sequence length)")
    _flag(g, "--zero-stage", type=int, choices=[0, 1, 2, 3], help="0: all-reduce; 1: optimizer "
          "states partitioned; 2: + gradients; 3: + parameters (2/3 via FSDP2)")
    _flag(g, "--zero-impl", choices=["tnlg", "deepspeed"], help="ZeRO implementation: tnlg (our own "
          "for 0/1, FSDP2 for 2/3) or deepspeed (DeepSpeed's ZeRO 1-3 over our DP group; optional extra: "
          "pip install -e \".[deepspeed]\")")
    _flag(g, "--nproc-per-node", type=int, help="launch this many local processes (torch's elastic "
          "launcher) unless already under torchrun")
    _flag(g, "--max-restarts", type=int, help="with --nproc-per-node: restart the group this many times "
          "after a failure (resuming from --save)")
    _flag(g, "--distributed-timeout-minutes", type=float, help="a hung collective fails after this long")
    g = p.add_argument_group("data")
    _flag(g, "--data-path", nargs="+", help="PREFIX, or weights and prefixes: 0.7 A 0.3 B (default: the "
          "built-in corpus)")
    _flag(g, "--split", help="train,valid,test weights by documents, e.g. 949,50,1")
    _flag(g, "--tokenizer-model", help="SentencePiece .model or a GPT-2 BPE folder")
    _flag(g, "--data-cache-path", help="where index arrays are cached when the data folder is read-only")
    for name in ("eod-mask-loss", "reset-position-ids", "reset-attention-mask"):
        _flag(g, f"--{name}", action="store_true")
    g = p.add_argument_group("precision and memory")
    _flag(g, "--bf16", action="store_true", help="ZeRO mixed precision: bf16 parameters and gradients "
          "(2 + 2 bytes per parameter), fp32 master weights and Adam moments for the owned 1/dp slice")
    _flag(g, "--fp16", action="store_true", help="as --bf16 in fp16, with dynamic loss scaling (GPUs only)")
    _flag(g, "--accumulate-allreduce-grads-in-fp32", action="store_true", help="with --bf16/--fp16: keep an "
          "fp32 gradient buffer (accumulation over micro batches and the DP reduction in fp32; 2 + 4 bytes "
          "per parameter); ZeRO stages 0 and 1")
    _flag(g, "--device", choices=["cpu", "cuda"], help="where to train (default: cuda when a GPU is present, "
          "else cpu); one process per GPU")
    _flag(g, "--recompute-activations", action="store_true", help="activation checkpointing per block; "
          "the same as --recompute-granularity full (Megatron-LM maps it to selective)")
    _flag(g, "--recompute-granularity", choices=["full", "selective"], help="recompute activations in "
          "backward instead of keeping them: full = every transformer block from its input (2 s b h bytes "
          "per layer kept, one more forward); selective = the attention core only (softmax and dropout, the "
          "5 a s^2 b term; a few %% more FLOPs); default: keep everything")
    _flag(g, "--seed", type=int)
    g = p.add_argument_group("logging, evaluation, checkpoints")
    _flag(g, "--log-interval", type=int)
    _flag(g, "--eval-interval", type=int, help="validation every N iterations (and before the first; 0: off)")
    _flag(g, "--eval-iters", type=int, help="global batches per validation (0: no validation)")
    _flag(g, "--metrics-file", help="JSON Lines metrics (default SAVE/metrics.jsonl)")
    _flag(g, "--no-plot", dest="plot", action="store_false", help="no loss-curve PNG at the end")
    _flag(g, "--peak-tflops", type=float, help="per-rank peak for MFU (default: measured at start)")
    _flag(g, "--save", help="checkpoint directory, also for metrics.jsonl and the loss plot; resumed from "
          "when it holds a checkpoint. Without it: the built-in job saves to a new runs/pretrain-DATE-TIME, "
          "a run with --load saves back into the root it loaded from, any other run saves nothing (and says "
          "so at start and at the end)")
    _flag(g, "--save-interval", type=int, help="save every N iterations (always at the end and on SIGTERM)")
    _flag(g, "--load", help="resume from this checkpoint (a root: its latest iteration; or an iter_* "
          "directory); without --save, later checkpoints go into the same root")
    _flag(g, "--keep-last", type=int, help="keep only the last K checkpoints")
    _flag(g, "--sample-prompt", help="prompt of the sample printed at the end ('' for none)")
    _flag(g, "--sample-tokens", type=int)


def _read_config_file(path: str) -> dict:
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
    out = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k not in DEFAULTS or k in ("config",):
            valid = ", ".join(sorted(k2 for k2 in DEFAULTS if k2 != "config"))
            raise UserError(f"--config {path!r}: unknown key {key!r}. Valid keys: {valid}.")
        out[k] = value
    return out


def resolve(args: argparse.Namespace, world_size: int | None = None) -> SimpleNamespace:
    """Merge defaults, preset, config file and flags; validate; return the run's options.

    ``world_size`` is the number of processes when known (under torchrun, or from
    ``--nproc-per-node``); layout checks and the defaults that follow the layout
    (global batch = micro batch x DP) need it. ``o.builtin_job`` says whether the
    built-in job's defaults applied (neither ``--data-path`` nor ``--preset``).
    """
    given = {k: v for k, v in vars(args).items() if k not in ("command",)}
    from_file = _read_config_file(given["config"]) if given.get("config") else {}
    said = {**from_file, **given}  # what the user set, in a file or on the command line
    preset = said.get("preset")
    builtin = preset is None and said.get("data_path") is None
    opts = dict(DEFAULTS)
    if builtin:
        opts.update(BUILTIN_JOB)
    if preset:
        shape = PRESETS[preset]
        opts.update({k: v for k, v in shape.items() if k in _MODEL_KEYS})
        opts["seq_length"] = shape["seq_length"]
        opts.update(RECIPES.get(preset, {}))
        said_or_recipe = set(said) | set(RECIPES.get(preset, {}))
    else:
        said_or_recipe = set(said)
    opts.update(said)
    opts["preset"] = preset
    if builtin:
        _builtin_scaled(opts, said, world_size)
    _batch_defaults(opts, said_or_recipe, world_size)
    o = SimpleNamespace(**opts)
    o.builtin_job = builtin
    _recompute_options(o)
    _validate(o, world_size)
    return o


def _recompute_options(o: SimpleNamespace) -> None:
    """``--recompute-activations`` is ``--recompute-granularity full``; afterwards both say the same."""
    if o.recompute_granularity not in (None, "full", "selective"):
        raise UserError(f"--recompute-granularity must be full or selective, got {o.recompute_granularity!r}.")
    if o.recompute_activations and o.recompute_granularity == "selective":
        raise UserError("--recompute-activations (full recomputation of every block) contradicts "
                        "--recompute-granularity selective (the attention core only); give one of them.")
    if o.recompute_activations:
        o.recompute_granularity = "full"
    o.recompute_activations = o.recompute_granularity == "full"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _builtin_scaled(opts: dict, said: dict, world_size: int | None) -> None:
    """The built-in job's defaults that depend on other options follow them when the user sets those:
    warmup a tenth of the schedule, --min-lr a tenth of --lr, TP 1 on an odd number of processes."""
    iters, decay = opts["train_iters"], opts["lr_decay_iters"]
    if "lr_warmup_iters" not in said and _is_int(iters) and iters > 0:
        opts["lr_warmup_iters"] = min(iters, decay if _is_int(decay) and decay > 0 else iters) // 10
    if "min_lr" not in said and isinstance(opts["lr"], (int, float)) and not isinstance(opts["lr"], bool):
        opts["min_lr"] = opts["lr"] / 10
    if "tensor_model_parallel_size" not in said and world_size is not None and world_size % 2:
        opts["tensor_model_parallel_size"] = 1


def _batch_defaults(opts: dict, said: set, world_size: int | None) -> None:
    """Megatron's global batch default (micro batch x DP); and when only the global batch is set, the
    largest micro batch up to the default that divides it over DP (never an error about a flag the user
    did not give)."""
    tp, micro, gbs = opts["tensor_model_parallel_size"], opts["micro_batch_size"], opts["global_batch_size"]
    if world_size is None or not (_is_int(tp) and tp > 0 and world_size % tp == 0 and _is_int(micro) and micro > 0):
        return
    dp = world_size // tp
    if gbs is None:
        opts["global_batch_size"] = micro * dp
    elif "micro_batch_size" not in said and _is_int(gbs) and gbs > 0 and gbs % (micro * dp) and gbs % dp == 0:
        per_rank = gbs // dp
        opts["micro_batch_size"] = max(m for m in range(1, micro + 1) if per_rank % m == 0)


def _validate(o: SimpleNamespace, world_size: int | None) -> None:
    if o.train_iters is None:
        raise UserError("--train-iters is required for a run on your own data (--data-path) or a --preset "
                        "without a recipe, as in Megatron-LM: the built-in job's 300 iterations suit only the "
                        "built-in job. The learning-rate schedule (decay over --train-iters) follows it.")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "global_batch_size", "train_iters", "tensor_model_parallel_size", "log_interval"):
        v = getattr(o, name)
        if v is None and name == "global_batch_size":  # micro batch x DP, once DP is known
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}.")
    for name in ("eval_interval", "eval_iters", "lr_warmup_iters"):
        v = getattr(o, name)
        if not isinstance(v, int) or v < 0:
            raise UserError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v!r}.")
    if o.lr_decay_style not in ("cosine", "linear", "constant"):
        raise UserError(f"--lr-decay-style must be cosine, linear or constant, got {o.lr_decay_style!r}.")
    if o.lr_decay_iters is not None and (not isinstance(o.lr_decay_iters, int) or o.lr_decay_iters < 1):
        raise UserError(f"--lr-decay-iters must be a positive integer, got {o.lr_decay_iters!r}.")
    if not (isinstance(o.lr, (int, float)) and o.lr > 0):
        raise UserError(f"--lr must be a positive number, got {o.lr!r}.")
    if not (isinstance(o.min_lr, (int, float)) and 0 <= o.min_lr <= o.lr):
        raise UserError(f"--min-lr must be between 0 and --lr ({o.lr}), got {o.min_lr!r}.")
    from .optim.schedule import LRSchedule
    LRSchedule(max_lr=o.lr, min_lr=o.min_lr, warmup_iters=o.lr_warmup_iters,
               decay_iters=o.lr_decay_iters or o.train_iters, decay_style=o.lr_decay_style)  # raises UserError
    if o.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero-stage must be 0, 1, 2 or 3, got {o.zero_stage!r}.")
    if o.zero_impl not in ("tnlg", "deepspeed"):
        raise UserError(f"--zero-impl must be tnlg or deepspeed, got {o.zero_impl!r}.")
    if o.zero_impl == "deepspeed":
        from .optim.deepspeed_engine import check_deepspeed_options
        check_deepspeed_options(o.zero_stage, fp16=o.fp16)  # installed, stage 1-3, no --fp16
    if o.bf16 and o.fp16:
        raise UserError("--bf16 and --fp16 are exclusive: pick one.")
    from .parallel.state import pick_device
    device = pick_device(o.device)  # --device cuda without a GPU is refused here
    if o.fp16 and device.type != "cuda":
        raise UserError("--fp16 needs a GPU: fp16 matrix multiplies are unusably slow on CPUs. Use --bf16 "
                        "(bf16 parameters, fp32 master weights) or fp32 (the default) on this machine.")
    if o.accumulate_allreduce_grads_in_fp32 and not (o.bf16 or o.fp16):
        raise UserError("--accumulate-allreduce-grads-in-fp32 needs --bf16 or --fp16: in fp32 training the "
                        "gradients are fp32 already.")
    if o.accumulate_allreduce_grads_in_fp32 and o.zero_stage >= 2:
        raise UserError(f"--accumulate-allreduce-grads-in-fp32 is implemented for ZeRO stages 0 and 1, not for "
                        f"--zero-stage {o.zero_stage} (FSDP2 keeps gradients in the parameters' 16-bit dtype). "
                        f"Drop the flag or use --zero-stage 1.")
    if o.save_interval is not None and (not isinstance(o.save_interval, int) or o.save_interval < 1):
        raise UserError(f"--save-interval must be a positive integer, got {o.save_interval!r}.")
    if o.keep_last is not None and (not isinstance(o.keep_last, int) or o.keep_last < 1):
        raise UserError(f"--keep-last must be a positive integer, got {o.keep_last!r}.")
    if o.nproc_per_node is not None and (not isinstance(o.nproc_per_node, int) or o.nproc_per_node < 1):
        raise UserError(f"--nproc-per-node must be a positive integer, got {o.nproc_per_node!r}.")
    try:
        model_config(o, vocab_size=1).check_tensor_parallel(o.tensor_model_parallel_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if world_size is not None:
        tp = o.tensor_model_parallel_size
        if world_size % tp:
            valid = [t for t in range(1, world_size + 1) if world_size % t == 0]
            raise UserError(f"--tensor-model-parallel-size {tp} does not divide the {world_size} processes; "
                            f"valid sizes for {world_size} processes: {valid}.")
        dp = world_size // tp
        if o.global_batch_size % (o.micro_batch_size * dp):
            raise UserError(
                f"--global-batch-size {o.global_batch_size} is not divisible by --micro-batch-size "
                f"{o.micro_batch_size} x data-parallel size {dp} (= {o.micro_batch_size * dp}); the global "
                f"batch is micro batch x DP x accumulation steps. Try --global-batch-size "
                f"{max(1, o.global_batch_size // (o.micro_batch_size * dp)) * o.micro_batch_size * dp}.")
    if o.data_path is not None:
        from .data.gpt_dataset import parse_data_path
        from .data.indexed import IndexedDataset
        prefixes, _ = parse_data_path(o.data_path)
        for prefix in prefixes:
            IndexedDataset(prefix)  # refuses missing / corrupt files with a clear error
        if o.tokenizer_model is None:
            raise UserError("--data-path needs --tokenizer-model (the tokenizer the data was preprocessed with).")
    if o.tokenizer_model is not None:
        from .data.tokenizer import load_tokenizer
        load_tokenizer(o.tokenizer_model)  # refuses a missing or unreadable tokenizer with a clear error
    if o.load is not None and not os.path.isdir(o.load):
        raise UserError(f"--load {o.load!r} is not a directory.")


def model_config(o: SimpleNamespace, vocab_size: int) -> GPTConfig:
    """The :class:`GPTConfig` these options describe."""
    try:
        return GPTConfig(num_layers=o.num_layers, hidden_size=o.hidden_size,
                         num_attention_heads=o.num_attention_heads, seq_length=o.seq_length,
                         vocab_size=vocab_size, ffn_hidden_size=o.ffn_hidden_size,
                         hidden_dropout=o.hidden_dropout, attention_dropout=o.attention_dropout,
                         init_method_std=o.init_method_std, recompute_activations=bool(o.recompute_activations),
                         recompute_granularity=o.recompute_granularity,
                         sequence_parallel=bool(o.sequence_parallel), seed=o.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
