"""SIGTERM: finish the current iteration, save a checkpoint, exit.

A scheduler (Slurm before a time limit or preemption, Kubernetes, ``torchrun``
on shutdown) sends SIGTERM to every process. The handler only sets a flag; at
the end of each iteration all ranks agree with one tiny all-reduce (MAX over
the world), so they save the same iteration together even when the signal
reaches them at different moments. A second SIGTERM while the first is pending
restores the default action and re-raises it (the process dies).
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

from ..parallel.state import max_over_world

__all__ = ["StopOnSignal"]


class StopOnSignal:
    """Install a SIGTERM handler (main thread only); :meth:`requested` says, on every rank alike,
    whether any rank received the signal. :meth:`close` restores the previous handler."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.received: Optional[int] = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # asked twice: stop waiting for the iteration to end
            self.close()
            signal.raise_signal(signum)
            return
        self.received = signum

    def requested(self, ps) -> bool:
        """Collective over the world (MAX all-reduce of one number on ``ps.device``): True on every
        rank if any rank got the signal."""
        return max_over_world(0.0 if self.received is None else 1.0, ps.device) > 0

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
