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

    def _killing_finish(root, tmp, final, iteration, written, ps, *args):
        if iteration == int(_save_iteration) and ps.rank == (int(_save_who) if _save_who else ps.world_size - 1):
            os.kill(os.getpid(), signal.SIGKILL)
        return _finish(root, tmp, final, iteration, written, ps, *args)

    saving._finish = _killing_finish

# ``TNLG_TEST_USER_ERROR=RANK[,RANK...]`` makes those ranks (only) fail with a user error right after the
# run's parallel state exists (the other ranks go on into their first collectives).
_ERROR_SPEC = os.environ.get("TNLG_TEST_USER_ERROR")

if _ERROR_SPEC and "RANK" in os.environ:
    from tnlg.errors import UserError
    from tnlg.training import loop as _loop

    _init_run = _loop.init_run

    def _failing_init_run(o):
        ps, accum = _init_run(o)
        if str(ps.rank) in _ERROR_SPEC.split(","):
            raise UserError(f"injected: the data of rank {ps.rank} cannot be read.")
        return ps, accum

    _loop.init_run = _failing_init_run

# ``TNLG_TEST_USER_ERROR_AFTER_LOAD=RANK`` makes that rank of ``tnlg eval`` or ``tnlg generate`` fail with a user
# error once its model is loaded (the other ranks go on into the model's collectives).
_LOADED_SPEC = os.environ.get("TNLG_TEST_USER_ERROR_AFTER_LOAD")

if _LOADED_SPEC and "RANK" in os.environ:
    import importlib

    from tnlg.errors import UserError as _UserError

    def _failing_after(load_model):
        def load(checkpoint, ps, *args, **kwargs):
            out = load_model(checkpoint, ps, *args, **kwargs)
            if str(ps.rank) == _LOADED_SPEC:
                raise _UserError(f"injected: the input of rank {ps.rank} cannot be read.")
            return out
        return load

    _loading = importlib.import_module("tnlg.generation.loading")  # the commands import it when they run
    _loading.load_model = _failing_after(_loading.load_model)

# ``TNLG_TEST_NAN_AT=N:RANK`` puts a NaN into that rank's shard of the word embeddings before iteration N,
# as a bad update on one rank would: the TP all-reduces and the DP all-reduce of the loss carry it to every rank.
_NAN_SPEC = os.environ.get("TNLG_TEST_NAN_AT")

if _NAN_SPEC and "RANK" in os.environ:
    import torch
    from tnlg.training import loop as _nan_loop

    _nan_iteration, _, _nan_rank = _NAN_SPEC.partition(":")
    _train_step = _nan_loop.train_step

    def _nan_train_step(model, *args, iteration, ps, **kwargs):
        if (iteration, ps.rank) == (int(_nan_iteration), int(_nan_rank or 0)):
            with torch.no_grad():
                model.transformer.wte.weight.view(-1)[0] = float("nan")
        return _train_step(model, *args, iteration=iteration, ps=ps, **kwargs)

    _nan_loop.train_step = _nan_train_step

# ``TNLG_TEST_NAN_PARAM_AFTER=N:RANK`` puts a NaN into that rank's word embeddings after iteration N's step (its
# loss was finite), as an update that overflows does: the checkpoint of iteration N must not be written.
_NAN_PARAM_SPEC = os.environ.get("TNLG_TEST_NAN_PARAM_AFTER")

if _NAN_PARAM_SPEC and "RANK" in os.environ:
    import torch
    from tnlg.training import loop as _nanp_loop

    _nanp_iteration, _, _nanp_rank = _NAN_PARAM_SPEC.partition(":")
    _nanp_train_step = _nanp_loop.train_step

    def _nan_param_train_step(model, *args, iteration, ps, **kwargs):
        out = _nanp_train_step(model, *args, iteration=iteration, ps=ps, **kwargs)
        if (iteration, ps.rank) == (int(_nanp_iteration), int(_nanp_rank or 0)):
            with torch.no_grad():
                model.transformer.wte.weight.view(-1)[0] = float("nan")
        return out

    _nanp_loop.train_step = _nan_param_train_step

# ``TNLG_TEST_ENOSPC_AT=N:RANK`` makes that rank's checkpoint writes of iteration N fail as a full disk
# does (``OSError(ENOSPC)`` from the first tensor written), the other ranks' writes succeed.
_ENOSPC_SPEC = os.environ.get("TNLG_TEST_ENOSPC_AT")

if _ENOSPC_SPEC and "RANK" in os.environ:
    import errno

    from tnlg.checkpoint import stream as _stream

    _full_iteration, _, _full_rank = _ENOSPC_SPEC.partition(":")
    _stream_write = _stream.StreamWriter.write

    def _full_write(self, key, tensor):
        if f"iter_{int(_full_iteration):07d}.tmp" in self.path and os.environ["RANK"] == (_full_rank or "0"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.tmp)
        return _stream_write(self, key, tensor)

    _stream.StreamWriter.write = _full_write

# ``TNLG_TEST_STALE_VIEW=KIND:RANK:N`` gives that rank a stale view of the save (or checkpoint) root, as a shared
# filesystem's attribute cache can right after another node wrote it: ``latest`` (the pointer reads N) or
# ``hidden`` (iteration directories after N are not seen).
_VIEW_SPEC = os.environ.get("TNLG_TEST_STALE_VIEW")

if _VIEW_SPEC and "RANK" in os.environ:
    import re as _re

    from tnlg.checkpoint import files as _files

    _kind, _view_rank, _view_iteration = _VIEW_SPEC.split(":")
    if os.environ["RANK"] == _view_rank and _kind == "latest":
        _files.read_latest = lambda root: int(_view_iteration)
    elif os.environ["RANK"] == _view_rank and _kind == "hidden":
        _meta_digest = _files.meta_digest

        def _stale_meta_digest(iter_dir):
            m = _re.search(r"iter_(\d+)$", iter_dir.rstrip("/"))
            if m and int(m.group(1)) > int(_view_iteration):
                raise FileNotFoundError(iter_dir)
            return _meta_digest(iter_dir)

        _files.meta_digest = _stale_meta_digest

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
