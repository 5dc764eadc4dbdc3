"""``tnlg convert`` (Hugging Face / Megatron-LM <-> tnlg checkpoints, offline resharding) and ``tnlg checkpoint info``.

* ``tnlg convert --from hf DIR --to CKPT [--tokenizer-model M] [--tensor-model-parallel-size N]``:
  a ``GPT2LMHeadModel`` folder (``save_pretrained``) -> a tnlg checkpoint at
  iteration 0 with no optimizer state (training from it starts a fresh
  optimizer); ``M`` is recorded as the checkpoint's tokenizer.
* ``tnlg convert --from CKPT --to hf DIR [--tokenizer-model M | --no-tokenizer]``: GPT-2
  format (``config.json`` + ``model.safetensors``), loadable with
  ``GPT2LMHeadModel.from_pretrained``, plus the checkpoint's tokenizer (or ``M``) in the
  form ``AutoTokenizer.from_pretrained`` loads (docs/hf.md).
* ``tnlg convert --from CKPT --to CKPT2 --tensor-model-parallel-size N``:
  rewrite the shards for TP size N (weights and optimizer state; RNG of DP rank 0).
  Not needed to change layout (``--load`` re-slices at any TP), but it makes
  the files match the new layout.
* ``tnlg convert --from megatron DIR --to CKPT [--tp N] [--vocab-size V | --tokenizer-model M] [--with-optimizer]``:
  a Megatron-LM GPT checkpoint (``torch_dist`` or legacy, any TP x PP) -> a tnlg checkpoint with its
  iteration and LR-schedule position, and with ``--with-optimizer`` its Adam state
  (:mod:`tnlg.interop.megatron.importer`); written at PP 1, it loads at any ``--pp`` by name.
* ``tnlg convert --from CKPT --to megatron DIR [--format torch_dist|legacy] [--tp N] [--pp M]``: a
  checkpoint Megatron-LM loads (:mod:`tnlg.interop.megatron.exporter`; docs/megatron.md), from a tnlg
  checkpoint saved at any TP x PP.
* ``tnlg checkpoint info CKPT [--json]``: iteration, layout, config, sizes.

All of it runs in one process, reading only the slices it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .checkpoint import files as F
from .checkpoint.files import FORMAT
from .checkpoint.loading import read_states
from .checkpoint.reshard import ShardReader, full_targets, slice_full, targets_for
from .checkpoint.saving import write_offline
from .checkpoint.stages import describe_stages
from .config import GPTConfig
from .data.tokenizer import load_tokenizer
from .errors import UserError
from .hf import (_load_hf_model, build_hf_model, config_from_hf, hf_to_tnlg_state_dict, hf_tokenizer_files,
                 write_hf_folder)

__all__ = ["add_arguments", "run", "hf_to_checkpoint", "checkpoint_to_hf", "reshard_checkpoint", "info"]


# --------------------------------------------------------------------------- arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tnlg convert`` or ``tnlg checkpoint`` (told apart by ``parser.prog``)."""
    if parser.prog.split()[-1] == "checkpoint":
        parser.description = "Inspect tnlg checkpoints."
        sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION")
        p = sub.add_parser("info", help="iteration, layout, config, tokenizer and file sizes of a checkpoint",
                           description="Print what a checkpoint holds. CKPT is a checkpoint root (its "
                                       "latest iteration) or one iter_* directory.")
        p.add_argument("path", metavar="CKPT")
        p.add_argument("--json", action="store_true", help="print meta.json plus file sizes as JSON")
        return
    parser.description = (
        "Convert between Hugging Face GPT-2 folders and tnlg checkpoints, or reshard a checkpoint offline.\n\n"
        "  tnlg convert --from hf HF_DIR --to CKPT [--tokenizer-model M]\n"
        "  tnlg convert --from CKPT --to hf HF_DIR [--tokenizer-model M | --no-tokenizer]\n"
        "  tnlg convert --from CKPT --to CKPT2 --tensor-model-parallel-size N\n"
        "  tnlg convert --from megatron MEGATRON_DIR --to CKPT [--tp N] [--vocab-size V | --tokenizer-model M] "
        "[--with-optimizer]\n"
        "  tnlg convert --from CKPT --to megatron MEGATRON_DIR [--format torch_dist|legacy] [--tp N] [--pp M]\n\n"
        "CKPT may be a checkpoint root (its latest iteration is used) or one iter_* directory. The "
        "destination must not exist or be empty: nothing is overwritten.")
    parser.add_argument("--from", dest="src", nargs="+", required=True, metavar="SRC",
                        help="'hf DIR' (a GPT2LMHeadModel save_pretrained folder), 'megatron DIR' (a Megatron-LM "
                        "checkpoint root or iter_* folder, torch_dist or legacy) or a tnlg checkpoint")
    parser.add_argument("--to", dest="dst", nargs="+", required=True, metavar="DST",
                        help="'hf DIR' (GPT-2 format, safetensors), 'megatron DIR' (a new Megatron-LM checkpoint "
                        "root) or a new tnlg checkpoint directory")
    parser.add_argument("--tokenizer-model", help="with --from hf: the tokenizer to record in the checkpoint; with "
                        "--to hf: the tokenizer to write into the folder instead of the checkpoint's recorded one "
                        "(SentencePiece .model, a folder with GPT-2 vocab.json + merges.txt, or 'builtin')")
    parser.add_argument("--no-tokenizer", action="store_true", help="with --to hf: write the weights and config "
                        "only, without the checkpoint's tokenizer")
    parser.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int,
                        help="TP size of the written checkpoint (default: the source's; 1 from hf or megatron; "
                        "with --to megatron: Megatron's TP, which sets its vocabulary padding)")
    parser.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int,
                        help="with --to megatron: pipeline stages of the written checkpoint (default 1); a tnlg "
                        "checkpoint needs none (it loads at any --pp)")
    parser.add_argument("--format", dest="ckpt_format", choices=["torch_dist", "legacy"],
                        help="with --to megatron: Megatron's --ckpt-format torch_dist (default) or the legacy "
                        "per-rank files (--ckpt-format torch)")
    parser.add_argument("--vocab-size", type=int, help="with --from megatron: the tokenizer's real vocabulary size, "
                        "to drop Megatron's padding rows (default: from the saved args' tokenizer when they say, "
                        "else the padded size)")
    parser.add_argument("--with-optimizer", action="store_true", help="with --from megatron: also convert the "
                        "Adam state (moments, fp32 master of a 16-bit run, step count) of the non-distributed "
                        "optimizer (torch_dist or legacy) or of the distributed one saved in torch_dist with "
                        "--dist-ckpt-optim-fully-reshardable; without it training starts fresh Adam moments, the "
                        "LR schedule at the checkpoint's position")


