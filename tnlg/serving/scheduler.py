"""Rank 0's scheduler: the bounded queue of requests, the batch's rows, a :class:`~tnlg.serving.engine.Plan`
per step and each new token's text sent back to its request.

A request (:class:`~tnlg.serving.protocol.GenerationRequest`) becomes one :class:`Sequence` per choice
(``prompts x n``); it waits in a FIFO queue of at most ``max_queue`` requests (:class:`QueueFull` past it:
the server answers 429) until rows for all of its sequences are free, then its sequences join the batch at
the next step (continuous batching: rows are taken and given back between any two steps,
:mod:`tnlg.serving.engine`). A sequence ends at the end-of-document id or at ``max_tokens`` (as
:func:`tnlg.generation.generate_tokens` ends it) or when its text holds a stop string (cut before it);
its row is free for the next step. A cancelled request (a client gone) frees its rows the same way.

The text of a sequence is the continuation of its prompt (:func:`tnlg.generation.continuation_text`,
which decodes the whole sequence, so SentencePiece spaces and multi-byte characters come out right);
what is sent is the part no later token can change: a trailing replacement character (an incomplete
UTF-8 character) and, with stop strings, the last ``len(longest stop) - 1`` characters are held back
until the next token or the end. Events reach a request through its ``sink`` (called on the engine's
thread; the HTTP layer hands them to its event loop). No collectives, no torch.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..generation.generator import continuation_text
from ..generation.options import SamplingOptions
from .engine import Plan, StepResult
from .protocol import GenerationRequest

__all__ = ["Scheduler", "Sequence", "Ticket", "Event", "QueueFull", "Stopping"]


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already (HTTP 429)."""


class Stopping(Exception):
    """The server is shutting down (HTTP 503)."""


@dataclass
class Event:
    """What a request's handler receives: ``"token"`` (a text ``delta`` that may be empty, the new
    ``token_ids``, their ``logprobs``: ``(token text, logprob, [(text, logprob), ...])`` each),
    ``"done"`` (``finish_reason`` "stop" or "length"), or ``"error"`` (``message``). ``choice``: the
    choice's index in the response."""

    kind: str
    choice: int = 0
    delta: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    message: str = ""


@dataclass
class Sequence:
    """One choice of one prompt: its ids so far and where it is in the batch."""

    ticket: "Ticket"
    choice: int
    prompt: list[int]
    seed: int
    row: int = -1
    fed: int = 0  # prompt tokens in the cache
    length: int = 0  # tokens in the cache (prompt and new)
    new: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text sent
    done: bool = False

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


@dataclass
class Ticket:
    """A request in the server: its sequences, where its events go, whether its client left."""

    id: int
    request: GenerationRequest
    sink: Callable[[Event], None]
    sequences: list[Sequence] = field(default_factory=list)
    cancelled: bool = False
    submitted: float = field(default_factory=time.monotonic)


