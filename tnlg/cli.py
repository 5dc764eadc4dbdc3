"""The ``tnlg`` command: one entry point, one subcommand per job.

Subcommands live in their own modules under :mod:`tnlg.commands` and are imported only when
used. Every one is torch-free at import (its heavy imports are inside ``run``), so ``tnlg
--help`` and ``tnlg COMMAND --help`` answer without importing torch. Each module provides
``add_arguments(parser)`` and ``run(args) -> int``, and may provide ``preflight(args)`` (checks
made before ``run``) and ``hang_resume(args)`` (a hung collective is then reported as one
message with the command that resumes the run, :mod:`tnlg.runtime.hang`); user mistakes raise
:class:`tnlg.errors.UserError`, printed as one paragraph on stderr with exit
status 2 (no traceback), once for the whole job whichever rank raised it, and a
job of several processes stops at once (:mod:`tnlg.runtime.failures`). Bare ``tnlg``
prints this help; ``tnlg pretrain`` runs the built-in job.

Flags must be spelled out: abbreviations (``--train-iter`` for
``--train-iters``) are refused on every parser. A parse error is one line naming
the subcommand, with the closest valid flags (or subcommands) of a mistyped one
(``did you mean --hidden-size?``), then one line pointing to its ``--help``:
never the whole usage block.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys

from .errors import UserError, closest
from .runtime.failures import arm, is_agreed, report, stopped_by_peer
from .runtime.launch import under_launcher
from .runtime.orphans import end_with_launcher
from .runtime.process_exit import destroy_process_groups, leave
from .runtime.threads import set_wait_policy

# name -> (module with run(), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "pretrain": ("tnlg.commands.pretrain",
                 "pretrain a GPT: TP x PP x DP with ZeRO 0-3 (no other arguments: the built-in small job)"),
    "finetune": ("tnlg.commands.finetune", "fine-tune a pretrained model (tnlg, Hugging Face or Megatron-LM) on "
                                           "prompt/completion or chat rows, the loss on the completions"),
    "demo": ("tnlg.commands.demo", "tensor-parallel demo: per-rank shards checked against one process"),
    "plan": ("tnlg.commands.plan", "memory, FLOPs and layout planner (ZeRO stages, activations, --search)"),
    "train-tokenizer": ("tnlg.commands.data", "train a SentencePiece BPE tokenizer (exact round trip by default)"),
    "preprocess": ("tnlg.commands.data", "tokenize .jsonl/.txt, Parquet or `datasets` folders into Megatron .bin/.idx files"),
    "data": ("tnlg.commands.data", "built-in corpus (prepare) and .bin/.idx checks (info)"),
    "convert": ("tnlg.commands.convert",
                "convert Hugging Face GPT-2 and Megatron-LM <-> tnlg checkpoints; reshard a checkpoint offline"),
    "checkpoint": ("tnlg.commands.convert", "checkpoint tools: info (iteration, layout, config, sizes)"),
    "eval": ("tnlg.commands.eval", "zero-shot evaluation: WikiText perplexity, LAMBADA accuracy, dataset loss, "
                                   "perplexity of text files (text), generation scored with ROUGE, exact "
                                   "match and F1 (generate), lm-evaluation-harness tasks (lm-eval)"),
    "generate": ("tnlg.commands.generate", "TP x PP text generation with a KV cache (greedy, top-k, top-p)"),
    "serve": ("tnlg.commands.serve", "an OpenAI-compatible HTTP server (completions, chat, streaming) and a chat "
                                     "page, at any TP x PP"),
}


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations, whose errors are one line and a pointer to
    ``--help``. Subparsers (also nested ones that a command adds itself) are of this class too:
    ``add_subparsers`` uses the parent's class. ``argv``: the command line being parsed (set by
    :func:`main`), where a parser that misses a required argument looks for a mistyped flag first."""

    argv: list[str] = []

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Exit 2 with ``PROG: error: MESSAGE`` (the closest choices of an invalid one) and the hint. A
        missing required argument is reported as the mistyped flag that probably meant it, if any."""
        unknown = [x for x in self.argv if _is_flag(x) and x.split("=")[0] not in self._option_string_actions]
        if message.startswith("the following arguments are required") and unknown:
            return self.unrecognized(unknown)
        m = re.match(r"argument (.*): invalid choice: '([^']*)'", message)
        if m:
            choices = next((a.choices for a in self._actions if a.choices
                            and argparse._get_action_name(a) == m.group(1)), ())
            message += _did_you_mean({m.group(2): [str(c) for c in choices]})
        self.exit(2, f"{self.prog}: error: {message}\nRun `{self.prog} --help` for its options.\n")

    def unrecognized(self, extra: list[str]):
        """Report arguments no parser took, each mistyped flag with the closest of this parser's flags."""
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        self.error(f"unrecognized argument{'s' if len(extra) > 1 else ''}: {' '.join(extra)}"
                   + _did_you_mean({x.split("=")[0]: flags for x in extra if _is_flag(x)}))