_FOREIGN = ("hf", "megatron")


def _endpoint(values: list[str], flag: str) -> tuple[str, str]:
    if len(values) == 2 and values[0] in _FOREIGN:
        return values[0], values[1]
    if len(values) == 1 and values[0] not in _FOREIGN:
        return "ckpt", values[0]
    raise UserError(f"{flag} takes 'hf DIR' (a Hugging Face folder), 'megatron DIR' (a Megatron-LM checkpoint) or "
                    f"one tnlg checkpoint directory, got {' '.join(values)!r}.")


def _fresh_destination(path: str) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UserError(f"destination {path!r} already exists and is not empty; choose a new directory "
                        f"(nothing is overwritten).")


def run(args: argparse.Namespace) -> int:
    if args.command == "checkpoint":
        if getattr(args, "checkpoint_command", None) != "info":
            raise UserError("tnlg checkpoint needs an action: tnlg checkpoint info CKPT.")
        return info(args.path, as_json=args.json)
    src_kind, src = _endpoint(args.src, "--from")
    dst_kind, dst = _endpoint(args.dst, "--to")
    if args.tp is not None and args.tp < 1:
        raise UserError(f"--tensor-model-parallel-size must be a positive integer, got {args.tp}.")
    if src_kind != "ckpt" and dst_kind != "ckpt":
        raise UserError(f"--from {src_kind} --to {dst_kind} converts nothing directly; one side must be a tnlg "
                        "checkpoint (convert through one).")
    _check_megatron_flags(args, src_kind, dst_kind)
    if args.tokenizer_model and src_kind not in _FOREIGN and dst_kind != "hf":
        raise UserError("--tokenizer-model is for --from hf, --from megatron or --to hf; a tnlg checkpoint already "
                        "records its tokenizer, and resharding keeps it.")
    if getattr(args, "no_tokenizer", False) and (dst_kind != "hf" or args.tokenizer_model):
        raise UserError("--no-tokenizer is for --to hf, without --tokenizer-model: it writes the weights and config "
                        "only.")
    if dst_kind == "hf" and args.tp is not None:
        raise UserError("--tensor-model-parallel-size applies to a tnlg or Megatron destination, not to --to hf.")
    _fresh_destination(dst)
    if "megatron" in (src_kind, dst_kind):
        out = _megatron(args, src_kind, src, dst)
    elif src_kind == "hf":
        out = hf_to_checkpoint(src, dst, tokenizer_model=args.tokenizer_model, tp_size=args.tp or 1)
    elif dst_kind == "hf":
        out = checkpoint_to_hf(src, dst, tokenizer_model=args.tokenizer_model,
                               with_tokenizer=not getattr(args, "no_tokenizer", False))
        if not getattr(args, "no_tokenizer", False) and not os.path.isfile(os.path.join(out, "tokenizer.json")):
            print(f"note: the checkpoint records no tokenizer, so {out!r} holds none and AutoTokenizer cannot load "
                  "it; pass --tokenizer-model to add one.", file=sys.stderr)
    else:
        out = reshard_checkpoint(src, dst, args.tp)
    print(f"wrote {out}")
    return 0


