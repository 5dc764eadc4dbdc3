"""What ``tnlg eval`` and ``tnlg generate`` share: checkpoints, tokenizers, processes.

* :func:`load_model` - a Hugging Face GPT-2 folder (``config.json`` + weights, loaded
  with :func:`tnlg.hf.from_hf`) or a tnlg checkpoint (through
  ``tnlg.checkpoint.load_for_inference``), sharded for this rank's TP layout; at ``--pp P``
  this stage's layers only (:func:`tnlg.parallel.pipeline_inference.inference_model`).
* :func:`resolve_tokenizer` - ``--tokenizer-model`` wins; else the checkpoint's.
* :func:`launch_or_init` - under ``torchrun`` join the job; with ``--nproc-per-node N``
  relaunch the same command on N local processes (:func:`tnlg.launch.relaunch`);
  else run in this process.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Optional

import torch

from ..checkpoint import load_for_inference, read_meta, resolve
from ..data.tokenizer import load_tokenizer
from ..errors import UserError
from ..hf import from_hf
from ..launch import check_nodes, join, launcher_world_size, relaunch
from ..options.pipeline import check_pipeline_world, check_stage_count
from ..parallel.state import ParallelState, destroy_parallel, is_distributed

__all__ = ["is_hf_folder", "hf_tokenizer_spec", "checkpoint_seq_length", "checkpoint_num_layers", "load_model",
           "resolve_tokenizer", "precheck_checkpoint", "check_tokenizer_fits", "add_common_arguments",
           "launch_or_init", "print_table"]

_NO_TOKENIZER = ("no tokenizer: checkpoint {ckpt!r} does not name one{why}, and --tokenizer-model was not "
                 "given. Pass --tokenizer-model with a SentencePiece .model file, a folder holding GPT-2's "
                 "vocab.json + merges.txt, or 'builtin'.")


def is_hf_folder(path: str) -> bool:
    """A folder written by ``save_pretrained`` (it holds ``config.json``)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def hf_tokenizer_spec(path: str) -> Optional[str]:
    """The folder itself when it holds GPT-2's ``vocab.json`` + ``merges.txt``, else ``None``."""
    has = all(os.path.isfile(os.path.join(path, f)) for f in ("vocab.json", "merges.txt"))
    return path if has else None


def precheck_checkpoint(checkpoint: str, tokenizer_model: Optional[str], needs_tokenizer: bool = True):
    """Checks that need no model, run before any process starts: the checkpoint exists and
    (``needs_tokenizer``) a tokenizer can be found. Returns the loaded ``--tokenizer-model``
    tokenizer, or ``None``."""
    if not os.path.exists(checkpoint):
        raise UserError(f"checkpoint {checkpoint!r} does not exist; pass a Hugging Face GPT-2 folder "
                        "(config.json + model.safetensors) or a folder written by `tnlg pretrain --save`.")
    if tokenizer_model:
        return load_tokenizer(tokenizer_model)
    if needs_tokenizer and is_hf_folder(checkpoint) and hf_tokenizer_spec(checkpoint) is None:
        raise UserError(_NO_TOKENIZER.format(ckpt=checkpoint, why=" (a Hugging Face folder needs vocab.json "
                                                                   "+ merges.txt beside config.json)"))
    return None


def checkpoint_seq_length(checkpoint: str) -> Optional[int]:
    """The model's ``seq_length`` read from the checkpoint's metadata (no weights), or ``None``."""
    return _checkpoint_size(checkpoint, "n_positions", "seq_length")


def checkpoint_num_layers(checkpoint: str) -> Optional[int]:
    """The model's layer count read from the checkpoint's metadata (no weights), or ``None``."""
    return _checkpoint_size(checkpoint, "n_layer", "num_layers")


def _checkpoint_size(checkpoint: str, hf_key: str, key: str) -> Optional[int]:
    try:
        if is_hf_folder(checkpoint):
            with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
                return int(json.load(f)[hf_key])
        return int(read_meta(resolve(checkpoint, "checkpoint"))["config"][key])
    except Exception:  # noqa: BLE001 - best effort: the workers check again with the model
        return None


def load_model(checkpoint: str, ps: ParallelState, tokenizer_model=None):
    """``(model, tokenizer or its spec, or None)``: the checkpoint's model sharded for ``ps``, in
    eval mode, and the tokenizer it names (``tokenizer_model`` replaces a tnlg checkpoint's
    recorded one, which then need not exist any more). A Hugging Face folder: no collectives
    (every rank reads its own shard); a tnlg checkpoint: the ranks agree on the iteration and on
    the outcome of the checks (:func:`tnlg.checkpoint.load_for_inference`).
    """
    if is_hf_folder(checkpoint):
        model, spec = from_hf(checkpoint, ps), hf_tokenizer_spec(checkpoint)
    else:
        model, spec = load_for_inference(checkpoint, ps, tokenizer_override=tokenizer_model)
    model.eval()
    return model, spec


