"""Checkpoints during training: resuming at start, saving every ``--save-interval`` iterations and at the
end, and stopping on a signal.

SIGINT (Ctrl-C), SIGTERM and SIGHUP only set a flag while training runs (main thread,
:class:`tnlg.checkpoint.signals.StopOnSignal`): at the end of the iteration every rank
agrees to stop (one MAX all-reduce of the signal number), saves that iteration when the
run has a save root, and stops; a second signal stops at once (KeyboardInterrupt), without
a save.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Callable, Iterator, Optional

from .. import checkpoint as ckpt
from ..checkpoint.files import complete_iterations
from ..checkpoint.signals import StopOnSignal
from ..errors import UserError
from ..options import Options
from ..parallel.state import ParallelState

__all__ = ["Checkpointer", "stop_on_signals", "last_checkpoint"]


def last_checkpoint(save: Optional[str]) -> Optional[int]:
    """The iteration a resume from ``save`` would load (``None``: no checkpoint there)."""
    if not save or not os.path.isdir(save):
        return None
    try:
        latest = ckpt.read_latest(save)
    except UserError:
        latest = None
    done = complete_iterations(save)
    return latest if latest in done else (done[-1] if done else None)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopOnSignal]:
    """SIGINT, SIGTERM and SIGHUP set a flag for the body (a second one raises KeyboardInterrupt); the
    previous handlers are restored."""
    stop = StopOnSignal()
    try:
        yield stop
    finally:
        stop.close()


class Checkpointer:
    """Owns ``--load``, ``--save``, ``--save-interval``, ``--keep-last`` and the stop flag of one run."""

    def __init__(self, o: Options, ps: ParallelState, *, model, engine, config, tokenizer, stop: StopOnSignal,
                 log: Callable[[str], None]):
        self.o, self.ps, self.stop, self.log = o, ps, stop, log
        self._state = dict(model=model, engine=engine, ps=ps, config=config, options=o, tokenizer=tokenizer)

    def resume(self) -> tuple[int, int]:
        """``(iteration, consumed samples)`` of the checkpoint loaded into the model and engine: ``--load``,
        else ``--save`` when it holds one (elastic restarts rely on it); ``(0, 0)`` from scratch."""
        o = self.o
        load_dir, origin = (o.load, "--load") if o.load else (o.save, "--save")
        if not load_dir or not (o.load or ckpt.has_checkpoint(o.save)):
            return 0, 0
        state = ckpt.load(load_dir, origin=origin, **self._state)
        if state is None:
            return 0, 0
        iteration, consumed = state["iteration"], state["consumed_samples"]
        self.log(f"resumed from {state['path']} at iteration {iteration} ({consumed} samples consumed)")
        return iteration, consumed

    def after_step(self, iteration: int, consumed: int, last: bool) -> Optional[dict]:
        """Save when due (the interval, the last iteration, a stop signal); return how the run stopped when
        a signal stops it here, else ``None``. Collective: the signal check and the save."""
        o = self.o
        signum = 0 if last else self.stop.agreed(self.ps)
        saving = bool(o.save) and bool((o.save_interval and iteration % o.save_interval == 0) or last or signum)
        if saving:
            ckpt.save(o.save, iteration=iteration, consumed_samples=consumed, keep_last=o.keep_last, **self._state)
            self.log(f"saved checkpoint at iteration {iteration} to {o.save}")
        if not signum:
            return None
        return dict(signal=signal.Signals(signum).name, iteration=iteration, saved=saving, forced=False)

    def before_training(self, iteration: int) -> Optional[dict]:
        """How the run stopped when a signal came during start-up (nothing trained yet, so nothing to save),
        else ``None``. Collective: the signal check."""
        signum = self.stop.agreed(self.ps)
        return dict(signal=signal.Signals(signum).name, iteration=iteration, saved=False, forced=False) if signum \
            else None

    def forced_stop(self, iteration: int) -> dict:
        """How the run stopped on a second signal (or a Ctrl-C outside the handler's reach): at once."""
        return dict(signal=signal.Signals(self.stop.received or signal.SIGINT).name, iteration=iteration,
                    saved=False, forced=True)
