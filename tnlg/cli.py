"""The ``tnlg`` command: one entry point, one subcommand per job.

Subcommands live in their own modules and are imported only when used, so
``tnlg --help`` is fast. Each module provides ``add_arguments(parser)`` and
``run(args) -> int``; user mistakes raise :class:`tnlg.errors.UserError`,
printed as one paragraph on stderr with exit status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import UserError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "pretrain": ("tnlg.train", "pretrain a GPT: TP x DP with ZeRO (no arguments: the built-in small job)"),
    "demo": ("tnlg.demo", "tensor-parallel demo: per-rank shards checked against one process"),
    "plan": ("tnlg.plan", "memory, FLOPs and layout planner (ZeRO stages, activations, --search)"),
    "train-tokenizer": ("tnlg.data.cli", "train a SentencePiece BPE tokenizer (exact round trip by default)"),
    "preprocess": ("tnlg.data.cli", "tokenize .jsonl/.txt into Megatron .bin/.idx files"),
    "data": ("tnlg.data.cli", "built-in corpus (prepare) and .bin/.idx checks (info)"),
    "convert": ("tnlg.convert", "convert Hugging Face GPT-2 <-> tnlg checkpoints; reshard a checkpoint offline"),
    "checkpoint": ("tnlg.convert", "checkpoint tools: info (iteration, layout, config, sizes)"),
    "eval": ("tnlg.eval.cli", "zero-shot evaluation: WikiText perplexity, LAMBADA accuracy, dataset loss"),
    "generate": ("tnlg.generate", "tensor-parallel text generation with a KV cache (greedy, top-k, top-p)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tnlg", description="Megatron-style tensor parallelism + ZeRO for GPT pretraining.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == only:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["pretrain"] if "pretrain" in COMMANDS else ["demo"]
    name = argv[0] if argv[0] in COMMANDS else None
    args = build_parser(only=name).parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except UserError as err:
        if os.environ.get("RANK", "0") == "0":  # under a launcher, one rank speaks for all
            print(f"tnlg {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
