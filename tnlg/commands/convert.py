"""``tnlg convert`` (Hugging Face / Megatron-LM <-> tnlg checkpoints, offline resharding) and ``tnlg checkpoint info``.

* ``tnlg convert --from hf DIR --to CKPT [--tokenizer-model M] [--tensor-model-parallel-size N]``:
  a ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` or ``Qwen3ForCausalLM`` folder,
  or a mixture of experts' ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM`` or ``OlmoeForCausalLM`` (``save_pretrained``; read as
  :mod:`tnlg.interop.hf_reader` reads it: exactly the model transformers computes, or one paragraph before
  anything is written) -> a tnlg checkpoint at
  iteration 0 with no optimizer state (training from it starts a fresh
  optimizer); ``M`` is recorded as the checkpoint's tokenizer (one that is not the folder's own, by its
  tokenizer files' fingerprint, only with ``--allow-other-tokenizer``).
* ``tnlg convert --from CKPT --to hf DIR [--tokenizer-model M | --no-tokenizer]``: the model's
  Hugging Face class (GPT-2, or Llama / Qwen2 for a Llama-family checkpoint: ``config.json`` +
  ``model.safetensors``), loadable with ``AutoModelForCausalLM.from_pretrained``, plus the checkpoint's tokenizer (or ``M``) in the
  form ``AutoTokenizer.from_pretrained`` loads (docs/hf.md).
* ``tnlg convert --from CKPT --to CKPT2 --tensor-model-parallel-size N``:
  rewrite the shards for TP size N (weights and optimizer state; RNG of DP rank 0).
  Not needed to change layout (``--load`` re-slices at any TP), but it makes
  the files match the new layout.
* ``tnlg convert --from megatron DIR --to CKPT [--tp N] [--vocab-size V | --tokenizer-model M] [--with-optimizer]``:
  a Megatron-LM GPT checkpoint (``torch_dist`` or legacy, any TP x PP) -> a tnlg checkpoint with its
  iteration and LR-schedule position, and with ``--with-optimizer`` its Adam state
  (:mod:`tnlg.interop.megatron.importer`); written at PP 1, it loads at any ``--pp`` by name.
* ``tnlg convert --from CKPT --to megatron DIR [--format torch_dist|legacy] [--tp N] [--pp M] [--ep E]
  [--moe-grouped-gemm]``: a
  checkpoint Megatron-LM loads (:mod:`tnlg.interop.megatron.exporter`; docs/megatron.md), from a tnlg
  checkpoint saved at any TP x PP.
* ``tnlg checkpoint info CKPT [--json] [--verify]``: iteration, layout, config, sizes (``--verify``: every file
  against its recorded SHA-256).

All of it runs in one process, reading only the slices it needs. The work is the library's
(:mod:`tnlg.interop.hf_checkpoint`, :mod:`tnlg.interop.megatron`, :mod:`tnlg.checkpoint.offline`,
:mod:`tnlg.checkpoint.info`); this module holds the flags and their checks, and imports torch only
when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import UserError
from ..layout import add_layout_arguments, check_positive

__all__ = ["add_arguments", "run"]


# --------------------------------------------------------------------------- arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tnlg convert`` or ``tnlg checkpoint`` (told apart by ``parser.prog``)."""
    if parser.prog.split()[-1] == "checkpoint":
        return _add_checkpoint_arguments(parser)
    parser.description = (
        "Convert between Hugging Face folders (GPT-2, Llama, Qwen2, Mistral and Qwen3: GPT2LMHeadModel, "
        "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM; the mixtures of experts "
        "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM) or Megatron-LM checkpoints and tnlg checkpoints, or reshard a checkpoint offline. "
        "--to hf writes the checkpoint's own family (a Llama-family checkpoint: Llama, or Qwen2 when its QKV "
        "projections have biases).\n\n"
        "  tnlg convert --from hf HF_DIR --to CKPT [--tokenizer-model M]\n"
        "  tnlg convert --from CKPT --to hf HF_DIR [--tokenizer-model M | --no-tokenizer]\n"
        "  tnlg convert --from CKPT --to CKPT2 --tensor-model-parallel-size N\n"
        "  tnlg convert --from megatron MEGATRON_DIR --to CKPT [--tp N] [--vocab-size V | --tokenizer-model M] "
        "[--with-optimizer]\n"
        "  tnlg convert --from CKPT --to megatron MEGATRON_DIR [--format torch_dist|legacy] [--tp N] [--pp M] "
        "[--ep E] [--moe-grouped-gemm]\n"
        "  tnlg convert --from CKPT --merge-lora ADAPTER_DIR --to CKPT2 [--tp N] | --to hf HF_DIR\n\n"
        "CKPT may be a checkpoint root (its latest iteration is used) or one iter_* directory. The "
        "destination must not exist or be empty: nothing is overwritten.")
    parser.add_argument("--from", dest="src", nargs="+", required=True, metavar="SRC",
                        help="'hf DIR' (a save_pretrained folder of GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
                        "MistralForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
                        "Qwen3MoeForCausalLM or OlmoeForCausalLM), 'megatron DIR' (a Megatron-LM "
                        "checkpoint root or iter_* folder, torch_dist or legacy) or a tnlg checkpoint")
    parser.add_argument("--to", dest="dst", nargs="+", required=True, metavar="DST",
                        help="'hf DIR' (the model's Hugging Face format: GPT-2, Llama, Qwen2, Mistral, Qwen3, Mixtral, Qwen2-MoE, "
                        "Qwen3-MoE or OLMoE; safetensors), 'megatron DIR' (a new Megatron-LM checkpoint "
                        "root) or a new tnlg checkpoint directory")
    parser.add_argument("--tokenizer-model", help="with --from hf: the tokenizer to record in the checkpoint; with "
                        "--to hf: the tokenizer to write into the folder instead of the checkpoint's recorded one "
                        "(SentencePiece .model, a folder with GPT-2 vocab.json + merges.txt, or 'builtin')")
    parser.add_argument("--allow-other-tokenizer", action="store_true", help="with --from hf: record "
                        "--tokenizer-model although it is not the folder's own tokenizer (its tokenizer files): a "
                        "vocabulary mapped onto the model's on purpose; a note says so")
    parser.add_argument("--no-tokenizer", action="store_true", help="with --to hf: write the weights and config "
                        "only, without the checkpoint's tokenizer")
    add_layout_arguments(parser, dict(tp=None, pp=None), help=dict(
        tp="of the written checkpoint (default: the source's; 1 from hf or megatron; with --to megatron: "
           "Megatron's TP, which sets its vocabulary padding)",
        pp="with --to megatron: of the written checkpoint (default 1); a tnlg checkpoint needs none (it loads "
           "at any --pp)"))
    _add_megatron_arguments(parser)
    parser.add_argument("--merge-lora", metavar="ADAPTER_DIR", help="with --from CKPT (the base): merge PEFT's LoRA "
                        "adapter folder (a tnlg finetune --lora-rank run's SAVE/adapter, or peft's save_pretrained) "
                        "into its weights, W + (alpha / r) B A, and write the merged model (--to a new tnlg "
                        "checkpoint, or --to hf DIR)")