class Scheduler:
    """The queue and the rows of a batch of ``max_batch`` (see the module docstring). :meth:`submit` and
    :meth:`cancel` are called from the HTTP thread, :meth:`next_plan` and :meth:`deliver` from the engine's
    loop on rank 0; one lock guards the state."""

    def __init__(self, tokenizer, max_batch: int, max_queue: int, seq_length: int):
        self.tokenizer, self.max_batch, self.max_queue, self.seq_length = tokenizer, max_batch, max_queue, seq_length
        self.rows: list[Optional[Sequence]] = [None] * max_batch
        self.waiting: deque[Ticket] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self._ids = itertools.count(1)
        self.served = 0
        self.generated = 0

    # --- the HTTP side
    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Ticket:
        """Queue a request; :class:`QueueFull` when ``max_queue`` wait already, :class:`Stopping` once stopping."""
        with self.cond:
            if self.stopping:
                raise Stopping("the server is shutting down.")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting, --max-queue); "
                                "retry later.")
            ticket = Ticket(next(self._ids), request, sink)
            base = request.options.seed
            if base is None:
                base = random.SystemRandom().randrange(2**62)
            for p, prompt in enumerate(request.prompts):
                for j in range(request.n):
                    k = p * request.n + j
                    ticket.sequences.append(Sequence(ticket, k, list(prompt), base + k))
            self.waiting.append(ticket)
            self.cond.notify_all()
            return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client left: the request's rows are freed at the next step, its events dropped."""
        with self.cond:
            ticket.cancelled = True
            if ticket in self.waiting:
                self.waiting.remove(ticket)

    def stop(self) -> None:
        """Stop: the next plan ends every rank's loop; requests not finished get an error event."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def status(self) -> dict:
        with self.cond:
            return {"running": sum(s is not None for s in self.rows), "waiting": len(self.waiting),
                    "max_batch": self.max_batch, "max_queue": self.max_queue, "served": self.served,
                    "generated_tokens": self.generated}

    # --- the engine side
    def next_plan(self, idle_s: float = 0.5) -> Plan:
        """The next step's plan: ``stop`` once stopping; an empty plan (a heartbeat) after ``idle_s`` with
        nothing to do."""
        with self.cond:
            self._free_rows()
            if not self.stopping and not self._active() and not self.waiting:
                self.cond.wait(idle_s)
                self._free_rows()
            if self.stopping:
                self.abort_all()
                return Plan(stop=True)
            plan = Plan()
            self._admit(plan)
            active = self._active()
            if not active:
                return plan
            room = self.seq_length - max(s.length for s in active)
            width = max([min(len(s.prompt) - s.fed, room) for s in active if s.prefilling], default=1)
            groups: dict[tuple, tuple[SamplingOptions, list[int]]] = {}
            top: Optional[int] = None
            for r, seq in enumerate(self.rows):
                if seq is None:
                    plan.resets.append(r)
                    plan.feeds.append([0])
                    continue
                if seq.prefilling:
                    feed = seq.prompt[seq.fed:seq.fed + width]
                    seq.fed += len(feed)
                    chooses = not seq.prefilling
                else:
                    feed, chooses = [seq.new[-1]], True
                seq.length += len(feed)
                plan.feeds.append(feed)
                if chooses:
                    o = seq.ticket.request.options
                    key = (o.argmax, o.temperature, o.top_k, o.top_p)
                    groups.setdefault(key, (SamplingOptions(1, o.argmax, o.temperature, o.top_k, o.top_p), []))[1] \
                        .append(r)
                    k = seq.ticket.request.logprobs
                    if k is not None:
                        top = max(top or 0, k)
            plan.groups = list(groups.values())
            plan.logprobs = top
            return plan

    def deliver(self, result: StepResult) -> None:
        """The step's ids: each sequence's new text to its request, a finished sequence's row freed."""
        with self.cond:
            for row, token in result.ids.items():
                seq = self.rows[row]
                if seq is None or seq.done:
                    continue
                seq.new.append(token)
                self.generated += 1
                if seq.ticket.cancelled:
                    continue
                self._emit(seq, token, result.logprobs.get(row))

    # --- internals (under the lock)
    def _active(self) -> list[Sequence]:
        return [s for s in self.rows if s is not None]

    def _free_rows(self) -> None:
        for r, seq in enumerate(self.rows):
            if seq is not None and (seq.done or seq.ticket.cancelled):
                self.rows[r] = None

    def _admit(self, plan: Plan) -> None:
        free = [r for r, s in enumerate(self.rows) if s is None]
        while self.waiting and len(self.waiting[0].sequences) <= len(free):
            ticket = self.waiting.popleft()
            for seq in ticket.sequences:
                seq.row = free.pop(0)
                self.rows[seq.row] = seq
                plan.seeds[seq.row] = seq.seed
                plan.resets.append(seq.row)  # (an idle row holds a padding token)

    def _emit(self, seq: Sequence, token: int, logprob) -> None:
        request = seq.ticket.request
        options = request.options
        finish = None
        if token in options.stop_ids:
            finish = "stop"
        elif len(seq.new) >= options.max_new_tokens:
            finish = "length"
        text = continuation_text(self.tokenizer, seq.prompt, seq.new, stop_at_eod=True)
        hits = [i for i in (text.find(s) for s in request.stop) if i >= 0]
        if hits:
            text, finish = text[:min(hits)], "stop"
        if finish is None:
            hold = max((len(s) - 1 for s in request.stop), default=0)
            safe = len(text) - hold
            while safe > seq.sent and text[safe - 1] == "\ufffd":
                safe -= 1
            text = text[:max(safe, seq.sent)]
        delta, seq.sent = text[seq.sent:], max(seq.sent, len(text))
        lps = []
        if logprob is not None:
            lp, top = logprob
            lps.append((self._piece(token), lp, [(self._piece(i), v) for i, v in top]))
        seq.ticket.sink(Event("token", seq.choice, delta, [token], lps))
        if finish is not None:
            seq.done = True
            self.rows[seq.row] = None
            seq.ticket.sink(Event("done", seq.choice, finish_reason=finish))
            if all(s.done for s in seq.ticket.sequences):
                self.served += 1
            self.cond.notify_all()

    def _piece(self, token: int) -> str:
        if token == self.tokenizer.eod_id:
            return ""
        return str(self.tokenizer.decode([token]))

    def abort_all(self) -> None:
        """Every request not finished gets an error event; the rows and the queue are emptied (call under the lock)."""
        tickets = {id(s.ticket): s.ticket for s in self._active()}
        tickets.update({id(t): t for t in self.waiting})
        for ticket in tickets.values():
            if not ticket.cancelled:
                ticket.sink(Event("error", message="the server is shutting down; the request was not finished."))
        self.rows = [None] * self.max_batch
        self.waiting.clear()
