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
from typing import Any, Callable, Iterator, Optional

from .. import checkpoint as ckpt
from ..checkpoint.files import check_files, lock_root, no_weights
from ..checkpoint.signals import StopOnSignal
from ..errors import UserError, agreed
from ..options import MUST_MATCH, Options
from ..parallel.state import ParallelState, from_rank0
from .step import TrainingDiverged

__all__ = ["Checkpointer", "stop_on_signals", "check_resume", "source"]


def check_resume(o: Options) -> None:
    """The resume checks, made in the launching process before any worker starts (a checkpoint that does
    not match this run, e.g. another ``--hidden-size``, is reported like any bad option: at once, once,
    and without a launcher's failure lines after it): the checkpoint a resume would load (``--load``,
    else ``--save`` when it holds one) is found, its manifest read, its files checked at their sizes
    and its architecture, data and tokenizer compared with this run's; and a ``--save`` root another
    job holds is refused. The workers check again (a file may change in between)."""
    from ..checkpoint.compat import check_compatible
    from ..data.tokenizer import load_tokenizer
    from ..options import model_config

    c = o.checkpoint
    if c.save:
        lock_root(os.path.abspath(c.save), probe=True)
    load_dir, origin, weights_only = source(o)
    if not load_dir or (origin == "--save" and not os.path.isdir(load_dir)):
        return
    iter_dir = ckpt.resolve(load_dir, origin)
    if iter_dir is None and weights_only:
        raise no_weights(load_dir, origin)
    if iter_dir is None:
        return
    meta = ckpt.read_meta(iter_dir)
    tokenizer = load_tokenizer(o.data.tokenizer_path())
    cfg = model_config(o, tokenizer.vocab_size)
    if weights_only:
        ckpt.Manifest.of(meta).check_holds_weights(f"{origin} {iter_dir!r}")
    else:  # an adapter run resumed as one, on its own base (its identity), with its settings
        from .adapter_checkpoint import check_adapter_resume, planned_record
        check_adapter_resume(ckpt.Manifest.of(meta), iter_dir, planned_record(o, cfg) if o.adapters.enabled else None,
                             cfg)
    check_compatible(meta, iter_dir, cfg, None if weights_only else o, tokenizer,
                     origin, () if weights_only else MUST_MATCH, weights_only=weights_only)
    check_files(iter_dir, meta, ("model",) if weights_only else ("model", "optim", "rng"))


