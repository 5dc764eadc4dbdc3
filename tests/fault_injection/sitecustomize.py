"""Fault injection for the fault-tolerance tests, outside the library: a test puts this folder on
``PYTHONPATH``, so every Python process it starts (the launcher and its workers) imports this file at
start-up.

``TNLG_TEST_KILL_AT_ITERATION=N[:RANK]`` makes that worker (default: the last rank) SIGKILL itself at
the end of iteration N, before that iteration's checkpoint, in the first attempt of an elastic run
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset).
"""

import os
import signal

_SPEC = os.environ.get("TNLG_TEST_KILL_AT_ITERATION")

if _SPEC and "RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    from tnlg.training.checkpointing import Checkpointer

    _iteration, _, _who = _SPEC.partition(":")
    _after_step = Checkpointer.after_step

    def _killing_after_step(self, iteration, consumed, last):
        if iteration == int(_iteration) and self.ps.rank == (int(_who) if _who else self.ps.world_size - 1):
            os.kill(os.getpid(), signal.SIGKILL)
        return _after_step(self, iteration, consumed, last)

    Checkpointer.after_step = _killing_after_step
