"""A hung collective ends in one message, not a traceback per rank.

When a rank stops answering (a stopped or deadlocked process, a dead node), every
other rank waits in its next collective until ``--distributed-timeout-minutes``
runs out; gloo then raises ``RuntimeError: ... Timed out waiting ...`` (or
``Application timeout caused pair closure``) inside ``dist.all_reduce`` on each
of them. :func:`report` turns that into one paragraph from rank 0:

    tnlg pretrain: a collective timed out after 1 min: all_reduce over the data-parallel
    group (ranks 0, 2), called from tnlg/training/step.py:60 (train_step), after iteration 37 (the
    last one completed). Ranks that did not report within 5 s: 3 (stopped, hung or dead). The last
    checkpoint is iteration 35 in runs/gpt. Resume with: tnlg pretrain ...

What timed out is read from the exception's traceback (the ``torch.distributed``
function, its ``group`` argument, the tnlg frame that called it, the loop's
``iteration``). Which ranks did not arrive is asked of the rendezvous store,
which outlives the broken process group: every rank that saw the timeout posts
its rank, rank 0 waits a few seconds and names the ranks that never posted,
prints, and tells the others they may exit (so the launcher does not tear the
group down before the message is out).

At PP > 1 a hang is most often a stage waiting on its neighbour: torch's schedule
waits on a point-to-point receive (``_wait_batch_p2p``), which the message names,
over the pipeline group. Each rank posts its place and where its schedule stood
(:mod:`tnlg.parallel.stage_progress`) with its ``alive``, and rank 0 adds one clause
per rank: ``Pipeline: rank 0 (pp 0, dp 0, tp 0: pipeline stage 0 of 2, layers 0-1)
waits for the gradient of micro batch 1 from stage 1 (rank 1) (started last: the
forward of micro batch 2); rank 1 (pp 1, dp 0, tp 0: pipeline stage 1 of 2, layers 2-3)
did not report.`` (a rank that does not answer is named by the place it wrote to the
store when it built its pipeline).

On NCCL the collective may never return to Python (the watchdog aborts the
process); :func:`enable_flight_recorder` therefore switches on torch's flight
recorder, as torchtitan does: each rank's recent collectives are dumped on a
timeout to ``<dir>/rank_<N>`` (read them with ``python -m torch.distributed.flight_recorder.fr_trace``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

__all__ = ["Hang", "is_collective_timeout", "is_collective_failure", "describe", "enable_flight_recorder",
           "make_dump_dir", "report"]

# how gloo, NCCL and the c10d store say that a wait ran out
_TIMEOUT_TEXT = ("timed out", "timeout caused pair closure", "watchdog caught collective operation timeout",
                 "collective operation timeout", "wait timeout")
# how gloo says that a peer went away (a rank that gave up first, or died): a consequence, not a cause
_PEER_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe")
_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "barrier", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
                "all_gather_object", "broadcast_object_list", "send", "recv", "monitored_barrier"}
_GROUP_NAMES = {"tp_group": "tensor-parallel", "dp_group": "data-parallel", "pp_group": "pipeline",
                "cp_group": "context-parallel", "dp_cp_group": "data-parallel x context-parallel",
                "embedding_group": "embedding (first and last pipeline stage)"}
_RING = os.path.join("parallel", "context.py")  # the ring attention: its K/V exchange waits on its requests
_P2P_WAIT = (os.path.join("distributed", "pipelining", "schedules.py"), "_wait_batch_p2p")  # torch's schedules
_PROGRESS = "tnlg.parallel.stage_progress"  # imported by a process that built a pipeline
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tnlg/
_LOOP = os.path.join(_PACKAGE, "training", "loop.py")  # the frame whose ``iteration`` and ``o`` are the run's
ARRIVAL_WAIT_S = 5.0  # how long rank 0 waits for the other ranks to say they are alive
FR_DIR_ENV = "TNLG_FLIGHT_RECORDER_DIR"  # the flight recorder's folder, made by make_dump_dir


@dataclass
class Hang:
    """What is known about a collective that timed out on this rank."""

    error: str
    collective: Optional[str] = None     # e.g. "all_reduce"
    group: Optional[str] = None          # "data-parallel group (ranks 0, 2)"
    caller: Optional[str] = None         # "tnlg/training/step.py:60 (train_step)"
    iteration: Optional[int] = None      # the last iteration completed
    options: Any = None                  # the run's options (``o``) when found
    missing: Optional[list] = None       # ranks that did not arrive (None: unknown)
    stages: list = field(default_factory=list)  # at PP > 1: each rank's place and where its schedule stood
    timed_out: bool = True               # False: the collective failed otherwise (a peer went away)
    extra: dict = field(default_factory=dict)


def is_collective_timeout(exc: BaseException) -> bool:
    """True for the errors a timed-out collective or store wait raises (gloo, NCCL, c10d store)."""
    if not isinstance(exc, RuntimeError):  # DistBackendError, DistStoreError are RuntimeErrors
        return False
    text = str(exc).lower()
    return any(t in text for t in _TIMEOUT_TEXT)


def _states(frames_locals: list[dict]) -> list:
    """The ParallelStates the frames hold: a ``ps`` local, or a method's ``self.ps`` (the model's)."""
    found = [loc.get("ps") for loc in frames_locals] + [getattr(loc.get("self"), "ps", None) for loc in frames_locals]
    return [ps for ps in found if ps is not None]


def _group_words(group, frames_locals: list[dict], fallback: str = "a process group") -> Optional[str]:
    import torch.distributed as dist

    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    except Exception:  # noqa: BLE001 - the group may be gone; the name is a nicety
        ranks = None
    try:
        default = dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001
        default = None
    name = "the default (world) group" if group is None or group is default else None
    named = [words for ps in _states(frames_locals) for attr, words in _GROUP_NAMES.items()
             if group is not None and getattr(ps, attr, None) is group]
    if named:  # a ParallelState in some frame names the group (the first of its names: DP before DP x CP)
        name = f"the {named[0]} group"
    if name is None:
        name = fallback
    return name + (f" (ranks {', '.join(map(str, ranks))})" if ranks else "")


def is_collective_failure(exc: BaseException) -> bool:
    """A timeout, or a peer that went away (it gave up first, or died): the errors other ranks see."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return is_collective_timeout(exc) or any(t in text for t in _PEER_TEXT)