def _add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tnlg convert`` that only a Megatron-LM source or destination reads."""
    parser.add_argument("--format", dest="ckpt_format", choices=["torch_dist", "legacy"],
                        help="with --to megatron: Megatron's --ckpt-format torch_dist (default) or the legacy "
                        "per-rank files (--ckpt-format torch)")
    parser.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int, help="with --to megatron "
                        "of a mixture of experts: the expert-parallel ranks whose legacy files "
                        "(mp_rank_TT[_PPP]_EEE) split the experts (default 1; torch_dist records it in the args)")
    parser.add_argument("--moe-grouped-gemm", action="store_true", help="with --to megatron --format legacy of a "
                        "mixture of experts: write each rank's experts as the legacy GroupedMLP's experts.weight1 / "
                        "weight2 (Megatron's --moe-grouped-gemm) instead of SequentialMLP's local_experts.<j>.*")
    parser.add_argument("--vocab-size", type=int, help="with --from megatron: the tokenizer's real vocabulary size, "
                        "to drop Megatron's padding rows (default: from the saved args' tokenizer when they say, "
                        "else the padded size)")
    parser.add_argument("--with-optimizer", action="store_true", help="with --from megatron: also convert the "
                        "Adam state (moments, fp32 master of a 16-bit run, step count) of the non-distributed or "
                        "the distributed optimizer (torch_dist, also in its default dp_reshardable bucket layout, "
                        "or legacy, also distrib_optim.pt); without it training starts fresh Adam moments, the "
                        "LR schedule at the checkpoint's position")


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """``tnlg checkpoint``'s actions: ``info``."""
    parser.description = "Inspect tnlg checkpoints."
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    p = sub.add_parser("info", help="iteration, layout, config, tokenizer and file sizes of a checkpoint",
                       description="Print what a checkpoint holds. CKPT is a checkpoint root (its "
                                   "latest iteration) or one iter_* directory.")
    p.add_argument("path", metavar="CKPT")
    p.add_argument("--json", action="store_true", help="print meta.json plus file sizes as JSON")
    p.add_argument("--verify", action="store_true", help="also read every file and check it against the "
                   "SHA-256 recorded when it was written (a damaged one: an error naming it, exit status 2)")


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
        from ..checkpoint.info import info
        return info(args.path, as_json=args.json, verify=args.verify)
    src_kind, src = _endpoint(args.src, "--from")
    dst_kind, dst = _endpoint(args.dst, "--to")
    if args.tp is not None:
        check_positive(tp=args.tp)
    if src_kind != "ckpt" and dst_kind != "ckpt":
        raise UserError(f"--from {src_kind} --to {dst_kind} converts nothing directly; one side must be a tnlg "
                        "checkpoint (convert through one).")
    _check_megatron_flags(args, src_kind, dst_kind)
    if args.tokenizer_model and src_kind not in _FOREIGN and dst_kind != "hf":
        raise UserError("--tokenizer-model is for --from hf, --from megatron or --to hf; a tnlg checkpoint already "
                        "records its tokenizer, and resharding keeps it.")
    _check_tokenizer_flags(args, src_kind, dst_kind)
    if dst_kind == "hf" and args.tp is not None:
        raise UserError("--tensor-model-parallel-size applies to a tnlg or Megatron destination, not to --to hf.")
    merge = getattr(args, "merge_lora", None)
    if merge is not None and (src_kind != "ckpt" or dst_kind not in ("ckpt", "hf")):
        raise UserError(f"--merge-lora merges an adapter into a tnlg checkpoint: --from CKPT, --to CKPT2 or --to hf "
                        f"DIR (not --from {src_kind} --to {dst_kind}); convert the base to a tnlg checkpoint first.")
    if merge is not None and not os.path.isdir(merge):
        raise UserError(f"--merge-lora {merge!r} is not a folder (PEFT's adapter_config.json + "
                        "adapter_model.safetensors).")
    _fresh_destination(dst)
    if merge is not None:
        if dst_kind == "hf":
            check_hf_packages("tnlg convert --merge-lora --to hf")
        from ..interop.peft import merge_lora_checkpoint
        out = merge_lora_checkpoint(src, merge, dst, dst_kind, args.tp or 1, args.tokenizer_model,
                                    not getattr(args, "no_tokenizer", False))
        print(f"wrote {out}")
        return 0
    if "hf" in (src_kind, dst_kind):
        check_hf_packages(f"tnlg convert --from {src_kind if src_kind != 'ckpt' else 'CKPT'} --to "
                          f"{dst_kind if dst_kind != 'ckpt' else 'CKPT'}")
    from ..checkpoint.offline import reshard_checkpoint
    from ..interop.hf_checkpoint import checkpoint_to_hf, hf_to_checkpoint
    if "megatron" in (src_kind, dst_kind):
        out = _megatron(args, src_kind, src, dst)
    elif src_kind == "hf":
        if args.tokenizer_model:
            _check_other_tokenizer(src, args.tokenizer_model, getattr(args, "allow_other_tokenizer", False))
        out = hf_to_checkpoint(src, dst, tokenizer_model=args.tokenizer_model, tp_size=args.tp or 1)
    elif dst_kind == "hf":
        out = checkpoint_to_hf(src, dst, tokenizer_model=args.tokenizer_model,
                               with_tokenizer=not getattr(args, "no_tokenizer", False))
        if not getattr(args, "no_tokenizer", False) and not os.path.isfile(os.path.join(out, "tokenizer.json")):
            print(f"note: the checkpoint records no tokenizer, so {out!r} holds none and AutoTokenizer cannot load "
                  "it; pass --tokenizer-model to add one.", file=sys.stderr)
    else:
        from ..model import GPT
        out = reshard_checkpoint(src, dst, args.tp, describe=GPT.describe)
    print(f"wrote {out}")
    return 0


