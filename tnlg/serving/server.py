"""The server's processes: every rank runs :func:`serve_loop`; rank 0 also serves HTTP (uvicorn on a thread).

Rank 0's main thread is the engine's loop: take the scheduler's next :class:`~tnlg.serving.engine.Plan`,
broadcast it to every rank (:func:`~tnlg.serving.engine.broadcast_plan`), run it, hand the ids to the
scheduler; the other ranks receive the plan and run the same forward (lockstep). While idle rank 0 sends an
empty plan every half second, so no rank waits in a collective near its timeout.

**Stopping.** SIGTERM or SIGINT (Ctrl-C; a launcher forwards it to every rank) is caught on every rank:
rank 0 stops its scheduler (unfinished requests get an error event, new ones a 503), broadcasts a
stop plan, and shuts uvicorn down; the other ranks leave at that plan. A second signal on rank 0 raises
``KeyboardInterrupt`` (a hard stop).

:func:`bind` opens the listening socket before anything is served: a port in use or an address this
machine does not have is one paragraph (:class:`~tnlg.errors.UserError`). :func:`check_host` refuses an
address other than loopback unless it is asked for (``--allow-remote``).
"""

from __future__ import annotations

import errno
import ipaddress
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional
from ..errors import UserError
from .engine import StepEngine, broadcast_plan

__all__ = ["ServeOptions", "serve_loop", "bind", "check_host", "is_loopback"]


@dataclass(frozen=True)
class ServeOptions:
    """What ``tnlg serve`` was asked for: where to listen, the batch rows, the queue bound, the model's name."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 64
    name: str = "tnlg"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, allow_remote: bool) -> None:
    """A non-loopback ``host`` needs ``allow_remote``."""
    if is_loopback(host) or allow_remote:
        return
    which = "every network interface of this machine" if host in ("0.0.0.0", "::") else f"the address {host}"
    raise UserError(f"--host {host} would listen on {which}: anyone who can reach it could use the model "
                    "(generation, the chat page, the queue) without a password, and the traffic is not encrypted. "
                    "Pass --allow-remote if that is what you want (behind a firewall, or a reverse proxy with "
                    "authentication and TLS), or keep the default --host 127.0.0.1 and reach it through an SSH "
                    "tunnel (ssh -L 8000:127.0.0.1:8000 HOST).")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one), or one paragraph why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use: another server (or an earlier `tnlg serve` still "
                            f"running) listens there; `ss -ltnp 'sport = :{port}'` shows which process. Stop it, or "
                            "pass --port with a free port (--port 0 picks one and prints it).") from None
        if err.errno in (errno.EACCES, errno.EPERM):
            raise UserError(f"no permission to listen on {host}:{port} (ports below 1024 need root); pass "
                            "--port 1024 or higher.") from None
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}. Pass a --host this machine has "
                        "(127.0.0.1 by default) and a free --port.") from None
    sock.setblocking(False)
    return sock


class _Signals:
    """SIGINT and SIGTERM caught (main thread only) while serving: ``stop`` is called at the first, a second
    one on rank 0 raises ``KeyboardInterrupt``; the previous handlers come back on :meth:`restore`."""

    def __init__(self, stop, hard: bool):
        self.stop, self.hard = stop, hard
        self.seen: Optional[str] = None
        self.before: dict = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.before[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.seen is not None and self.hard:
            raise KeyboardInterrupt
        self.seen = signal.Signals(signum).name
        self.stop()

    def restore(self) -> None:
        for s, h in self.before.items():
            signal.signal(s, h)


def serve_loop(model, tokenizer, ps, options: ServeOptions) -> dict:
    """Serve until stopped (every rank calls this with the same model layout): rank 0 listens and schedules,
    every rank runs each step. Returns what was served (rank 0's counts) and the signal that stopped it."""
    cfg = model.config
    vocab = min(tokenizer.vocab_size, cfg.vocab_size)
    engine = StepEngine(model, options.max_batch, vocab)
    scheduler = server = thread = None
    if ps.rank == 0:
        sock = bind(options.host, options.port)
        import uvicorn

        from .app import make_app
        from .protocol import ModelLimits
        from .scheduler import Scheduler
        scheduler = Scheduler(tokenizer, options.max_batch, options.max_queue, cfg.seq_length)
        app = make_app(scheduler, ModelLimits(options.name, cfg.seq_length, vocab, options.max_batch), tokenizer)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tnlg-http", daemon=True)
        thread.start()
        while not server.started and thread.is_alive():
            time.sleep(0.02)
        if not thread.is_alive():
            raise UserError(f"the HTTP server on {options.host}:{options.port} did not start (see its log above).")
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"tnlg serve: {options.name} on http://{shown}:{port} (TP {ps.tp_size} x PP {ps.pp_size}, "
              f"{options.max_batch} rows, queue {options.max_queue}); Ctrl-C or SIGTERM stops it",
              flush=True)
    signals = _Signals(scheduler.stop if scheduler is not None else (lambda: None), hard=ps.rank == 0)
    steps = 0
    try:
        while True:
            plan = broadcast_plan(scheduler.next_plan() if scheduler is not None else None, ps)
            if plan.stop:
                break
            if plan.feeds:
                result = engine.step(plan)
                steps += 1
                if scheduler is not None:
                    scheduler.deliver(result)
    finally:
        signals.restore()
        if scheduler is not None:
            scheduler.stop()
            with scheduler.cond:
                scheduler.abort_all()
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(timeout=5)
    out: dict = {"signal": signals.seen, "steps": steps}
    if scheduler is not None:
        out.update(served=scheduler.served, generated_tokens=scheduler.generated)
    return out

