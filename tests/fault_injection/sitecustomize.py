"""Fault injection for the fault-tolerance tests, outside the library: a test puts this folder on
``PYTHONPATH``, so every Python process it starts (the launcher and its workers) imports this file at
start-up.

``TNLG_TEST_KILL_AT_ITERATION=N[:RANK]`` makes that worker (default: the last rank) SIGKILL itself at
the end of iteration N, before that iteration's checkpoint, in the first attempt of an elastic run
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset).

``TNLG_TEST_KILL_DURING_SAVE=N[:RANK]`` makes that rank (default: the last) SIGKILL itself after it
wrote its files of iteration N's checkpoint, before they are shared and committed.

``TNLG_TEST_SLOW_SAVE=PATH`` makes every worker's checkpoint save first create ``PATH.<rank>`` and
sleep 60 s (a slow filesystem: a signal meant for the save finds the worker inside it).
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

_SAVE_SPEC = os.environ.get("TNLG_TEST_KILL_DURING_SAVE")

if _SAVE_SPEC:
    from tnlg.checkpoint import saving

    _save_iteration, _, _save_who = _SAVE_SPEC.partition(":")
    _finish = saving._finish

    def _killing_finish(root, tmp, final, iteration, written, ps, meta, keep_last):
        if iteration == int(_save_iteration) and ps.rank == (int(_save_who) if _save_who else ps.world_size - 1):
            os.kill(os.getpid(), signal.SIGKILL)
        return _finish(root, tmp, final, iteration, written, ps, meta, keep_last)

    saving._finish = _killing_finish

_SLOW_SAVE = os.environ.get("TNLG_TEST_SLOW_SAVE")

if _SLOW_SAVE and "RANK" in os.environ:
    import time

    import tnlg.checkpoint

    _save = tnlg.checkpoint.save

    def _slow_save(*args, **kwargs):
        open(f"{_SLOW_SAVE}.{os.environ['RANK']}", "w").close()
        time.sleep(60)
        return _save(*args, **kwargs)

    tnlg.checkpoint.save = _slow_save