def _check_tokenizer_flags(args: argparse.Namespace, src_kind: str, dst_kind: str) -> None:
    """One paragraph for ``--allow-other-tokenizer`` or ``--no-tokenizer`` where the conversion has no use for it."""
    if getattr(args, "allow_other_tokenizer", False) and (src_kind != "hf" or not args.tokenizer_model):
        raise UserError("--allow-other-tokenizer is for --from hf DIR with --tokenizer-model: it records that "
                        "tokenizer although the folder ships another. Drop it, or name the tokenizer.")
    if getattr(args, "no_tokenizer", False) and (dst_kind != "hf" or args.tokenizer_model):
        raise UserError("--no-tokenizer is for --to hf, without --tokenizer-model: it writes the weights and config "
                        "only.")


def _check_other_tokenizer(src: str, tokenizer_model: str, allow: bool) -> None:
    """``--tokenizer-model`` against the tokenizer files of the Hugging Face folder ``src``: another one is
    refused before anything is written, or with ``--allow-other-tokenizer`` noted on stderr."""
    from ..data.fingerprint import check_recorded
    from ..data.tokenizer import load_tokenizer
    from ..generation.loading import model_tokenizers
    own, whose = model_tokenizers(src)
    note = check_recorded(own, load_tokenizer(tokenizer_model), f"--from hf {src!r}", allow=allow, whose=whose,
                          after="Nothing was written.")
    if note:
        print(note, file=sys.stderr)


