"""What ``tnlg eval`` and ``tnlg generate`` share: their common flags and their processes.

* :func:`add_common_arguments` - checkpoint, tokenizer, adapter (:func:`add_model_arguments`, serve's too), layout and launch flags (torch-free, for ``--help``).
* :func:`precheck_model` - what those flags name, checked before any process starts (the note of
  ``--allow-other-tokenizer`` said once).
* :func:`launch_or_init` - under ``torchrun`` join the job; with ``--nproc-per-node N``
  relaunch the same command on N local processes (:func:`tnlg.runtime.launch.relaunch`);
  else run in this process.
* :func:`run_command` - the above, then ``work(ps)`` on every rank and the result printed by rank 0.

Torch is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Callable, Optional

from ..layout import ParallelDims, World, add_layout_arguments, check_positive
from ..options.pipeline import check_stage_count
from ..runtime.launch import check_nodes, join, launcher_world_size, relaunch

if TYPE_CHECKING:
    from ..parallel.state import ParallelState

def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What generate, eval and serve load: ``--checkpoint`` (``--load``), ``--tokenizer-model`` and ``--load-adapter``."""
    p.add_argument("--checkpoint", "--load", dest="checkpoint", required=True, metavar="CKPT",
                   help="a Hugging Face folder tnlg reads (GPT-2, Llama, Qwen2, Mistral, Qwen3 and their mixtures of "
                        "experts; its tokenizer files give the tokenizer) or a tnlg checkpoint folder; resharded to "
                        "the TP x PP asked for")
    p.add_argument("--tokenizer-model", metavar="M",
                   help="the tokenizer when the checkpoint names none (a SentencePiece .model, a folder with "
                        "GPT-2 vocab.json + merges.txt, a tokenizer.json, or 'builtin'); one that is not the model's "
                        "own (a checkpoint's record, a Hugging Face folder's files) is refused unless "
                        "--allow-other-tokenizer")
    p.add_argument("--allow-other-tokenizer", action="store_true",
                   help="use --tokenizer-model although it is not the model's own tokenizer (a vocabulary mapped "
                        "onto the model's on purpose); a note says so")
    p.add_argument("--load-adapter", metavar="DIR",
                   help="PEFT's LoRA adapter folder (adapter_config.json + adapter_model.safetensors: peft's "
                        "save_pretrained, or SAVE/adapter of tnlg finetune --lora-rank) of the checkpoint's model, "
                        "merged into its weights at load (W + alpha/r B A, each rank its shard)")


def precheck_model(args, needs_tokenizer: bool = True):
    """:func:`tnlg.generation.loading.precheck_checkpoint` of what :func:`add_model_arguments` declares, its
    note (a tokenizer other than the model's, allowed) printed once for the job, on stderr (stdout may be
    ``--json``). Returns the loaded ``--tokenizer-model``, or ``None``."""
    from ..generation.loading import precheck_checkpoint
    from ..runtime.launch import speaks_for_job
    notes: list = []
    tokenizer = precheck_checkpoint(args.checkpoint, args.tokenizer_model, needs_tokenizer, args.load_adapter,
                                    allow_other_tokenizer=getattr(args, "allow_other_tokenizer", False), notes=notes)
    if notes and speaks_for_job():
        print("\n".join(notes), file=sys.stderr, flush=True)
    return tokenizer


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_layout_arguments(p, dict(tp=1, pp=1, nproc=None), metavar=dict(tp="N", pp="P", nproc="N"), help=dict(
        tp="default 1; must divide the number of processes",
        pp="default 1; the layers split as evenly as possible over P stages, each holding its layers' weights "
           "and KV cache; P x TP must divide the processes",
        nproc="default: TP x PP; the extra factor is data parallelism"))
    p.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="nodes of the job, each running this command with --nproc-per-node (default 1); needs "
                        "--rdzv-endpoint")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="with --nnodes: where the nodes meet; the node named HOST serves it on exactly that "
                        "address (default: one node, the launcher listens on 127.0.0.1 only)")
    p.add_argument("--micro-batch-size", type=int, default=8, metavar="B",
                   help="sequences per forward pass (default 8)")
    p.add_argument("--json", action="store_true",
                   help="print exactly one JSON object on stdout (from rank 0) instead of a table")


