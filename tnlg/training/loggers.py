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
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["TRAIN_SCALARS", "VALID_SCALARS", "run_name", "build_loggers", "TensorBoardLogger", "WandbLogger"]

# the keys of a metrics.jsonl record that each backend receives (a key absent from a record is skipped:
# loss_scale exists only with --fp16)
TRAIN_SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "ms_per_iter", "tokens_per_s", "tflops", "mfu", "hfu",
                 "peak_memory_bytes")
VALID_SCALARS = ("loss", "ppl")


class TensorBoardLogger:
    """Event files in ``log_dir`` (torch's ``SummaryWriter``). A resumed run (``resumed_at`` > 0) purges
    the steps past it that an interrupted run had written, as metrics.jsonl drops its records."""

    def __init__(self, log_dir: str, resumed_at: int = 0):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=resumed_at + 1 if resumed_at > 0 else None)

    def log(self, scalars: dict, step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


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
