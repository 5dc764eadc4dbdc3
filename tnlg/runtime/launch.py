"""Launching local worker processes with torch's own elastic launcher (what ``torchrun`` runs), and
joining the process group as one of them: the one place every command (``pretrain``, ``eval``,
``generate``) launches and joins.

A command that accepts ``--nproc-per-node N`` calls :func:`relaunch` (the options
rebuilt with :func:`argv_of`, then :func:`maybe_launch`) in the launching process
after validating its options; a worker calls :func:`join`. Under ``torchrun`` (or with
N = 1) it returns ``None`` and the caller runs in-process; otherwise it runs
``python -m tnlg <command> <same args>`` in N processes through
``torch.distributed.launcher.api.elastic_launch`` (c10d rendezvous through a store
this process serves on loopback only, see :func:`loopback_store`; ``max_restarts``
restarts the whole group after a failure, as ``torchrun --max-restarts`` does) and
returns the exit status. ``--nnodes N --rdzv-endpoint HOST:PORT`` (``tnlg eval``, ``tnlg
generate``) runs one such launcher per node: the one on ``HOST`` serves the store on exactly
``HOST:PORT`` (:func:`endpoint_store`), the others join it; ``torchrun`` does the same for any
command. The workers' gloo sockets bind by the same rule: to loopback on one node, to the interface
of the route to ``HOST`` on several, or to the user's own ``GLOO_SOCKET_IFNAME``
(:mod:`tnlg.runtime.interfaces`).

A worker that reported a failure itself (:mod:`tnlg.runtime.failures`) leaves its exit status in
a file this process reads: the group is then not restarted, and the agent's own
"failed (exitcode: N)" lines, which would only repeat the message, are not printed.

The workers get exactly the arguments the caller hands over (rebuilt from the
parsed options with :func:`argv_of`, never read again from ``sys.argv``: a
command called from Python with a list runs the settings it validated).

A SIGINT (Ctrl-C) or SIGTERM to the launching process is forwarded once to each
worker (each runs in its own session, so a terminal's Ctrl-C reaches only the
launcher), which stops at the end of its iteration and reports on rank 0; the
launcher then returns ``128 + signal`` without a traceback. A SIGKILL cannot be forwarded: each worker
ends by itself when this process dies (:mod:`tnlg.runtime.orphans`).

When the job ends (a failure, a hang report) the agent closes the workers still alive with SIGTERM and
waits up to 30 s before SIGKILL. A stopped worker (SIGSTOP, Ctrl-Z of its own terminal) would act on
that SIGTERM only once continued, so the launch would sit out the whole 30 s: as a shell does for a
stopped job it kills, the launcher continues (SIGCONT) each worker the agent closes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from .failures import STATUS_FILE_ENV
from .interfaces import GLOO_IFNAME_ENV, gloo_interface
from .orphans import LAUNCHER_PID_ENV

STORE_ENV = "TNLG_STORE"  # host:port of the launcher's loopback store, for its workers (tnlg.parallel.state)

if TYPE_CHECKING:
    from ..parallel.state import ParallelState

__all__ = ["under_launcher", "is_rank0", "speaks_for_job", "launcher_world_size", "maybe_launch", "relaunch", "join",
           "argv_of"]


def under_launcher() -> bool:
    """True inside a process started by torchrun / elastic_launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def is_rank0() -> bool:
    """True in the process that speaks for all: global rank 0 of a launcher's group, or the only process."""
    return os.environ.get("RANK", "0") == "0"


def speaks_for_job() -> bool:
    """Whether this process says what is said once for a whole job (a note about its settings): the process
    the user started (it launches the workers, or runs alone), or global rank 0 under a launcher that is not
    tnlg's own (``torchrun``, where no tnlg process ran before the workers). tnlg's own workers find
    :data:`STORE_ENV` set by the process that launched them, which spoke already."""
    return not under_launcher() or (is_rank0() and STORE_ENV not in os.environ)


def launcher_world_size() -> Optional[int]:
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else None


