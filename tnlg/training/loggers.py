"""Where rank 0's scalars go besides ``metrics.jsonl``: TensorBoard (``--tensorboard-dir``) and Weights &
Biases (``--wandb-project``), behind Megatron-LM's flags. Both are optional dependencies: a missing
package, or a ``--tensorboard-dir`` that cannot be a folder, is refused by
:meth:`tnlg.options.LoggingOptions.check_loggers` in the launching process, before any worker starts or
anything is written.

Each backend gets the same scalars as the metrics file, named ``train/<key>`` and ``valid/<key>`` after
the file's keys (``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/loss_scale``,
``train/ms_per_iter``, ``train/tokens_per_s``, ``train/tflops``, ``train/mfu``, ``train/hfu``,
``train/peak_memory_bytes``, ``valid/loss``, ``valid/ppl``), with the iteration as the step: the training scalars every
``--tensorboard-log-interval`` iterations, the validation ones at every validation. No collectives.

A file the run's reporting cannot write (a full disk, a quota, permissions: TensorBoard's event files
here, the metrics file, the loss plot and the log lines in :mod:`.metrics`) ends the run with one
paragraph (:func:`write_failed`) naming the file, the error and the free space, as a failed checkpoint
save does; rank 0 is the only writer, so the other ranks stop when it reports
(:mod:`tnlg.runtime.failures`). The checkpoints saved before are untouched. W&B writes through its own
service process, which reports its own errors.
"""

from __future__ import annotations

import os
from typing import Optional

from ..errors import UserError
from ..io import write_failure

__all__ = ["TRAIN_SCALARS", "VALID_SCALARS", "run_name", "build_loggers", "TensorBoardLogger", "WandbLogger",
           "write_failed"]

# the keys of a metrics.jsonl record that each backend receives (a key absent from a record is skipped:
# loss_scale exists only with --fp16)
TRAIN_SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "ms_per_iter", "tokens_per_s", "tflops", "mfu", "hfu",
                 "peak_memory_bytes")
VALID_SCALARS = ("loss", "ppl")


def write_failed(exc: OSError, path: str, what: str, when: str, flag: str) -> UserError:
    """The one paragraph of a report that could not be written: ``what`` (``the metrics file``) at
    ``path`` failed with ``exc`` ``when`` (``after iteration 7``); ``flag`` names the option that moves it."""
    return UserError(f"{what}: {write_failure(exc, path)} The run stopped {when}; the checkpoints saved before "
                     f"are intact. Free space there (or give {flag} another place), then run the same command "
                     f"again: it resumes from the latest checkpoint.")


class TensorBoardLogger:
    """Event files in ``log_dir`` (torch's ``SummaryWriter``). A resumed run (``resumed_at`` > 0) purges
    the steps past it that an interrupted run had written, as metrics.jsonl drops its records."""

    def __init__(self, log_dir: str, resumed_at: int = 0):
        from torch.utils.tensorboard import SummaryWriter
        _quiet_writer_thread()
        self.log_dir, self.step = log_dir, resumed_at
        try:
            self.writer = SummaryWriter(log_dir=log_dir, purge_step=resumed_at + 1 if resumed_at > 0 else None)
        except OSError as exc:
            raise self._failed(exc, f"before training (at iteration {resumed_at})") from None

    def _failed(self, exc: OSError, when: str) -> UserError:
        return write_failed(exc, self.log_dir, "TensorBoard's event file", when, "--tensorboard-dir")

    def log(self, scalars: dict, step: int) -> None:
        try:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, global_step=step)
            self.writer.flush()  # (the event writer's thread raises its write error here)
        except OSError as exc:
            raise self._failed(exc, f"after iteration {step}") from None
        self.step = step

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError as exc:
            raise self._failed(exc, f"at its end (iteration {self.step})") from None


def _quiet_writer_thread() -> None:
    """TensorBoard's event writer writes in a thread of its own, which keeps a failed write's error for the
    next flush (where :meth:`TensorBoardLogger.log` reports it in one paragraph) and raises it in the
    thread as well: that thread's traceback is not printed (every other thread's is, as before)."""
    import threading
    previous = threading.excepthook
    if getattr(previous, "tnlg_quiet", False):
        return

    def hook(args) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)
    hook.tnlg_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class WandbLogger:
    """One W&B run (``wandb.init``; ``WANDB_MODE=offline`` writes it locally only) with the run's options
    as its config."""

    def __init__(self, project: str, name: Optional[str], save_dir: str, config: dict):
        import wandb
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, config=config)

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def run_name(log, save: Optional[str]) -> Optional[str]:
    """The run's name: ``--wandb-exp-name`` (of ``log``, the run's :class:`~tnlg.options.LoggingOptions`),
    else the name of its ``--save`` folder (``None``: neither)."""
    return log.wandb_exp_name or (os.path.basename(os.path.normpath(save)) if save else None)


def build_loggers(o, resumed_at: int) -> list:
    """The backends that options ``o`` (:class:`~tnlg.options.Options`) ask for (call on rank 0 only):
    TensorBoard, then W&B, whose run's config is the run's options. The W&B run is named :func:`run_name`
    and written under ``--wandb-save-dir`` (default: SAVE/wandb, else ./wandb)."""
    log, save = o.logging, o.checkpoint.save
    loggers: list = []
    if log.tensorboard_dir is not None:
        loggers.append(TensorBoardLogger(log.tensorboard_dir, resumed_at))
    if log.wandb_project is not None:
        from ..checkpoint.compat import options_record
        save_dir = log.wandb_save_dir or os.path.join(save or ".", "wandb")
        loggers.append(WandbLogger(log.wandb_project, run_name(log, save), save_dir, options_record(o)))
    return loggers
