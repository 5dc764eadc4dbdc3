"""Ctrl-C, SIGTERM and SIGHUP: finish the current iteration, save a checkpoint, exit.

A terminal's Ctrl-C (SIGINT), a scheduler (Slurm before a time limit or preemption,
Kubernetes) and ``torchrun`` (which forwards the SIGINT, SIGTERM or SIGHUP it gets to
every worker) all mean "stop, keeping the work". The handler only sets a flag; at the
end of each iteration all ranks agree with one tiny all-reduce (MAX over the world), so
they save the same iteration together even when the signal reaches them at different
moments. A second signal while the first is pending raises :class:`KeyboardInterrupt`
at once, wherever the process is (also in the middle of that save): the run stops
without saving.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

from ..parallel.state import max_over_world

__all__ = ["StopOnSignal", "STOP_SIGNALS"]

# what a terminal, a scheduler and torchrun send to stop a run
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopOnSignal:
    """Install the handlers of ``signals`` (main thread only); :meth:`requested` says, on every rank
    alike, whether any rank received one. :meth:`close` restores the previous handlers."""

    def __init__(self, signals=STOP_SIGNALS):
        self.received: Optional[int] = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # asked twice: stop now, without waiting for the iteration (or save)
            raise KeyboardInterrupt
        self.received = signum

    def requested(self, ps) -> bool:
        """Collective over the world (MAX all-reduce of one number on ``ps.device``): True on every
        rank if any rank got the signal."""
        return self.agreed(ps) > 0

    def agreed(self, ps) -> int:
        """Collective over the world (MAX all-reduce of one number on ``ps.device``): the largest signal
        number any rank received (0: none), the same on every rank."""
        return int(max_over_world(self.received or 0, ps.device))

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
