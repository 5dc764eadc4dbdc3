"""Checkpoints during training: resuming at start, saving every ``--save-interval`` iterations and at the
end, and stopping on a signal.

SIGINT and SIGTERM only set a flag while training runs (main thread): at the end of
the iteration every rank agrees to stop (one MAX all-reduce of the signal number;
SIGTERM wins: it asks for a save), after saving that iteration for SIGTERM with
``--save``; a second signal stops at once (KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator, Optional

from .. import checkpoint as ckpt
from ..checkpoint.files import complete_iterations
from ..checkpoint.signals import StopOnSignal
from ..errors import UserError
from ..options import Options
from ..parallel.state import ParallelState, max_over_world

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
    """SIGINT and SIGTERM set a flag for the body; a second SIGTERM raises KeyboardInterrupt as a second
    Ctrl-C does, so both end in the same short message. The previous handlers are restored."""
    restore = _second_sigterm_interrupts()
    stop = StopOnSignal((signal.SIGTERM, signal.SIGINT))
    try:
        yield stop
    finally:
        stop.close()
        restore()


def _second_sigterm_interrupts() -> Callable[[], None]:
    """While training, a SIGTERM that StopOnSignal passes on (the second one) raises KeyboardInterrupt.
    Returns the function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class Checkpointer:
    """Owns ``--load``, ``--save``, ``--save-interval``, ``--keep-last`` and the stop flag of one run."""

    def __init__(self, o: Options, ps: ParallelState, *, model, engine, config, tokenizer, stop: StopOnSignal,
                 log: Callable[[str], None]):
        self.o, self.ps, self.stop, self.log = o, ps, stop, log
        self._state = dict(model=model, engine=engine, ps=ps, config=config, options=o, tokenizer=tokenizer)

    def resume(self) -> tuple[int, int]:
        """``(iteration, consumed samples)`` of the checkpoint loaded into the model and engine: ``--load``,
        else ``--save`` when it holds one (elastic restarts rely on it); ``(0, 0)`` from scratch.

        Collective on every rank alike: rank 0 decides whether and what to load (no rank looks at the
        folder on its own first, see :func:`tnlg.checkpoint.load`)."""
        o = self.o
        load_dir, origin = (o.load, "--load") if o.load else (o.save, "--save")
        if not load_dir:
            return 0, 0
        state = ckpt.load(load_dir, origin=origin, missing_ok=not o.load, **self._state)
        if state is None:
            return 0, 0
        iteration, consumed = state["iteration"], state["consumed_samples"]
        self.log(f"resumed from {state['path']} at iteration {iteration} ({consumed} samples consumed)")
        return iteration, consumed

    def after_step(self, iteration: int, consumed: int, last: bool) -> Optional[dict]:
        """Save when due (the interval, the last iteration, SIGTERM); return how the run stopped when a
        signal stops it here, else ``None``. Collective: the signal check (when any rank has one) and
        the save."""
        o = self.o
        signum = self._agreed_signal() if self.stop.requested(self.ps) and not last else 0
        saving = bool(o.save) and bool((o.save_interval and iteration % o.save_interval == 0) or last
                                       or signum == signal.SIGTERM)
        if saving:
            ckpt.save(o.save, iteration=iteration, consumed_samples=consumed, keep_last=o.keep_last, **self._state)
            self.log(f"saved checkpoint at iteration {iteration} to {o.save}")
        if not signum:
            return None
        return dict(signal=signal.Signals(signum).name, iteration=iteration, saved=saving, forced=False)

    def forced_stop(self, iteration: int) -> dict:
        """How the run stopped on a second signal (or a Ctrl-C outside the handler's reach): at once."""
        return dict(signal=signal.Signals(self.stop.received or signal.SIGINT).name, iteration=iteration,
                    saved=False, forced=True)

    def _agreed_signal(self) -> int:
        """The signal that stops every rank (MAX all-reduce over the world: SIGTERM wins over SIGINT)."""
        return int(max_over_world(self.stop.received or 0, self.ps.device))
