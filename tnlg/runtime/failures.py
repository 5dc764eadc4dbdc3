"""One error path for every rank: a rank's error reaches the user once, and the other ranks stop at once.

A rank that fails with a user error (bad options or data, a damaged checkpoint, a failed save) or a
diverged loss must not leave the other ranks waiting in their next collective for the whole
process-group timeout, and its message must reach the user whichever rank raised it. Two cases:

* **agreed** errors, raised on every rank after an agreement collective (a checkpoint that cannot
  be loaded, a save that failed on some rank, a NaN loss, which the DP all-reduce of the loss gives
  every rank): rank 0 prints the message once; the others exit without a word;
* **one rank's** error (only that rank knows): it posts the message on the failure board, a few keys
  in the rendezvous store (``<tag>/first``, ``<tag>/text``, ``<tag>/status``) that outlives any
  collective; every rank runs a watcher thread (:func:`watch`, started when a command joins its
  process group) that looks at the board every half second. Rank 0 prints
  ``tnlg pretrain: error on rank R of N: <message>`` (the board "gathers" it to the rank the user
  reads; at PP > 1 its pipeline stage and layers follow ``R of N``) and posts ``told``; every rank,
  blocked in a collective or not, then leaves at once (its groups are not torn down: a peer may sit
  in a collective). If rank 0 does not answer within 3 s (it is gone, or busy failing itself without
  a board to read), the failing rank prints the message itself. When several ranks fail, rank 0
  prints the first posted message and each other one that differs. Under tnlg's launcher the store
  lives in the launching process, so the board outlives every worker; under ``torchrun`` it lives
  in rank 0's agent or process.

A rank that dies (SIGKILL, the out-of-memory killer) posts nothing: its peers' collectives fail
(gloo: at once, the connection closes; NCCL: at the timeout) and the launcher stops the group.

Before a process group exists there is no board: the error is printed by rank 0 of a launcher's
group (every rank of ``torchrun`` validates the same arguments) and by every rank started by hand
or by another launcher (``RANK=1 WORLD_SIZE=2 tnlg ...``), with its rank named.

Exit status: under tnlg's own launcher (``--nproc-per-node``), which sets ``TNLG_LAUNCH_STATUS`` to a
file it reads afterwards, every worker of a failure it has reported exits 0 and the status goes
into that file (2 for a user error, 1 for a divergence): the elastic agent then neither restarts
the group under ``--max-restarts`` (a bad option or a diverging run fails the same way again) nor
prints its own "failed (exitcode: 2)" lines after our message. Elsewhere (``torchrun``) every
rank exits with the status.

This module imports torch only when a process group exists.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

__all__ = ["STATUS_FILE_ENV", "arm", "watch", "report", "peer_failure", "stopped_by_peer", "final_status",
           "is_agreed"]

STATUS_FILE_ENV = "TNLG_LAUNCH_STATUS"  # set by tnlg.runtime.launch for its workers: where a reported failure's status goes
POLL_S = 0.5         # how often the watcher looks at the board
ANSWER_WAIT_S = 3.0  # how long a rank waits for rank 0 to print (and rank 0 for the others to read it)

_handling = threading.Event()  # this process is reporting its own error: its watcher stays quiet
_watching: dict = {}


def is_agreed(exc: BaseException) -> bool:
    """Whether ``exc`` is raised on every rank alike (:func:`tnlg.errors.agreed`)."""
    return bool(getattr(exc, "agreed", False))


def _group() -> Optional[tuple[int, int]]:
    """``(rank, world)`` of this process's default group when it is one of several, else ``None``."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def _tag() -> str:
    return f"tnlg/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    from torch.distributed.distributed_c10d import _get_default_store
    return _get_default_store()


def _bounded(fn: Callable, timeout: float, default=None):
    """``fn()`` in a daemon thread, given up after ``timeout`` s: a store call to a stopped store server
    may never return."""
    out: list = []

    def call():
        try:
            out.append(fn())
        except Exception:  # noqa: BLE001 - the store's host is gone: the caller falls back
            pass
    t = threading.Thread(target=call, daemon=True, name="tnlg-failure-store")
    t.start()
    t.join(timeout)
    return out[0] if out else default