def _serve_store(listener: socket.socket):
    """A c10d ``TCPStore`` served by this process on ``listener`` (bound and listening), given up after
    5 minutes without a client."""
    from datetime import timedelta

    import torch.distributed as dist
    host, port = listener.getsockname()[:2]
    return dist.TCPStore(host, port, is_master=True, master_listen_fd=listener.detach(), multi_tenant=True,
                         wait_for_workers=False, timeout=timedelta(minutes=5))


def check_nodes(nnodes: int, rdzv_endpoint: Optional[str]) -> None:
    """``--nnodes`` and ``--rdzv-endpoint`` go together; the endpoint is ``HOST:PORT``."""
    from ..errors import UserError
    if nnodes < 1:
        raise UserError(f"--nnodes must be >= 1, got {nnodes}.")
    if (nnodes > 1) != bool(rdzv_endpoint):
        raise UserError("--nnodes N (N > 1) and --rdzv-endpoint HOST:PORT go together: every node's launcher "
                        "meets the others at that address, e.g. --nnodes 2 --rdzv-endpoint node0:29500 "
                        f"(got --nnodes {nnodes} and --rdzv-endpoint {rdzv_endpoint!r}).")
    if rdzv_endpoint:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT (a port 1-65535 on the host of "
                            "the first node, which every node reaches), e.g. node0:29500.")
        try:
            socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as err:
            raise UserError(f"--rdzv-endpoint {rdzv_endpoint!r}: the host {host!r} does not resolve to an address "
                            f"here ({getattr(err, 'strerror', None) or err}). Give the first node's host name or IP "
                            "address as every node reaches it, the same on every node, e.g. node0:29500 or "
                            "10.0.0.1:29500.") from None


def endpoint_store(endpoint: str):
    """``(store or None, endpoint)`` for a job of several nodes meeting at ``endpoint`` (``HOST:PORT``): the
    launcher that can bind exactly that address serves the store there (the node named ``HOST``, or the
    first launcher on it); the others (``None``) are its clients. Nothing is bound anywhere else."""
    host, _, port = endpoint.rpartition(":")
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host.strip("[]"), int(port)))
        listener.listen(1024)
    except OSError:  # another node's address, or its launcher serves it already
        listener.close()
        return None, endpoint
    return _serve_store(listener), endpoint


def loopback_store():
    """``(store, "127.0.0.1:PORT")``: a c10d ``TCPStore`` served by this process on loopback only.

    torch's ``TCPStore`` binds its server to every interface (``::``) whatever host it is given; it
    is therefore handed a socket already bound to 127.0.0.1 and listening (``master_listen_fd``),
    which also leaves no window between choosing a free port and using it. The launcher's elastic
    agent rendezvous through it, and its workers make their process group from it (one key prefix
    per restart: a restarted group never reads the dead group's addresses), so nothing listens
    beyond loopback and the store outlives any worker."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    return _serve_store(listener), f"127.0.0.1:{port}"


def argv_of(add_arguments: Callable[[argparse.ArgumentParser], None], args: argparse.Namespace,
            drop: tuple[str, ...] = ()) -> list[str]:
    """Command-line arguments that parse back to ``args`` under a parser built by ``add_arguments``.

    An option is written when ``args`` holds it and it differs from the parser's default (with
    ``argparse.SUPPRESS`` defaults, as ``tnlg pretrain`` uses: exactly the options that were
    given). ``drop`` names destinations to leave out.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    argv: list[str] = []
    done = set()
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in ("help",) or dest in drop or dest in done:
            continue
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if action.default is not argparse.SUPPRESS and value == action.default:
            continue
        flip = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if flip and value == isinstance(action, argparse._StoreFalseAction):
            continue  # a switch that says the other value: another spelling of it may say this one (--no-x)
        done.add(dest)
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if flip:
            argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            argv += [f"{flag}={v}" for v in value or []]
        elif isinstance(value, (list, tuple)):  # nargs="+"
            argv += [flag, *map(str, value)]
        elif value is not None:
            text = str(value)
            argv += [f"{flag}={text}"] if text.startswith("-") or not text else [flag, text]
    return argv