def _is_flag(word: str) -> bool:
    return re.match(r"--?[A-Za-z]", word) is not None


def _did_you_mean(words: dict[str, list[str]]) -> str:
    """``"; did you mean X?"`` with the valid names closest to each word (:func:`tnlg.errors.closest`);
    several words name theirs (``X for Y``)."""
    found = {word: " or ".join(close) for word, valid in words.items() for close in [closest(word, valid)] if close}
    if not found:
        return ""
    if len(found) == 1:
        return f"; did you mean {next(iter(found.values()))}?"
    return "; did you mean " + ", ".join(f"{v} for {w}" for w, v in found.items()) + "?"


def build_parser(only: str | None = None) -> Parser:
    parser = Parser(prog="tnlg", description="Megatron-style tensor parallelism + ZeRO for GPT pretraining.",
                    epilog="Run `tnlg COMMAND --help` for a command's options; `tnlg pretrain` alone runs the "
                           "built-in small job.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == only:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser that parsed the last chosen (sub)command, to report an error with its usage."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = next((a.choices[getattr(args, a.dest)] for a in actions
                       if getattr(args, a.dest, None) in a.choices), None)
        if chosen is None:
            return parser
        parser = chosen


def _finish(status: int) -> int:
    """End a command cleanly: its process groups destroyed; a launched worker then exits at once.

    A launched worker (``torchrun``, ``--nproc-per-node``) leaves through
    :func:`tnlg.runtime.process_exit.leave`, which says why.
    """
    if under_launcher():
        leave(status)
    destroy_process_groups()
    return status


def main(argv: list[str] | None = None) -> int:
    set_wait_policy()  # before torch loads libgomp: OpenMP threads that do not spin a busy machine's cores away
    end_with_launcher()  # a launched worker: it ends when its launcher dies, even by SIGKILL (tnlg.runtime.orphans)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # bare `tnlg`: what is there, not a 300-iteration job
        build_parser().print_help()
        return 0
    name = argv[0] if argv[0] in COMMANDS else None
    parser = build_parser(only=name)
    Parser.argv = argv
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser, with the closest valid flags (exits 2)
        innermost = _innermost(parser, args)
        assert isinstance(innermost, Parser)  # (subparsers are made by add_subparsers: the parent's class)
        innermost.unrecognized(extra)
    if args.command is None:
        parser.print_help()
        return 2
    arm(args.command)
    command = importlib.import_module(COMMANDS[args.command][0])
    try:
        if hasattr(command, "preflight"):
            command.preflight(args)
        status = int(command.run(args) or 0)
        return _finish(status)
    except UserError as err:  # whichever rank raised it: printed once (tnlg.runtime.failures)
        return _failed(report(args.command, str(err), 2, is_agreed(err)))
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        return _failed(report(args.command, _disk_full(err), 2, False))  # a write no closer handler took
    except RuntimeError as err:
        agreed_status = getattr(err, "tnlg_status", None)
        if agreed_status is not None:  # a stop every rank agreed on (a diverged loss)
            return _failed(report(args.command, str(err), agreed_status, is_agreed(err)))
        peer = stopped_by_peer()  # this rank's collective failed because another rank failed and said so
        if peer is not None:
            return _failed(peer)
        if not hasattr(command, "hang_resume"):  # a hung collective: one message naming it, no traceback per rank
            raise
        from .runtime.hang import report as report_hang
        hang_status = report_hang(err, args.command, resume=command.hang_resume(args))
        if hang_status is None:
            raise
        status = hang_status
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a worker: its group cannot be torn down (a peer is gone)
            leave(status, destroy=False)
        return status


def _disk_full(err: OSError) -> str:
    """One paragraph for a full disk met by a write that no closer handler turned into one (a save, the
    metrics, TensorBoard's events and the loss plot say more: which run output, which option moves it)."""
    from .io import stdout_name, write_failure
    try:
        sys.stdout.flush()
        what = (write_failure(err, err.filename) if err.filename
                else f"a write failed: {err.strerror} (errno {err.errno}).")
    except OSError:  # it was the log: standard output on a full disk
        what = f"the log (standard output): {write_failure(err, stdout_name())}"
    return (f"{what} The run stopped there; the checkpoints saved before are intact. Free space, then run the "
            f"same command again.")


def _failed(status: int) -> int:
    """Leave after a reported failure: a worker of several at once (a peer may sit in a collective, so its
    groups are not torn down), else return ``status``."""
    if under_launcher() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave(status, destroy=False)
    return status

if __name__ == "__main__":
    sys.exit(main())