HF_PACKAGES = ("transformers", "tokenizers")
HF_INSTALL = 'pip install "transformers>=4.40" "tokenizers>=0.15"'


def check_hf_packages(what: str) -> None:
    """A Hugging Face folder is read and written through ``transformers`` (whose model classes need
    ``tokenizers`` to import) and its tokenizer written with ``tokenizers``: optional packages, not in the
    base install. Refused in one paragraph naming the install command, before anything is read or written."""
    import importlib.util
    missing = [name for name in HF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"{what} needs the optional package(s) {' and '.join(missing)}, which are not installed "
                        f"(a Hugging Face folder is read and written through transformers, and its tokenizer with "
                        f"tokenizers): {HF_INSTALL}. Nothing was written.")


_PP_ANY = (": a tnlg checkpoint is one layout for every pipeline split (a run loads each parameter by name from "
           "whichever file holds it), so the checkpoint written here loads as it is at any --pp (tnlg pretrain or "
           "tnlg eval --pp P --load CKPT), and that run's first save writes its own stage files")


def _check_megatron_flags(args: argparse.Namespace, src_kind: str, dst_kind: str) -> None:
    """The Megatron-only flags, where they apply."""
    given = lambda name: getattr(args, name, None) not in (None, False)  # noqa: E731
    for name, flag, which, kind in (("pp", "--pipeline-model-parallel-size", "--to megatron", dst_kind),
                                    ("ckpt_format", "--format", "--to megatron", dst_kind),
                                    ("ep", "--expert-model-parallel-size", "--to megatron", dst_kind),
                                    ("moe_grouped_gemm", "--moe-grouped-gemm", "--to megatron", dst_kind),
                                    ("vocab_size", "--vocab-size", "--from megatron", src_kind),
                                    ("with_optimizer", "--with-optimizer", "--from megatron", src_kind)):
        if given(name) and kind != "megatron":
            why = _PP_ANY if name == "pp" and dst_kind == "ckpt" else ""
            raise UserError(f"{flag} applies to {which} only{why}.")
    if given("vocab_size") and args.tokenizer_model:
        raise UserError("--vocab-size and --tokenizer-model both give the vocabulary size; pass one.")
    if given("vocab_size") and args.vocab_size < 1:
        raise UserError(f"--vocab-size must be a positive integer, got {args.vocab_size}.")
    if given("pp"):
        check_positive(pp=args.pp)


def _megatron(args: argparse.Namespace, src_kind: str, src: str, dst: str) -> str:
    from ..data.tokenizer import load_tokenizer
    from ..interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint
    if src_kind == "megatron":
        tok = load_tokenizer(args.tokenizer_model) if args.tokenizer_model else None
        return megatron_to_checkpoint(src, dst, tp_size=args.tp or 1, vocab_size=getattr(args, "vocab_size", None),
                                      tokenizer=tok, with_optimizer=bool(getattr(args, "with_optimizer", False)))
    return checkpoint_to_megatron(src, dst, fmt=getattr(args, "ckpt_format", None) or "torch_dist",
                                  tp=args.tp or 1, pp=getattr(args, "pp", None) or 1,
                                  ep=getattr(args, "ep", None) or 1,
                                  grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))