def relaunch(command: str, add_arguments: Callable[[argparse.ArgumentParser], None], args: argparse.Namespace,
             nproc: int, *, extra: Sequence[str] = (), max_restarts: int = 0, nnodes: int = 1,
             rdzv_endpoint: Optional[str] = None) -> Optional[int]:
    """Run ``tnlg <command>`` with the options of ``args`` (parsed by a parser built by ``add_arguments``),
    plus ``extra`` arguments, on ``nproc`` local processes (of ``nnodes`` nodes meeting at
    ``rdzv_endpoint``) and return their exit status; ``None`` to run here (under a launcher already,
    or one process in all)."""
    return maybe_launch(command, argv_of(add_arguments, args) + list(extra), nproc, max_restarts=max_restarts,
                        nnodes=nnodes, rdzv_endpoint=rdzv_endpoint)


def join(tensor_parallel_size: int, **kwargs) -> "ParallelState":
    """This process's :class:`tnlg.parallel.state.ParallelState` as a worker of a command: ``tnlg.init_parallel``
    (:func:`tnlg.parallel.process_settings.init_parallel`: the launcher's process group, or a world of one
    without a launcher, ``kwargs`` its ``timeout``, ``device``, ...; then the cores shared among the local ranks
    and, on a CPU, glibc's heap keeping freed blocks: the settings a user's script gets alike), then the
    watcher of the other ranks' failures and the flight recorder's folder."""
    from .failures import watch
    from .hang import make_dump_dir
    from ..parallel.process_settings import init_parallel
    ps = init_parallel(tensor_parallel_size, **kwargs)
    watch()  # another rank's failure stops this one at once (tnlg.runtime.failures)
    make_dump_dir()
    return ps


def maybe_launch(command: str, argv: list[str], nproc: int, max_restarts: int = 0, nnodes: int = 1,
                 rdzv_endpoint: Optional[str] = None) -> Optional[int]:
    """Run ``tnlg <command> argv`` on ``nproc`` local processes, or return ``None`` to run here.

    ``nnodes`` > 1: this node's share of a job whose ``nnodes`` launchers meet at ``rdzv_endpoint``
    (``HOST:PORT``, the same on every node; :func:`endpoint_store`). Without it the store listens on
    loopback only (:func:`loopback_store`)."""
    if under_launcher() or nproc * nnodes == 1:
        return None
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher.api import elastic_launch

    child_args = ["-m", "tnlg", command, *argv]  # exactly as given; under the launcher N is not read again
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # the workers use this process's store (below), not one of their own on every interface
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # the elastic agent replaces these handlers (a signal -> SignalException -> forwarded to the workers)
    # and does not put them back; restore them on the way out
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    # the agent's logs folder and the status a worker leaves after reporting a failure itself; removed after
    status_dir = tempfile.mkdtemp(prefix="tnlg-launch-")
    status_file = os.environ[STATUS_FILE_ENV] = os.path.join(status_dir, "status")
    store, endpoint = endpoint_store(rdzv_endpoint) if rdzv_endpoint else loopback_store()
    workers_env = _workers_env(endpoint, rdzv_endpoint)
    config = _launch_config(nproc, nnodes, endpoint, bool(rdzv_endpoint), status_dir, max_restarts)
    quiet, wake = _QuietLines(status_file), _ContinueClosedWorkers()
    loggers = [logging.getLogger(n) for n in _ELASTIC_LOGGERS]
    for lg in loggers:
        lg.addFilter(wake)
        lg.addFilter(quiet)
    try:
        elastic_launch(config, sys.executable)(*child_args)
        return _reported_status(status_file) or 0
    except ChildFailedError as err:
        reported = _reported_status(status_file)  # a worker said why (before its group existed)
        if reported is not None:
            return reported
        rank, first = err.get_first_failure()  # the root cause, not the peers it took down
        print(f"tnlg {command}: worker rank {rank} {_how_it_ended(first.exitcode)}.", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 1
    except RendezvousConnectionError as err:
        raise _unreachable(command, endpoint, err) from None
    except SignalException as err:
        # the workers got the signal once, finished their iteration and rank 0 said where things stand
        return 128 + int(err.sigval)
    finally:
        os.environ.pop(STATUS_FILE_ENV, None)
        for var in workers_env:
            os.environ.pop(var, None)
        del store
        shutil.rmtree(status_dir, ignore_errors=True)
        for lg in loggers:
            lg.removeFilter(wake)
            lg.removeFilter(quiet)
        if _in_main_thread():
            for s, h in handlers.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)