def _waits(path: str, name: str) -> bool:
    """Whether frame ``name`` of file ``path`` is a ``torch.distributed`` collective, or torch's pipeline
    schedule waiting on its point-to-point sends and receives."""
    if path.endswith(_P2P_WAIT[0]):
        return name == _P2P_WAIT[1]
    return path.endswith(os.path.join("distributed", "distributed_c10d.py")) and name in _COLLECTIVES


def _what_waits(name: str, group, frames_locals: list[dict]) -> tuple[str, Optional[str]]:
    """``(what, its group in words)`` for a frame :func:`_waits` matched."""
    if name != _P2P_WAIT[1]:
        return name, _group_words(group, frames_locals)
    # a pipeline stage waiting on a neighbour: over the stages' group (this process's record holds it)
    progress = sys.modules.get(_PROGRESS)
    record = progress.current() if progress is not None else None
    what = "a point-to-point send/receive of the pipeline schedule"
    return what, None if record is None else _group_words(record.ps.pp_group, frames_locals + [dict(ps=record.ps)])


def describe(exc: BaseException) -> Hang:
    """Read what timed out from ``exc``'s traceback: the collective, its group, the tnlg caller, the iteration."""
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    hang = Hang(error=re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text),
                timed_out=is_collective_timeout(exc))
    frames = [(f, lineno) for f, lineno in traceback.walk_tb(exc.__traceback__)]
    all_locals = [f.f_locals for f, _ in frames]
    last_tnlg = None
    for f, lineno in frames:
        path = os.path.abspath(f.f_code.co_filename)
        name = f.f_code.co_name
        if path.startswith(_PACKAGE + os.sep):
            last_tnlg = (path, lineno, name)
            loc = f.f_locals
            if path == _LOOP and isinstance(loc.get("iteration"), int):
                hang.iteration = loc["iteration"]
                hang.options = loc.get("o", hang.options)
        elif hang.collective is None and _waits(path, name):
            hang.collective, hang.group = _what_waits(name, f.f_locals.get("group"), all_locals)
            if last_tnlg is not None:
                rel = os.path.relpath(last_tnlg[0], os.path.dirname(_PACKAGE))
                hang.caller = f"{rel}:{last_tnlg[1]} ({last_tnlg[2]})"
    if hang.collective is None:
        _ring_words(hang, frames, all_locals)
    return hang


