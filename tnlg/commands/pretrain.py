"""``tnlg pretrain``: the command. Options are resolved and validated here, in the launching process; the
run is then launched on local processes (:mod:`tnlg.runtime.launch`) or trained in this one (:mod:`tnlg.training`).

Torch is imported only when the command runs (``--help`` answers without it). This module also decides where a run without ``--save`` saves, and what rank 0 says when a signal
stopped the run (the last checkpoint and the command that resumes it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..errors import UserError
from ..options import Options
from ..options.recorded import describe
from ..runtime.launch import argv_of, is_rank0, launcher_world_size, relaunch, under_launcher
from .pretrain_args import DEFAULT_NPROC, add_arguments, resolve

__all__ = ["add_arguments", "preflight", "run", "hang_resume", "resume_command", "default_nproc", "new_run_folder",
           "Command", "launch", "processes", "check_hardware", "start_flight_recorder", "check_sft_data"]


@dataclass(frozen=True)
class Command:
    """The command a training run is: its name (``pretrain``, ``finetune``: what its messages, errors and
    workers say), its parser and the arguments as the user gave them (what the workers parse again, and what
    the command that resumes the run repeats). ``checkpoint_args``: whether ``--save DIR
    --use-checkpoint-args`` resumes it (``tnlg finetune`` refuses that flag); ``keeps_load``: whether the
    resume command keeps ``--load`` (a fine-tuning run's ``--load`` is its starting point, which it checks
    against its ``--save``; ``tnlg pretrain`` drops it once ``--save`` holds a newer checkpoint)."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    args: argparse.Namespace
    checkpoint_args: bool = True
    keeps_load: bool = False

    def resume(self, o: Options) -> str:
        """The command that continues this run: its options, with ``--save`` as chosen (and, for ``tnlg
        pretrain``, without a ``--load`` that would reload the old starting point once the save root holds a
        newer checkpoint)."""
        from ..checkpoint.files import last_checkpoint
        c, args = o.checkpoint, self.args
        ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "command"})
        if c.save is not None and not hasattr(args, "save") and (c.load is None or self.keeps_load):
            ns.save = c.save  # the folder chosen for the run
        if not self.keeps_load and c.load is not None and last_checkpoint(c.save) is not None:
            if hasattr(args, "save"):
                del ns.load  # resumes from --save by itself
            else:
                ns.load = c.save  # the root, not the iteration it started from
        argv = argv_of(self.add_arguments, ns)
        return f"tnlg {self.name}" + (" " + shlex.join(argv) if argv else "")


def run(args) -> int:
    """Entry of ``tnlg pretrain``: validate everything, prepare data, launch or train here.

    The workers get exactly the options in ``args`` (rebuilt from the parsed namespace, never read
    from ``sys.argv``), plus ``--save`` when this process chose the built-in job's folder.
    """
    return interruptible("pretrain", lambda: _run(args))


def interruptible(name: str, body: Callable[[], int]) -> int:
    """``body()``, or exit status 130 and one line for a Ctrl-C during start-up (before training installs
    its handlers)."""
    try:
        return body()
    except KeyboardInterrupt:
        if is_rank0():
            print(f"tnlg {name}: interrupted during start-up, before the first iteration.", file=sys.stderr)
        return 130


def preflight(args) -> None:
    """Checks made by :func:`tnlg.cli.main` before anything is launched or loaded.

    ``--bf16`` where bf16 matmuls are far slower than fp32 is refused with the measured figures
    (:mod:`tnlg.runtime.hardware`), after the options themselves are validated; on CUDA, torch's NCCL flight
    recorder is switched on (:mod:`tnlg.runtime.hang`) and rank 0 says where a timeout dumps it.
    """
    if getattr(args, "bf16", False) or getattr(args, "config", None):  # a config file may set bf16
        check_hardware(resolve(args))  # the options' own errors first, as `run` would report them
    start_flight_recorder(getattr(args, "save", None), getattr(args, "device", None))


def check_hardware(o: Options) -> None:
    """``--bf16`` refused where bf16 matmuls are far slower than fp32, with the measured figures."""
    if o.precision.bf16:
        from ..parallel.state import pick_device
        from ..runtime.hardware import check_bf16
        check_bf16(pick_device(o.precision.device).type)


def start_flight_recorder(save: Optional[str], device: Optional[str]) -> None:
    """On CUDA, torch's NCCL flight recorder, dumping into ``SAVE/comm_trace`` (rank 0 says so)."""
    if device != "cpu":
        import torch
        if torch.cuda.is_available():
            from ..runtime.hang import enable_flight_recorder
            prefix = enable_flight_recorder(os.path.join(save or "runs", "comm_trace"))
            if is_rank0():
                print(f"NCCL flight recorder on: a collective timeout dumps each rank's recent collectives to "
                      f"{prefix}<rank> (read with: python -m torch.distributed.flight_recorder.fr_trace)", flush=True)


def hang_resume(args):
    """For :func:`tnlg.runtime.hang.report`: ``resume(options)``, the command that resumes the run. A
    command module with this function gets a hang report instead of a traceback on a timed-out collective."""
    return Command("pretrain", add_arguments, args).resume