def launch_or_init(command: str, add_arguments, args) -> tuple[Optional[int], Optional["ParallelState"]]:
    """``(exit status, None)`` after launching ``--nproc-per-node`` local processes, or
    ``(None, ps)`` to run here: under torchrun/elastic (joining its process group) or as
    the only process (CUDA when available). The layout (TP, PP against the processes and the
    checkpoint's layers) is checked first, before any process starts."""
    cp = getattr(args, "cp", 1)
    check_positive(tp=args.tp, pp=args.pp, cp=cp)
    import torch

    from ..generation.loading import checkpoint_num_layers
    from ..parallel.state import ParallelState
    layers = checkpoint_num_layers(args.checkpoint)
    if layers is not None:
        check_stage_count(args.pp, layers)
    world = launcher_world_size()
    if world is None:
        nproc = args.nproc_per_node or args.tp * args.pp * cp
        check_positive(nproc=nproc)
        ParallelDims.of(World(nproc, f"--nproc-per-node {nproc}"), args.tp)  # a TP group on one node
        nodes = f" (--nproc-per-node {nproc} x --nnodes {args.nnodes})" if args.nnodes > 1 else ""
        ParallelDims.of(World(nproc * args.nnodes, f"the {nproc * args.nnodes} processes{nodes}"), args.tp,
                        args.pp, cp)
        check_nodes(args.nnodes, args.rdzv_endpoint)
        if nproc > 1 and sys.stderr.isatty():
            print(f"tnlg {command}: starting {nproc} processes (each imports torch, then joins the others) ...",
                  file=sys.stderr, flush=True)
        status = relaunch(command, add_arguments, args, nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint)
        if status is not None:
            return status, None
        return None, ParallelState.single("cuda" if torch.cuda.is_available() else "cpu")
    ParallelDims.of(World.processes(world, " torchrun started"), args.tp, args.pp, cp)
    return None, join(args.tp, pipeline_parallel_size=args.pp, context_parallel_size=cp)


def run_command(command: str, add_arguments, args, work: Callable[["ParallelState"], dict],
                show: Callable[[dict], None]) -> int:
    """Launch or join the ranks, run ``work(ps)`` on every rank, then on rank 0 print the result:
    exactly one JSON object with ``--json``, else ``show(result)``. An error is raised on the rank
    that has it; :mod:`tnlg.runtime.failures` (through :func:`tnlg.cli.main`) reports it once for the job and
    stops the other ranks: one every rank raised alike (a checkpoint that cannot be loaded) is
    printed by rank 0, one rank's own error names that rank."""
    from ..parallel.state import destroy_parallel, is_distributed
    try:
        status, ps = launch_or_init(command, add_arguments, args)
    except KeyboardInterrupt:
        return interrupted(command, None)
    if status is not None:
        return status
    assert ps is not None  # (launch_or_init gives a status or this rank's state)
    try:
        result = work(ps)
    except KeyboardInterrupt:
        return interrupted(command, ps)
    except BaseException:
        if not is_distributed():  # with several ranks, a peer may sit in a collective: the groups stay
            destroy_parallel()
        raise
    destroy_parallel()
    if ps.rank == 0:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            show(result)
    return 0


def interrupted(command: str, ps: Optional["ParallelState"]) -> int:
    """Ctrl-C (SIGINT, to every process of the terminal's group; the launcher forwards it too): one line from
    rank 0 (or the only process), exit status 130, no traceback on any rank. Nothing was written: these
    commands only read. A rank of several leaves at once, its groups not torn down (a peer may sit in a
    collective)."""
    from ..parallel.state import destroy_parallel, is_distributed
    if ps is None or ps.rank == 0:
        print(f"tnlg {command}: interrupted (Ctrl-C); nothing was written.", file=sys.stderr, flush=True)
    if ps is not None and is_distributed():
        from ..runtime.process_exit import leave
        leave(130, destroy=False)
    destroy_parallel()
    return 130


def step_note(command: str, ps: "ParallelState", message: str) -> None:
    """One line on rank 0's stderr, on a terminal only (stdout may be --json; a log file gets the result): what
    a command is doing in the seconds before its result (loading, resharding)."""
    if ps.rank == 0 and sys.stderr.isatty():
        print(f"tnlg {command}: {message}", file=sys.stderr, flush=True)


def print_table(title: str, rows: list[tuple[str, object]]) -> None:
    """Two aligned columns on stdout."""
    width = max(len(k) for k, _ in rows)
    print(title)
    for k, v in rows:
        if isinstance(v, float):
            v = f"{v:.6g}" if abs(v) < 1e6 else f"{v:.6e}"
        print(f"  {k:<{width}}  {v}")