_PP_ANY = (": a tnlg checkpoint is one layout for every pipeline split (a run loads each parameter by name from "
           "whichever file holds it), so the checkpoint written here loads as it is at any --pp (tnlg pretrain or "
           "tnlg eval --pp P --load CKPT), and that run's first save writes its own stage files")


def _check_megatron_flags(args: argparse.Namespace, src_kind: str, dst_kind: str) -> None:
    """The Megatron-only flags, where they apply."""
    given = lambda name: getattr(args, name, None) not in (None, False)  # noqa: E731
    for name, flag, which, kind in (("pp", "--pipeline-model-parallel-size", "--to megatron", dst_kind),
                                    ("ckpt_format", "--format", "--to megatron", dst_kind),
                                    ("vocab_size", "--vocab-size", "--from megatron", src_kind),
                                    ("with_optimizer", "--with-optimizer", "--from megatron", src_kind)):
        if given(name) and kind != "megatron":
            why = _PP_ANY if name == "pp" and dst_kind == "ckpt" else ""
            raise UserError(f"{flag} applies to {which} only{why}.")
    if given("vocab_size") and args.tokenizer_model:
        raise UserError("--vocab-size and --tokenizer-model both give the vocabulary size; pass one.")
    for name, flag in (("vocab_size", "--vocab-size"), ("pp", "--pipeline-model-parallel-size")):
        if given(name) and args.__dict__[name] < 1:
            raise UserError(f"{flag} must be a positive integer, got {args.__dict__[name]}.")


def _megatron(args: argparse.Namespace, src_kind: str, src: str, dst: str) -> str:
    from .interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint
    if src_kind == "megatron":
        tok = load_tokenizer(args.tokenizer_model) if args.tokenizer_model else None
        return megatron_to_checkpoint(src, dst, tp_size=args.tp or 1, vocab_size=getattr(args, "vocab_size", None),
                                      tokenizer=tok, with_optimizer=bool(getattr(args, "with_optimizer", False)))
    return checkpoint_to_megatron(src, dst, fmt=getattr(args, "ckpt_format", None) or "torch_dist",
                                  tp=args.tp or 1, pp=getattr(args, "pp", None) or 1)


# --------------------------------------------------------------------------- writing offline

def _write_offline(dst: str, meta: dict, cfg: GPTConfig, tp_size: int, shard_of_rank, rng_of_rank=None) -> str:
    """Write a checkpoint for ``tp_size`` virtual TP ranks (DP 1): see
    :func:`tnlg.checkpoint.saving.write_offline`."""
    return write_offline(dst, dict(meta, config=cfg.to_dict()), tp_size, shard_of_rank, rng_of_rank)