def resolve_tokenizer(tokenizer_model, spec, checkpoint: str):
    """``--tokenizer-model`` (a path or an already loaded tokenizer) wins; else the checkpoint's spec."""
    if tokenizer_model is not None:
        return load_tokenizer(tokenizer_model)
    if spec is None:
        why = " (a Hugging Face folder needs vocab.json + merges.txt)" if is_hf_folder(checkpoint) else ""
        raise UserError(_NO_TOKENIZER.format(ckpt=checkpoint, why=why))
    return load_tokenizer(spec)


def check_tokenizer_fits(tokenizer, model) -> None:
    """Every token id of the tokenizer must be a row of the model's embedding."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.config.vocab_size}: it was trained with another tokenizer. Pass the "
                        "model's own tokenizer with --tokenizer-model.")


# --------------------------------------------------------------------------- processes

def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", "--load", dest="checkpoint", required=True, metavar="CKPT",
                   help="a Hugging Face GPT-2 folder (config.json + weights; vocab.json + merges.txt give the "
                        "tokenizer) or a tnlg checkpoint folder; resharded to the TP size asked for")
    p.add_argument("--tokenizer-model", metavar="M",
                   help="tokenizer to use instead of the checkpoint's: a SentencePiece .model, a folder with "
                        "GPT-2 vocab.json + merges.txt, or 'builtin'")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1, metavar="N",
                   help="tensor-parallel size (default 1); must divide the number of processes")
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1, metavar="P",
                   help="pipeline stages (default 1): the layers split as evenly as possible over P stages, "
                        "each holding its layers' weights and KV cache; P x TP must divide the processes")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="local processes to launch (default: TP x PP); the extra factor is data "
                        "parallelism. Not needed under torchrun, which sets the world")
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


def launch_or_init(command: str, add_arguments, args) -> tuple[Optional[int], Optional[ParallelState]]:
    """``(exit status, None)`` after launching ``--nproc-per-node`` local processes, or
    ``(None, ps)`` to run here: under torchrun/elastic (joining its process group) or as
    the only process (CUDA when available). The layout (TP, PP against the processes and the
    checkpoint's layers) is checked first, before any process starts."""
    for flag, value in (("--tensor-model-parallel-size", args.tp), ("--pipeline-model-parallel-size", args.pp)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}.")
    layers = checkpoint_num_layers(args.checkpoint)
    if layers is not None:
        check_stage_count(args.pp, layers)
    world = launcher_world_size()
    if world is None:
        nproc = args.nproc_per_node or args.tp * args.pp
        if nproc < 1 or nproc % args.tp:
            raise UserError(f"--nproc-per-node {nproc} must be a positive multiple of "
                            f"--tensor-model-parallel-size {args.tp} (each TP group needs {args.tp} processes).")
        check_pipeline_world(args.pp, args.tp, nproc * args.nnodes)
        check_nodes(args.nnodes, args.rdzv_endpoint)
        status = relaunch(command, add_arguments, args, nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint)
        if status is not None:
            return status, None
        return None, ParallelState.single("cuda" if torch.cuda.is_available() else "cpu")
    if world % args.tp:
        raise UserError(f"--tensor-model-parallel-size {args.tp} does not divide the {world} processes "
                        "torchrun started.")
    check_pipeline_world(args.pp, args.tp, world)
    return None, join(args.tp, pipeline_parallel_size=args.pp)


def run_command(command: str, add_arguments, args, work: Callable[[ParallelState], dict],
                show: Callable[[dict], None]) -> int:
    """Launch or join the ranks, run ``work(ps)`` on every rank, then on rank 0 print the result:
    exactly one JSON object with ``--json``, else ``show(result)``. An error is raised on the rank
    that has it; :mod:`tnlg.failures` (through :func:`tnlg.cli.main`) reports it once for the job and
    stops the other ranks: one every rank raised alike (a checkpoint that cannot be loaded) is
    printed by rank 0, one rank's own error names that rank."""
    status, ps = launch_or_init(command, add_arguments, args)
    if status is not None:
        return status
    try:
        result = work(ps)
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


def print_table(title: str, rows: list[tuple[str, object]]) -> None:
    """Two aligned columns on stdout."""
    width = max(len(k) for k, _ in rows)
    print(title)
    for k, v in rows:
        if isinstance(v, float):
            v = f"{v:.6g}" if abs(v) < 1e6 else f"{v:.6e}"
        print(f"  {k:<{width}}  {v}")