def _wait_for(store, keys: list, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if store.check(keys):
            return True
        time.sleep(0.05)
    return False


def _read_it(store, tag: str, rank: int) -> None:
    """A rank other than 0 says it has read ``told`` and the status (rank 0 may then leave, and the store with it)."""
    _bounded(lambda: store.set(f"{tag}/read-{rank}", "1"), 2.0)


def _let_the_others_read(store, tag: str, world: int) -> None:
    """Rank 0, after posting ``told``: wait until every other rank read it (:func:`_read_it`), at most ``POLL_S``
    + 0.5 s (a rank that is gone never says so). The store may live in this process (``torchrun``'s workers
    by hand, rank 0 hosting it): leaving at once would take the answer away from the ranks still to read it."""
    wait = POLL_S + 0.5
    _bounded(lambda: _wait_for(store, [f"{tag}/read-{r}" for r in range(1, world)], wait), wait + 1)


def _record(status: int) -> bool:
    """Leave ``status`` in tnlg's launcher's status file; ``False`` when not under it."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return False
    try:
        from ..io import atomic_write
        atomic_write(path, f"{status}\n", durable=False)
    except OSError:
        return False
    return True


def final_status(status: int) -> int:
    """The exit status of a worker whose failure was reported: 0 under tnlg's launcher (``status`` goes to
    its status file), else ``status``."""
    return 0 if _record(status) else status


def _leave(status: int) -> None:
    from .process_exit import leave
    leave(final_status(status), destroy=False)


def peer_failure() -> Optional[int]:
    """The rank that posted a failure on the board (``None``: none did, or no board)."""
    if _group() is None:
        return None
    first = _bounded(lambda: _store().get(f"{_tag()}/first") if _store().check([f"{_tag()}/first"]) else None, 2.0)
    return int(first) if first else None


def _rank_words(rank, world: int, store) -> str:
    """``rank R of N``; at PP > 1 with the rank's pipeline place, ``rank 1 of 2 (pp 1, dp 0, tp 0: pipeline
    stage 1 of 2, layers 2-3)`` (:func:`tnlg.parallel.stage_progress.place_of`)."""
    progress = sys.modules.get("tnlg.parallel.stage_progress")
    place = None if progress is None else _bounded(lambda: progress.place_of(int(rank), store), 2.0)
    return f"rank {rank} of {world}" + (f" ({place})" if place else "")


def _speak_for(command: str, world: int, store, tag: str) -> None:
    """Rank 0: print the posted failure of another rank, say so on the board."""
    first = int(store.get(f"{tag}/first"))
    _wait_for(store, [f"{tag}/text"], 1.0)
    text = store.get(f"{tag}/text").decode() if store.check([f"{tag}/text"]) else "(its message was not posted)"
    print(f"tnlg {command}: error on {_rank_words(first, world, store)}: {text}", file=sys.stderr, flush=True)
    store.set(f"{tag}/told", "1")


def arm(command: str) -> None:
    """Name the command whose failures this process reports (``tnlg <command>: ...``)."""
    _watching["command"] = command


def watch() -> None:
    """Start this process's watcher of the failure board (once; only in a group of several processes)."""
    group = _group()
    if group is None:
        return
    rank, world = group
    store, tag, command = _store(), _tag(), _watching.get("command", "run")
    if _watching.get("store") is store and _watching["thread"].is_alive():
        return  # (a process that joins a new group later gets a watcher of that group's store)

    def run():
        while True:
            time.sleep(POLL_S)
            try:
                if id(_watching.get("store")) != id(store):  # the process moved on to another group
                    return
                if _handling.is_set() or not store.check([f"{tag}/first"]):
                    continue
                if int(store.get(f"{tag}/first")) == rank:
                    continue
            except Exception:  # noqa: BLE001 - the store is gone (rank 0's process): the collectives fail too
                return
            _handling.set()
            status = 2
            try:
                if rank == 0:
                    _speak_for(command, world, store, tag)
                else:
                    _wait_for(store, [f"{tag}/told"], ANSWER_WAIT_S)
                status = int(store.get(f"{tag}/status")) if store.check([f"{tag}/status"]) else 2
                if rank == 0:
                    _let_the_others_read(store, tag, world)
                else:
                    _read_it(store, tag, rank)
            except Exception:  # noqa: BLE001 - leave all the same: the failing rank's message is out
                pass
            _leave(status)
    t = threading.Thread(target=run, daemon=True, name="tnlg-failure-watch")
    _watching.update(thread=t, store=store)
    t.start()


def stopped_by_peer() -> Optional[int]:
    """When another rank posted a failure (this rank's collective then fails too): wait until rank 0 said
    so and return this process's exit status; ``None`` when no rank did."""
    if peer_failure() is None:
        return None
    _handling.set()
    store, tag = _store(), _tag()
    _bounded(lambda: _wait_for(store, [f"{tag}/told"], ANSWER_WAIT_S), ANSWER_WAIT_S + 1)
    status = _bounded(lambda: int(store.get(f"{tag}/status")), 2.0, 2)
    group = _group()
    if group is not None and group[0] != 0:
        _read_it(store, tag, group[0])
    return final_status(status)