def hf_to_checkpoint(hf_dir: str, dst: str, tokenizer_model=None, tp_size: int = 1) -> str:
    """A ``GPT2LMHeadModel`` folder -> a tnlg checkpoint (iteration 0, weights only) at TP ``tp_size``."""
    hf = _load_hf_model(hf_dir)
    cfg = config_from_hf(hf.config)
    full = hf_to_tnlg_state_dict(hf.state_dict(), cfg)
    tok = None
    if tokenizer_model:
        tok = load_tokenizer(tokenizer_model)
        if tok.vocab_size > cfg.vocab_size:
            raise UserError(f"--tokenizer-model {tokenizer_model!r} has {tok.vocab_size} tokens but the model's "
                            f"vocabulary has {cfg.vocab_size}; it is not this model's tokenizer.")
    dtype = next(iter(full.values())).dtype
    meta = dict(format=FORMAT, iteration=0, consumed_samples=0, config=cfg.to_dict(), options={}, data=None,
                tokenizer=None if tok is None else tok.describe(),
                layout=dict(param_dtype=str(dtype).replace("torch.", "")), optimizer=dict(present=False),
                schedule=None, converted_from=dict(hf=os.path.abspath(hf_dir)), torch=torch.__version__)

    def shard(r, names):
        targets = targets_for(cfg, tp_size, r)
        return {n: slice_full(full[n], targets[n]) for n in names}, None

    return _write_offline(dst, meta, cfg, tp_size, shard)


def _source(path: str) -> tuple[str, dict, GPTConfig]:
    iter_dir = F.resolve(path, "--from")
    if iter_dir is None:
        raise UserError(f"--from {path!r} holds no tnlg checkpoint (no {F.LATEST} and no iter_* directory).")
    meta = F.read_meta(iter_dir)
    F.check_files(iter_dir, meta)
    return iter_dir, meta, GPTConfig.from_dict(meta["config"])


def checkpoint_to_hf(path: str, hf_dir: str, tokenizer_model=None, with_tokenizer: bool = True) -> str:
    """A tnlg checkpoint -> a new Hugging Face GPT-2 folder (safetensors), written atomically
    (:func:`tnlg.hf.write_hf_folder`). With ``with_tokenizer``, the tokenizer ``tokenizer_model``,
    else the checkpoint's recorded one (if any), rides along as ``tokenizer.json`` & co., and its
    end-of-document id is the config's ``bos_token_id``/``eos_token_id``."""
    iter_dir, meta, cfg = _source(path)
    tok = _export_tokenizer(meta, cfg, tokenizer_model) if with_tokenizer else None
    files = None if tok is None else hf_tokenizer_files(tok, cfg.seq_length)  # checked before reading weights
    reader = ShardReader(iter_dir, meta, F.model_file)
    full = {n: reader.tensor(n, n, t) for n, t in full_targets(meta).items()}
    hf = build_hf_model(full, cfg, None if tok is None else tok.eod_id, where=f"checkpoint {iter_dir!r}")
    return write_hf_folder(hf, hf_dir, files)


def _export_tokenizer(meta: dict, cfg: GPTConfig, tokenizer_model=None):
    """The tokenizer an exported folder carries: ``tokenizer_model``, else the checkpoint's, else ``None``."""
    spec = tokenizer_model or meta.get("tokenizer")
    if not spec:
        return None
    try:
        tok = load_tokenizer(spec)
    except UserError as err:
        flag = "--tokenizer-model" if tokenizer_model else "the checkpoint's tokenizer"
        raise UserError(f"{flag}: {err} The Hugging Face folder carries the tokenizer: pass --tokenizer-model with "
                        "its files, or --no-tokenizer to write the weights alone.") from None
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer {tok!r} has {tok.vocab_size} tokens but the model's vocabulary has "
                        f"{cfg.vocab_size}; it is not this model's tokenizer.")
    return tok


def reshard_checkpoint(path: str, dst: str, tp_size=None) -> str:
    """Rewrite a checkpoint's shards for TP ``tp_size`` (weights, optimizer, RNG of DP rank 0)."""
    iter_dir, meta, cfg = _source(path)
    src_tp = int(meta["layout"]["tp"])
    tp_size = tp_size or src_tp
    try:
        cfg.check_tensor_parallel(tp_size)
    except ValueError as exc:
        raise UserError(f"--tensor-model-parallel-size {tp_size}: {exc}") from None

    def shard(r, names):
        return read_states(iter_dir, meta, cfg, tp_size, r, names=names)

    rng_of_rank = None
    if meta.get("rng"):
        stage = F.stage_tag(0, int(meta["layout"].get("pp", 1)))  # the first stage's (PP 1 is written)
        base = torch.load(os.path.join(iter_dir, F.rng_file(0, 0, stage)), weights_only=True)

        def rng_of_rank(r):
            if tp_size == src_tp and stage is None:  # same TP: every TP rank keeps its dropout stream
                return torch.load(os.path.join(iter_dir, F.rng_file(0, r)), weights_only=True)
            return dict(base, tp=None, tp_device=None)  # reseeded on load

    meta = dict(meta, converted_from=dict(checkpoint=os.path.abspath(iter_dir), tp=src_tp))
    return _write_offline(dst, meta, cfg, tp_size, shard, rng_of_rank)