def _unreachable(command: str, endpoint: str, err: BaseException):
    """The one paragraph for a rendezvous this node's launcher cannot reach (instead of torch's frames)."""
    from ..errors import UserError
    return UserError(f"tnlg {command}: this node's launcher could not reach the rendezvous at {endpoint} "
                     f"({err.__cause__ or err}). Check that --rdzv-endpoint names the first node's address and a "
                     "port it can listen on, and that the first node's command runs.")


def _workers_env(endpoint: str, rdzv_endpoint: Optional[str]) -> list[str]:
    """Set what the workers read from this process's environment (the names set, to take out after): the
    store's address, this process's pid (they end when it dies, :mod:`tnlg.runtime.orphans`) and the
    interface gloo binds to (where the store is, :mod:`tnlg.runtime.interfaces`; the user's own wins)."""
    os.environ[STORE_ENV] = endpoint
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    names = [STORE_ENV, LAUNCHER_PID_ENV]
    ifname = None if os.environ.get(GLOO_IFNAME_ENV) else gloo_interface(rdzv_endpoint)
    if ifname:
        os.environ[GLOO_IFNAME_ENV] = ifname
        names.append(GLOO_IFNAME_ENV)
    return names


def _launch_config(nproc: int, nnodes: int, endpoint: str, several_nodes: bool, log_dir: str, max_restarts: int):
    """The elastic agent's settings: c10d rendezvous through the store at ``endpoint`` (this process's, or
    the first node's when ``several_nodes``), under a run id every node derives alike."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig
    return LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
                        run_id=f"tnlg-{endpoint}" if several_nodes else uuid.uuid4().hex[:12],
                        rdzv_backend="c10d", rdzv_endpoint=endpoint, rdzv_configs={"is_host": False},
                        local_addr=None if several_nodes else "127.0.0.1", logs_specs=DefaultLogsSpecs(log_dir=log_dir),
                        max_restarts=max_restarts, monitor_interval=0.2, start_method="spawn")


def _how_it_ended(exitcode: int) -> str:
    """``failed with exit code 1; its output is above`` or ``was killed by SIGKILL (exit code -9) ...``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return (f"was killed by {name} (exit code {exitcode}), from outside tnlg (the out-of-memory killer, a "
                f"scheduler, a user); the other workers were stopped")
    return f"failed with exit code {exitcode}; its output is above"


def _reported_status(status_file: str) -> Optional[int]:
    """The exit status a worker left after reporting a failure itself (see tnlg.runtime.failures), else ``None``."""
    try:
        with open(status_file) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# torch's elastic agent logs each forwarded signal as a warning ("Received 2 death signal, shutting down
# workers", "Sending process N closing signal SIGINT"); the workers' own message says what happened
_ELASTIC_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                    "torch.distributed.elastic.multiprocessing.api")


class _QuietLines(logging.Filter):
    """Drops the agent's lines about forwarded signals, and its "failed (exitcode: N)" lines once a worker
    reported the failure itself (its message is the last word)."""

    def __init__(self, status_file: str):
        super().__init__()
        self.status_file = status_file

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if "death signal" in msg or "closing signal" in msg:
            return False
        return not (("failed (exitcode" in msg or "failed" in msg.lower() and "worker" in msg.lower())
                    and os.path.exists(self.status_file))


class _ContinueClosedWorkers(logging.Filter):
    """Sends SIGCONT to each worker the agent closes, when it says so ("Sending process PID closing signal
    SIGTERM", or "Closing process PID via signal ..." for workers started as functions, logged just before
    the signal): a stopped worker then acts on the SIGTERM at once instead of after the agent's 30 s grace
    and SIGKILL. Passes every line on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(("Sending process", "Closing process")) and record.args:
            pid = record.args[0] if isinstance(record.args, tuple) else None
            if isinstance(pid, int):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
        return True


def _in_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
