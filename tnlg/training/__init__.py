"""Training: the loop and the components that own their intervals and state.

* :mod:`.loop` - :class:`Trainer` / :func:`train`: the loop, top to bottom;
* :mod:`.step` - :func:`train_step`: one iteration's micro batches, loss averaging and engine step;
* :mod:`.setup` - process groups, engine, schedule and datasets of a run;
* :mod:`.checkpointing` - resume, save interval, signals;
* :mod:`.validation` - the validation loss (token-weighted, as ``tnlg eval``) and its interval;
* :mod:`.metrics` - log lines, ``metrics.jsonl`` and the loss plot;
* :mod:`.throughput` - FLOPs per iteration (the planner's), the measured peak, peak memory.
"""

from .loop import Trainer, train

__all__ = ["Trainer", "train"]