# --------------------------------------------------------------------------- info

def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def info(path: str, as_json: bool = False, out=None) -> int:
    """Print a checkpoint's iteration, layout, config, tokenizer and file sizes."""
    out = out or sys.stdout
    iter_dir = F.resolve(path, "checkpoint")
    if iter_dir is None:
        raise UserError(f"{path!r} holds no tnlg checkpoint (no {F.LATEST} and no iter_* directory).")
    meta = F.read_meta(iter_dir)
    root = os.path.dirname(iter_dir)
    iterations = F.list_iterations(root)
    sizes = {name: os.path.getsize(os.path.join(iter_dir, name)) if os.path.isfile(os.path.join(iter_dir, name))
             else None for name in meta["files"]}
    if as_json:
        print(json.dumps(dict(meta, path=iter_dir, iterations=iterations, sizes_on_disk=sizes), indent=1), file=out)
        return 0
    cfg, lay, opt = meta["config"], meta.get("layout", {}), meta.get("optimizer", {})
    n_params = sum(int(torch.Size(r["shape"]).numel()) for r in meta["params"].values())
    by_kind: dict[str, int] = {}
    for name, size in meta["files"].items():
        by_kind[name.split("_")[0]] = by_kind.get(name.split("_")[0], 0) + size
    bad = [n for n, s in sizes.items() if s != meta["files"][n]]
    lines = [
        f"checkpoint   {iter_dir}",
        f"iterations   {iterations} in {root} (latest pointer: {F.read_latest(root)})",
        f"iteration    {meta['iteration']} ({meta['consumed_samples']} samples consumed)",
        f"layout       {'PP=' + str(lay['pp']) + ' x ' if lay.get('pp') else ''}TP={lay.get('tp')} x "
        f"DP={lay.get('dp')} ({lay.get('world')} processes), parameters "
        f"{lay.get('param_dtype')}" + (f"; converted from {meta['converted_from']}" if meta.get("converted_from")
                                       else ""),
        f"model        {n_params:,} parameters: " + ", ".join(
            f"{k}={cfg[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                      "ffn_hidden_size", "vocab_size", "hidden_dropout", "attention_dropout")),
        "optimizer    " + (f"AdamW state, step {opt['num_steps']}, "
                           + ("converted from Megatron-LM" if opt.get("converted") else
                              f"saved at ZeRO stage {opt.get('zero_stage')}")
                           + (f", loss scale {opt['loss_scaler']['scale']}" if opt.get("loss_scaler") else "")
                           if opt.get("present") else "none (weights only)"),
        "tokenizer    " + (f"{meta['tokenizer'].get('kind')} "
                            f"{meta['tokenizer'].get('path') or meta['tokenizer'].get('vocab_file')} "
                            f"(vocab {meta['tokenizer'].get('vocab_size')})" if meta.get("tokenizer") else "none"),
    ]
    if meta.get("pipeline"):
        lines.insert(4, f"pipeline     {describe_stages(meta)}")
    if meta.get("data"):
        lines.append(f"data         {[f['prefix'] for f in meta['data']['files']]}, split "
                     f"{meta['options'].get('split')}, seed {meta['options'].get('seed')}")
    if meta.get("schedule"):
        s = meta["schedule"]
        shape = (f"{s['decay_style']} {s['max_lr']} -> {s['min_lr']}, warmup {s['warmup_iters']}, decay until step "
                 f"{s['decay_iters']}, " if s.get("max_lr") is not None else "")
        lines.append(f"lr schedule  {shape}at step {s.get('num_steps')}")
    lines.append(f"files        {len(meta['files'])}, {_mib(sum(meta['files'].values()))}: "
                 + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(by_kind.items())))
    if bad:
        lines.append(f"DAMAGED      {len(bad)} file(s) missing or of the wrong size: {bad[:4]}")
    print("\n".join(lines), file=out)
    return 1 if bad else 0