def _ring_words(hang: Hang, frames: list, all_locals: list[dict]) -> None:
    """A hang inside the ring attention (the wait on its K/V exchange, a request of ``batch_isend_irecv``,
    which leaves no ``torch.distributed`` frame): the ring named, with its neighbours and the CP group."""
    for f, lineno in reversed(frames):
        ring = f.f_locals.get("ring")
        if os.path.abspath(f.f_code.co_filename).endswith(_RING) and hasattr(ring, "group"):
            hang.collective = (f"the ring attention's exchange of key/value blocks (sent to rank "
                               f"{getattr(ring, 'next', '?')}, received from rank {getattr(ring, 'prev', '?')})")
            hang.group = _group_words(ring.group, all_locals, fallback="the context-parallel group")
            if hang.caller is None:
                hang.caller = f"tnlg/parallel/context.py:{lineno} ({f.f_code.co_name})"
            return


def enable_flight_recorder(dump_dir: str) -> str:
    """Switch on torch's NCCL flight recorder (before the process group is created): on a collective
    timeout each rank dumps its recent collectives to ``<dump_dir>/rank_<N>``. Settings the user
    made are kept. Returns the dump path prefix. Nothing is created here: ``dump_dir`` is made by
    :func:`make_dump_dir` when a worker joined its group (after every option was validated)."""
    import torch

    prefix = os.path.join(os.path.abspath(dump_dir), "rank_")
    # torch 2.7 renamed the variables (the old buffer-size name then warns that it is deprecated)
    new = torch.__version__ >= "2.7"
    size, path = (("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if new
                  else ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    os.environ.setdefault(size, "20000")  # entries per rank (torchtitan's default)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault(path, prefix)
    if os.environ[path] == prefix:  # ours: the folder is made once the run is validated (make_dump_dir)
        os.environ[FR_DIR_ENV] = os.path.abspath(dump_dir)
    return os.environ[path]


def make_dump_dir() -> None:
    """Create the flight recorder's folder chosen by :func:`enable_flight_recorder` (a worker calls this once
    its options are validated and it joined its group: a run refused at start creates nothing)."""
    if os.environ.get(FR_DIR_ENV):
        os.makedirs(os.environ[FR_DIR_ENV], exist_ok=True)


def _pipeline_words(store, keys: list, missing: list) -> list:
    """At PP > 1, each rank's place and where its schedule stood: what it posted as ``alive`` or, for a rank
    that did not arrive, the place it wrote when it built its pipeline (:mod:`tnlg.parallel.stage_progress`)."""
    progress = sys.modules.get(_PROGRESS)
    if progress is None or progress.current() is None:
        return []
    words = []
    for r, key in enumerate(keys):
        place = progress.place_of(r, store) if r in missing else None
        words.append(f"rank {r}{f' ({place})' if place else ''} did not report" if r in missing
                     else store.get(key).decode())
    return words


def _arrivals(rank: int, world: int, wait_s: float) -> tuple[bool, Optional[list], Optional[Callable], list]:
    """``(speak, ranks that did not arrive, farewell, pipeline words)``, asked of the rendezvous store
    (``None``: unknown; the words: :func:`_pipeline_words`, for the rank that speaks).

    Every rank that saw the timeout posts ``alive`` (at PP > 1: its place and where its schedule
    stood). Rank 0 waits up to ``wait_s`` for the others, names the ones that never posted and posts
    ``told``; it speaks. Another rank waits for ``told``
    so that it exits only after rank 0's message (before it, the launcher would tear the group
    down); when ``told`` never comes (rank 0 is the one that hung: the store lives in its process,
    or it hangs outside a collective), rank 1 speaks instead. A rank that read ``told`` posts ``bye``;
    rank 0's ``farewell()``, called after its message, waits for those (up to 3 s) before its process,
    which holds the store, exits. Only non-blocking ``check`` calls with
    a short timeout are used, from a daemon thread: a ``wait`` or ``check`` on a stopped store server
    never returns.
    """
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        store = _get_default_store()
        store.set_timeout(timedelta(seconds=2))
        tag = f"tnlg/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        keys = [f"{tag}/alive/{r}" for r in range(world)]
        progress = sys.modules.get(_PROGRESS)
        record = progress.current() if progress is not None else None
        store.set(keys[rank], "1" if record is None else record.words())
        deadline = time.monotonic() + (wait_s if rank == 0 else wait_s + 5)
        done = keys if rank == 0 else [f"{tag}/told"]
        while time.monotonic() < deadline and not store.check(done):
            time.sleep(0.1)
        missing = [r for r in range(world) if not store.check([keys[r]])]
        if rank == 0:
            store.set(f"{tag}/told", "1")
            byes = [f"{tag}/bye/{r}" for r in range(1, world) if r not in missing]

            def farewell(timeout: float = 3.0) -> None:
                end = time.monotonic() + timeout
                while byes and time.monotonic() < end and not store.check(byes):
                    time.sleep(0.05)
            return True, missing, farewell, _pipeline_words(store, keys, missing)
        told = store.check([f"{tag}/told"])
        if told:
            store.set(f"{tag}/bye/{rank}", "1")
        speak = not told and rank == 1
        return speak, missing, None, _pipeline_words(store, keys, missing) if speak else []
    except Exception:  # noqa: BLE001 - the store lives in rank 0's process, which may be the hung one
        return rank == 1, None, None, []


def _last_checkpoint(save: Optional[str]) -> Optional[int]:
    from ..checkpoint.files import last_checkpoint  # (torch: hang.py itself imports none)
    try:
        return last_checkpoint(save)
    except Exception:  # noqa: BLE001 - a damaged folder: say nothing rather than fail again
        return None


def message(hang: Hang, command: str, resume: Optional[str], timeout_min: Optional[float]) -> str:
    """The paragraph rank 0 prints."""
    after = ""
    if timeout_min:
        after = f" after {timeout_min:g} min" if timeout_min >= 1 else f" after {timeout_min * 60:g} s"
    what = hang.collective or "a collective"
    text = (f"tnlg {command}: a collective timed out{after}: {what}" if hang.timed_out
            else f"tnlg {command}: a collective failed, a peer having closed its connection (it timed out "
                 f"first, or died): {what}")
    if hang.group:
        text += f" over {hang.group}"
    if hang.caller:
        text += f", called from {hang.caller}"
    if hang.iteration is not None:
        text += (f", after iteration {hang.iteration} (the last one completed)" if hang.iteration
                 else ", before the first iteration completed")
    text += "."
    if hang.missing:
        text += (f" Ranks that did not report within {hang.extra.get('wait_s', ARRIVAL_WAIT_S):g} s: "
                 f"{', '.join(map(str, hang.missing))} (stopped, hung or dead; "
                 f"their output above may say why).")
    elif hang.missing is None:
        text += (" Which ranks did not arrive is unknown: the rendezvous store, which rank 0 holds, did not "
                 "answer (rank 0 is probably the one that hung).")
    if hang.stages:
        text += f" Pipeline: {'; '.join(hang.stages)}."
    save = getattr(getattr(hang.options, "checkpoint", None), "save", None)
    last = _last_checkpoint(save)
    if save is None:
        text += " This run saved no checkpoint (no --save)."
    elif last is None:
        text += f" There is no checkpoint in {save} yet."
    else:
        text += f" The last checkpoint is iteration {last} in {save}."
    if resume:
        text += f" Resume with: {resume}"
    elif save is not None and last is not None:
        text += " Run the same command again to resume from it."
    text += f" (The error was: {hang.error})"
    return text


def report(exc: BaseException, command: str, resume: Optional[Callable[[Any], Optional[str]]] = None,
           wait_s: float = ARRIVAL_WAIT_S) -> Optional[int]:
    """If ``exc`` is a collective timeout (or failure: a peer that gave up first or died), find out what
    timed out and who did not arrive, print one message from rank 0 (stderr) and return the exit status
    (1); otherwise return ``None``.

    ``resume(options)`` may give the command that resumes the run."""
    if not is_collective_failure(exc):
        return None
    import torch.distributed as dist

    hang = describe(exc)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    speak, farewell = rank == 0, None
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        # in a daemon thread: a store call to a stopped server can block in recv() for ever
        result: list = []
        asking = threading.Thread(target=lambda: result.append(_arrivals(rank, world, wait_s)), daemon=True,
                                  name="tnlg-hang-arrivals")
        asking.start()
        asking.join(wait_s + 8)
        speak, hang.missing, farewell, hang.stages = result[0] if result else (rank == 1, None, None, [])
        hang.extra["wait_s"] = wait_s
    timeout_min = getattr(getattr(hang.options, "parallel", None), "distributed_timeout_minutes", None)
    if speak:
        cmd = None
        if resume is not None and hang.options is not None:
            try:
                cmd = resume(hang.options)
            except Exception:  # noqa: BLE001 - the message must come out
                cmd = None
        text = message(hang, command, cmd, timeout_min)
        if rank != 0:
            text = f"(from rank {rank}: rank 0 did not report) " + text
        print(text, file=sys.stderr, flush=True)
    if farewell is not None:
        bye = threading.Thread(target=farewell, daemon=True, name="tnlg-hang-farewell")
        bye.start()
        bye.join(5)
    return 1