def source(o: Options) -> tuple[Optional[str], str, bool]:
    """``(folder, its flag, weights only)``: what a run starts from. ``--load``, else ``--save`` (a run's
    own checkpoints, for elastic restarts and resuming). With ``--finetune``, a ``--save`` that holds a
    checkpoint is this fine-tuning run's own and is resumed whole; otherwise ``--load``'s weights alone."""
    from ..checkpoint.files import last_checkpoint
    c = o.checkpoint
    if c.finetune:
        if c.save and os.path.isdir(c.save) and last_checkpoint(c.save) is not None:
            return c.save, "--save", False
        return c.load, "--load", True
    return (c.load, "--load", False) if c.load else (c.save, "--save", False)


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
        self._lock = None
        self._steps_before_moments = 0  # LR schedule steps taken before Adam's moments began (a converted model)
        self._adapters: Optional[Any] = None  # an adapter run's AdapterRun (.adapter_checkpoint), once needed

    @property
    def schedule_steps(self) -> int:
        """The LR schedule's position: optimizer steps taken, counting those of the run a converted
        checkpoint came from (its iteration) when training resumed it with fresh Adam moments."""
        return self._state["engine"].num_steps + self._steps_before_moments

    def claim_save_root(self) -> None:
        """Rank 0 takes the ``--save`` root's lock for the run (a second job saving there is refused with a
        clear error); every rank learns the outcome. Collective (one broadcast) when ``--save`` is set.
        Called once the checkpoint (if any) is loaded: a run refused at start writes nothing."""
        save = self.o.checkpoint.save
        if not save:
            return
        error = None
        if self.ps.rank == 0:
            try:
                self._lock = lock_root(os.path.abspath(save))
            except UserError as exc:
                error = str(exc)
            except OSError as exc:
                error = f"--save {save!r} cannot be used: {exc}"
        error = from_rank0(error)
        if error is not None:
            raise agreed(UserError(error))

    def release(self) -> None:
        """Let go of the save root's lock (the end of the run)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def resume(self) -> tuple[int, int]:
        """``(iteration, consumed samples)`` of the checkpoint loaded into the model and engine: ``--load``,
        else ``--save`` when it holds one (elastic restarts rely on it); ``(0, 0)`` from scratch. An adapter
        run reads its base when its model is built: it loads its own checkpoint only (the adapters and the run's
        state, :mod:`.adapter_checkpoint`), after checking its base and settings are the checkpoint's.

        Collective on every rank alike: rank 0 decides whether and what to load (no rank looks at the
        folder on its own first, see :func:`tnlg.checkpoint.load`)."""
        load_dir, origin, weights_only = source(self.o)
        if self.o.adapters.enabled and weights_only:  # a new adapter run: its base was read into the model
            self._adapter_run()  # (the base's identity, as the run read it)
            self.claim_save_root()
            self.log(f"fine-tuning adapters on the frozen weights of {load_dir}: iteration 0, a new optimizer")
            return 0, 0
        if load_dir and not weights_only:
            self._check_adapters(load_dir, origin)
        state = ckpt.load(load_dir, origin=origin, missing_ok=origin == "--save", must_match=MUST_MATCH,
                          weights_only=weights_only, **self._states()) if load_dir else None
        self.claim_save_root()
        if state is None:
            return 0, 0
        iteration, consumed = state["iteration"], state["consumed_samples"]
        self._steps_before_moments = state["schedule_steps"] - self._state["engine"].num_steps
        if weights_only:
            self.log(f"fine-tuning the weights of {state['path']}: iteration 0, a new optimizer and LR schedule")
            return 0, 0
        self.log(f"resumed from {state['path']} at iteration {iteration} ({consumed} samples consumed)")
        return iteration, consumed

    def _adapter_run(self):
        """The adapters' view of the model, their record and settings (an adapter run's; built once)."""
        from .adapter_checkpoint import AdapterRun
        if self._adapters is None:
            self._adapters = AdapterRun.of(self._state["model"], self.o, self._state["config"])
        return self._adapters

    def _states(self) -> dict:
        """What :func:`tnlg.checkpoint.save` and :func:`~tnlg.checkpoint.load` are given: the run's model, engine
        and options; an adapter run's model as its adapters' view (the checkpoint's parameters are the adapters)."""
        if not self.o.adapters.enabled:
            return self._state
        return dict(self._state, model=self._adapter_run().view)

    def _check_adapters(self, load_dir: str, origin: str) -> None:
        """Rank 0 checks that the checkpoint a resume loads is of this kind of run, and for an adapter run of its
        base and settings (:func:`.adapter_checkpoint.check_adapter_resume`); every rank raises its finding.
        Collective (one broadcast)."""
        from .adapter_checkpoint import check_adapter_resume
        error = None
        if self.ps.rank == 0:
            try:
                iter_dir = ckpt.resolve(load_dir, origin) if os.path.isdir(load_dir) else None
                if iter_dir is not None:  # (a broken folder: the load's own checks say what is wrong)
                    planned = self._adapter_run().record if self.o.adapters.enabled else None
                    check_adapter_resume(ckpt.Manifest.read(iter_dir), iter_dir, planned, self._state["config"])
            except UserError as exc:
                error = str(exc)
        error = from_rank0(error)
        if error is not None:
            raise agreed(UserError(error))

    def _save_adapters(self, save: str) -> str:
        """PEFT's folder of the adapters as ``SAVE/adapter`` (:func:`.adapters.save_adapters`); collective."""
        from .adapters import save_adapters
        return save_adapters(self._state["model"], save, self._adapter_run().settings, self.o.checkpoint.load)

    def after_step(self, iteration: int, consumed: int, last: bool) -> Optional[dict]:
        """Save when due (the interval, the last iteration, a stop signal, ``--exit-interval``); return how the
        run stops here (a signal: ``signal``; ``--exit-interval``: ``exit_interval``), else ``None``.
        Collective: the signal check and the save. Parameters that are not finite are never saved:
        :class:`~.step.TrainingDiverged` on every rank alike (the loop then names the last checkpoint, which is
        finite)."""
        c = self.o.checkpoint
        signum = 0 if last else self.stop.agreed(self.ps)
        exiting = not last and not signum and c.exit_interval is not None and iteration % c.exit_interval == 0
        save = c.save
        saving = bool(save) and bool((c.save_interval and iteration % c.save_interval == 0) or last or signum
                                     or exiting)
        adapters = self.o.adapters.enabled
        if saving and save:
            try:  # (an adapter run: the adapters and the run's state, its base named by the record)
                ckpt.save(save, iteration=iteration, consumed_samples=consumed, keep_last=c.keep_last,
                          schedule_steps=self.schedule_steps, adapters=self._adapter_run().record if adapters else None,
                          **self._states())
            except ckpt.NonFiniteParameters as exc:  # every rank alike: the loop stops as on a NaN loss
                raise TrainingDiverged(f"the model's parameters are not finite after iteration {iteration}: {exc}. "
                                       "Lower --lr, raise --lr-warmup-iters, or check the data (or the "
                                       "checkpoint this run started from).") from None
            self.log(f"saved checkpoint at iteration {iteration} to {c.save}")
            if adapters:
                self.log(f"saved the adapters at iteration {iteration} to {self._save_adapters(save)}")
        if exiting:
            return dict(exit_interval=c.exit_interval, iteration=iteration, saved=saving)
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