def default_nproc(device: Optional[str] = None) -> int:
    """Local processes when neither a launcher nor ``--nproc-per-node`` says: one per GPU when
    training on GPUs (a machine with one GPU trains in one process, on it), else 4 CPU processes."""
    import torch

    from ..parallel.state import pick_device
    if pick_device(device).type == "cuda":
        return max(1, torch.cuda.device_count())
    return DEFAULT_NPROC


def processes(args) -> tuple[int, Optional[int]]:
    """``(world size, local processes to start)``: the launcher's world (nothing to start), else
    ``--nproc-per-node`` or :func:`default_nproc`."""
    world = launcher_world_size()
    if world is not None:
        return world, None
    nproc = getattr(args, "nproc_per_node", None) or default_nproc(getattr(args, "device", None))
    return nproc, nproc


def _run(args) -> int:
    from ..data.corpus import default_dataset
    from ..training.checkpointing import check_resume
    world, nproc = processes(args)
    o = resolve(args, world_size=world)  # also refuses --device cuda without a GPU and --fp16 on a CPU
    note = _choose_save(o, args)  # the built-in job's folder, or the --load root; or why nothing is saved
    data_notes: list[str] = []
    if o.data.data_path is not None:
        data_notes = _check_data_tokenizer(o)  # a mismatch refused here, before any worker starts
    elif o.data.sft_data_path is None:  # the built-in corpus: prepared here once, found by the workers
        prefix, tok = default_dataset()
        o.data.data_path, o.data.tokenizer_model = [prefix], o.data.tokenizer_model or tok
    extra = []
    if nproc is not None and nproc > 1:
        check_resume(o)  # a checkpoint that does not match: reported here, before any worker starts
        if o.data.sft_data_path is not None:
            check_sft_data(o)  # a bad row or template: one paragraph here, before any worker starts
        if not hasattr(args, "save") and o.checkpoint.save is not None and o.checkpoint.load is None:
            extra += ["--save", o.checkpoint.save]  # the folder chosen here: every worker, and a restarted group, uses it
            print(note, flush=True)  # the workers see a --save and say nothing of it
    notes = ([note] if note else []) + data_notes + describe(o.checkpoint_args)  # (a launcher said none of these)
    return launch(Command("pretrain", add_arguments, args), o, nproc, notes=notes, extra=extra)


def launch(command: Command, o: Options, nproc: Optional[int], notes: Sequence[str] = (),
           extra: Sequence[str] = ()) -> int:
    """Run the checked options ``o`` of ``command``: on ``nproc`` new local processes running ``tnlg
    COMMAND`` with the arguments as given plus ``extra`` (and ``--nproc-per-node``, so that rank 0's resume
    command keeps the layout), or here (under a launcher, or one process), printing ``notes`` first and,
    on rank 0, how the run stopped and how to resume it."""
    from ..training import train
    if nproc is not None and nproc > 1 and not under_launcher():
        more = list(extra) + ([] if hasattr(command.args, "nproc_per_node") else ["--nproc-per-node", str(nproc)])
        status = relaunch(command.name, command.add_arguments, command.args, nproc, extra=more,
                          max_restarts=o.parallel.max_restarts or 0)
        assert status is not None  # (not under a launcher: relaunch starts the workers and returns their status)
        return status
    if notes and is_rank0():
        print("\n".join(notes), flush=True)
    summary = train(o)
    stopped, exited = summary.get("interrupted"), summary.get("exited")
    name = f"tnlg {command.name}"
    if is_rank0():
        if stopped:
            print(_interrupted_message(stopped, o, command), file=sys.stderr, flush=True)
        elif exited:
            print(_stop_message(f"{name}: stopped after iteration {exited['iteration']} of "
                                f"{o.schedule.train_iters} (--exit-interval {exited['exit_interval']})", exited, o,
                                command, "each --exit-interval stop then saves into DIR"), flush=True)
        elif o.checkpoint.save is None:
            metrics_file = o.logging.metrics_file
            print(f"{name}: finished; no checkpoint was saved (no --save)"
                  + (f"; metrics are in {metrics_file}." if metrics_file else ", and no metrics or loss plot.")
                  + " Pass --save DIR to keep a run.", flush=True)
    # a worker that stopped as asked exits 0 (a launcher would count anything else as a failure and restart
    # the group); a lone process exits as shells expect of a signalled command
    return 128 + int(signal.Signals[stopped["signal"]]) if stopped and not under_launcher() else 0


def _check_data_tokenizer(o) -> list[str]:
    """Each ``--data-path`` dataset's recorded tokenizer against ``--tokenizer-model``
    (:mod:`tnlg.data.fingerprint`): a :class:`UserError` on a mismatch, a note for data without a record."""
    from ..data.fingerprint import check_sidecar
    from ..data.gpt_dataset import parse_data_path
    from ..data.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(o.data.tokenizer_model)
    notes = [check_sidecar(p, tokenizer) for p in parse_data_path(o.data.data_path)[0]]
    return [n for n in notes if n]