def _report_without_group(command: str, text: str, status: int) -> int:
    """Before a process group exists: rank 0 prints; a rank started by hand or by another launcher too."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched_same_args = "TORCHELASTIC_RUN_ID" in os.environ  # rank 0 validated the same arguments
    if rank == 0 or world == 1:
        print(f"tnlg {command}: error: {text}", file=sys.stderr, flush=True)
    elif not launched_same_args:
        print(f"tnlg {command}: error on rank {rank} of {world}: {text}", file=sys.stderr, flush=True)
    else:
        return status
    _record(status)  # the launcher's own failure lines would only repeat it; the exit stays non-zero:
    return status    # without a group, the launcher must stop the ranks that wait for this one


def _report_agreed(command: str, text: str, status: int, rank: int, world: int, store, tag: str) -> int:
    """An error every rank raises alike: rank 0 prints it; the others leave once it did (a launcher would
    stop rank 0 as soon as another rank exits)."""
    if rank == 0:
        print(f"tnlg {command}: error: {text}", file=sys.stderr, flush=True)
        _bounded(lambda: store.set(f"{tag}/agreed", "1"), 2.0)
        _bounded(lambda: _wait_for(store, [f"{tag}/agreed-{r}" for r in range(1, world)], ANSWER_WAIT_S),
                 ANSWER_WAIT_S + 1)
    else:
        _bounded(lambda: _wait_for(store, [f"{tag}/agreed"], ANSWER_WAIT_S), ANSWER_WAIT_S + 1)
        _bounded(lambda: store.set(f"{tag}/agreed-{rank}", "1"), 2.0)
    return final_status(status)


def report(command: str, text: str, status: int, agreed: bool) -> int:
    """Print a failure of this process once for the whole job; return the exit status for this process.

    ``text`` is the message without the ``tnlg <command>: error:`` prefix. See the module docstring
    for who prints it.
    """
    _handling.set()
    group = _group()
    if group is None:
        return _report_without_group(command, text, status)
    rank, world = group
    store, tag = _store(), _tag()
    if agreed:
        return _report_agreed(command, text, status, rank, world, store, tag)

    def post():
        won = store.compare_set(f"{tag}/first", "", str(rank)).decode() == str(rank)
        if won:
            store.set(f"{tag}/text", text)
            store.set(f"{tag}/status", str(status))
        return won
    won = _bounded(post, 2.0)
    if won and rank == 0:
        print(f"tnlg {command}: error on {_rank_words(0, world, store)}: {text}", file=sys.stderr, flush=True)
        _bounded(lambda: store.set(f"{tag}/told", "1"), 2.0)
        _let_the_others_read(store, tag, world)
    elif won:
        told = _bounded(lambda: _wait_for(store, [f"{tag}/told"], ANSWER_WAIT_S), ANSWER_WAIT_S + 1)
        _read_it(store, tag, rank)
        if not told:  # rank 0 did not answer: say it here
            print(f"tnlg {command}: error on {_rank_words(rank, world, store)} (rank 0 did not answer): {text}",
                  file=sys.stderr, flush=True)
    else:  # another rank failed first (or the store is gone)
        first = _bounded(lambda: store.get(f"{tag}/first").decode(), 2.0)
        _bounded(lambda: _wait_for(store, [f"{tag}/text"], 1.0), 2.0)
        first_text = _bounded(lambda: store.get(f"{tag}/text").decode(), 2.0)
        if rank == 0 and first is not None:  # rank 0 speaks for the board (its watcher stands aside now)
            print(f"tnlg {command}: error on {_rank_words(first, world, store)}: {first_text}", file=sys.stderr,
                  flush=True)
        if first_text != text:  # this rank's own error is new information
            print(f"tnlg {command}: error on {_rank_words(rank, world, store)}"
                  f"{'' if first is None else f' (rank {first} failed first)'}: {text}", file=sys.stderr, flush=True)
        if rank == 0:
            _bounded(lambda: store.set(f"{tag}/told", "1"), 2.0)
            _let_the_others_read(store, tag, world)
        else:
            _bounded(lambda: _wait_for(store, [f"{tag}/told"], ANSWER_WAIT_S), ANSWER_WAIT_S + 1)
            _read_it(store, tag, rank)
    return final_status(status)