def check_sft_data(o: Options) -> None:
    """The fine-tuning rows read, rendered, tokenized and packed once in the launching process: every bad row,
    template or length is refused before any worker starts, and the workers read the tokenized rows from the
    cache this writes (:mod:`tnlg.data.sft`)."""
    from ..data.sft import build_sft_datasets
    from ..data.tokenizer import load_tokenizer
    d = o.data
    assert d.sft_data_path is not None
    build_sft_datasets(d.sft_data_path, d.sft_valid_data_path, load_tokenizer(d.tokenizer_path()),
                       o.model.seq_length, train_samples=1, valid_samples=1, seed=d.seed, packing=d.packing,
                       loss_on_prompt=d.sft_loss_on_prompt, cache_dir=d.data_cache_path)


def _checkpoint_root(path: str) -> str:
    """The root of a ``--load`` path: its parent for an ``iter_*`` directory, else the path itself."""
    from ..checkpoint.files import META
    path = os.path.normpath(path)
    return os.path.dirname(path) or "." if os.path.isfile(os.path.join(path, META)) else path


def _choose_save(o: Options, args) -> Optional[str]:
    """Where a run without ``--save`` saves (sets ``o.checkpoint.save``), and the note that says so; ``None``
    with ``--save``. Never lose work silently: the built-in job gets a fresh folder, a resumed run saves back
    into the root it loaded from, any other run saves nothing and says so now and at the end."""
    c = o.checkpoint
    if c.save is not None:
        return None
    if c.load is not None:
        root = _checkpoint_root(c.load)
        if not os.access(root, os.W_OK):
            raise UserError(f"--load {c.load!r} without --save would save back into {root!r}, which is not "
                            f"writable. Pass --save DIR for this run's checkpoints.")
        c.save = root
        return (f"note: no --save: checkpoints, metrics.jsonl and the loss plot go back into {root}, the "
                f"checkpoint root --load reads from (--save DIR writes elsewhere).")
    if o.builtin_job:
        c.save = new_run_folder("pretrain", "the built-in job")
        return (f"note: the built-in job saves its checkpoints, metrics.jsonl and loss plot in {c.save} "
                f"(--save DIR chooses the folder).")
    return ("note: no --save: this run writes no checkpoint"
            + ("" if o.logging.metrics_file else ", no metrics and no loss plot")
            + "; its training is lost when it ends. Pass --save DIR to keep it.")


def new_run_folder(kind: str, what: str) -> str:
    """A new folder ``runs/KIND-DATE-TIME`` for a run without ``--save`` (``what``: the run, as errors name it):
    one name for every process of the run."""
    if under_launcher():  # each process would read its own clock: use the launcher's run id
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if not run_id or run_id == "none":
            raise UserError(f"{what} under this launcher needs --save DIR: the launcher sets no run id "
                            "(TORCHELASTIC_RUN_ID), so the processes cannot agree on a new folder.")
        return os.path.join("runs", f"{kind}-{run_id}")
    return os.path.join("runs", time.strftime(f"{kind}-%Y%m%d-%H%M%S"))


def resume_command(args, o: Options) -> str:
    """The command that continues this ``tnlg pretrain`` run (:meth:`Command.resume`)."""
    return Command("pretrain", add_arguments, args).resume(o)


def _interrupted_message(info: dict, o: Options, command: Command) -> str:
    """One paragraph: where the run stopped on a signal, the last checkpoint, and how to go on."""
    how = f"{info['signal']}, stopped at once" if info["forced"] else info["signal"]
    return _stop_message(f"tnlg {command.name}: interrupted ({how}) at iteration {info['iteration']} of "
                         f"{o.schedule.train_iters}", info, o, command, "Ctrl-C then saves into DIR before stopping")


def _stop_message(head: str, info: dict, o: Options, command: Command, then: str) -> str:
    """``head``, then the last checkpoint and the command that resumes the run (``then``: what a run with a
    save root would do, said to a run without one)."""
    from ..checkpoint.files import last_checkpoint
    save = o.checkpoint.save
    if save is None:
        return (f"{head}. This run saved nothing: it has no save root (no --save, and neither the built-in job "
                f"nor a --load root to save into), so iteration {info['iteration']} was not written. Start it again "
                f"with --save DIR to keep checkpoints; {then}.")
    last = last_checkpoint(save)
    where = (f"the last checkpoint is iteration {last} in {save}" + (" (saved now)" if info["saved"] else "")
             if last is not None else f"there is no checkpoint in {save} yet, so a resume starts over")
    torchrun = under_launcher() and not hasattr(command.args, "nproc_per_node")
    how = command.resume(o)
    if last is not None and command.checkpoint_args:  # the options the checkpoint recorded; the processes are
        nproc = getattr(command.args, "nproc_per_node", None)  # this launch's, not recorded
        short = f"tnlg pretrain --save {shlex.quote(save)} --use-checkpoint-args" + (
            f" --nproc-per-node {nproc}" if nproc is not None else "")
        how = f"{short} (every flag spelled out: {how})"
    return (f"{head}; {where}. Resume with: {how}"
            + (" (under torchrun: the same torchrun command with these arguments)" if torchrun else ""))
