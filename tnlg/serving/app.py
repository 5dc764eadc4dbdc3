"""The HTTP side of ``tnlg serve`` (FastAPI, run by uvicorn on rank 0): OpenAI's endpoints over the
:class:`~tnlg.serving.scheduler.Scheduler`, and the chat page.

* ``POST /v1/completions``, ``POST /v1/chat/completions``: a body checked by :mod:`tnlg.serving.protocol`
  (a bad one is a 400 with OpenAI's error object, an unknown model a 404), queued (429 with the queue full,
  503 while stopping); ``stream: true`` answers server-sent events, ``data: {chunk}`` per new token and
  ``data: [DONE]`` at the end, as OpenAI sends them. A client that disconnects cancels its request (its
  rows are freed at the next step); nothing else notices.
* ``GET /v1/models``: the one served model; ``GET /health``: 200 with the queue's state; ``GET /``: the chat page
  (``static/chat.html``).

Every error the server sends, a wrong path and a malformed body included, has OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from importlib import resources
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import GenerationRequest, ModelLimits, RequestError, error_body, parse_chat, parse_completion
from .scheduler import Event, QueueFull, Scheduler, Stopping

__all__ = ["make_app"]


def _error(status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
           code: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class _Choice:
    """One choice's text, ids, log-probabilities and end, gathered from its events."""

    def __init__(self) -> None:
        self.text, self.ids, self.logprobs = "", [], []  # type: ignore[var-annotated]
        self.finish: Optional[str] = None


def _completion_logprobs(entries: list, offset: int = 0) -> dict:
    tokens = [t for t, _, _ in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{t: v for t, v in top} for _, _, top in entries], "text_offset": offsets}


def _chat_logprobs(entries: list) -> dict:
    def item(t: str, lp: float) -> dict:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries]}


class _Answers:
    """A checked request queued and answered: gathered into one response, or streamed as server-sent events."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    async def answer(self, request: Request, parsed: GenerationRequest):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:  # (called on the engine's thread)
            loop.call_soon_threadsafe(queue.put_nowait, event)
        try:
            ticket = self.scheduler.submit(parsed, sink)
        except QueueFull as err:
            return _error(429, str(err), "rate_limit_error", code="rate_limit_exceeded")
        except Stopping as err:
            return _error(503, str(err), "server_error")
        rid = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": parsed.model}
        if parsed.stream:
            return StreamingResponse(self.stream(parsed, ticket, queue, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            choices = await self.gather(request, parsed, ticket, queue)
        except asyncio.CancelledError:
            self.scheduler.cancel(ticket)
            raise
        return choices if isinstance(choices, JSONResponse) else _response(parsed, head, choices)

    async def gather(self, request: Request, parsed: GenerationRequest, ticket, queue: asyncio.Queue):
        """Every choice's events until each is done (a client gone while waiting cancels the request)."""
        choices = [_Choice() for _ in range(parsed.rows)]
        left = parsed.rows
        while left:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.scheduler.cancel(ticket)
                    return _error(499, "the client closed the request.")
                continue
            if event.kind == "error":
                return _error(503, event.message, "server_error")
            c = choices[event.choice]
            if event.kind == "token":
                c.text += event.delta
                c.ids += event.token_ids
                c.logprobs += event.logprobs
            else:
                c.finish = event.finish_reason
                left -= 1
        return choices

    async def stream(self, parsed: GenerationRequest, ticket, queue: asyncio.Queue, head: dict) -> AsyncIterator[str]:
        """``data: {chunk}`` per event (a chat starts with the assistant's role), the usage chunk when asked
        for, ``data: [DONE]``; the request is cancelled when the client leaves before the end."""
        chat = parsed.kind == "chat"
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage: Optional[dict] = None) -> str:
            obj: dict = {**head, "object": kind, "choices": choices}
            if parsed.include_usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        left, completion, finished = parsed.rows, 0, False
        offsets = [0] * parsed.rows
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(parsed.rows)])
            while left:
                event = await queue.get()
                if event.kind == "error":
                    yield f"data: {json.dumps(error_body(event.message, 'server_error'))}\n\n"
                    finished = True
                    return
                left -= event.kind == "done"
                completion += len(event.token_ids)
                yield chunk([_chunk_choice(parsed, event, offsets)])
            if parsed.include_usage:
                yield chunk([], _usage(parsed, completion))
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client left (the response's task is cancelled): free the request's rows
                self.scheduler.cancel(ticket)


def _usage(parsed: GenerationRequest, completion: int) -> dict:
    prompt = sum(len(p) for p in parsed.prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk_choice(parsed: GenerationRequest, event: Event, offsets: list[int]) -> dict:
    """A stream chunk's choice for one event (``offsets``: each choice's text so far, for completions' logprobs)."""
    chat = parsed.kind == "chat"
    item: dict = {"index": event.choice}
    if event.kind == "done":
        item.update({"delta": {}} if chat else {"text": ""})  # type: ignore[dict-item]
        item.update(logprobs=None, finish_reason=event.finish_reason)
        return item
    lp = None
    if parsed.logprobs is not None:
        lp = _chat_logprobs(event.logprobs) if chat else _completion_logprobs(event.logprobs, offsets[event.choice])
    offsets[event.choice] += len(event.delta)
    item.update({"delta": {"content": event.delta}} if chat else {"text": event.delta})
    item.update(logprobs=lp, finish_reason=None)
    if parsed.return_token_ids:
        item["token_ids"] = event.token_ids
    return item


def _response(parsed: GenerationRequest, head: dict, choices: list[_Choice]) -> dict:
    """The whole response of a request not streamed."""
    chat = parsed.kind == "chat"
    out = []
    for i, c in enumerate(choices):
        lp = None
        if parsed.logprobs is not None:
            lp = _chat_logprobs(c.logprobs) if chat else _completion_logprobs(c.logprobs)
        item: dict = ({"index": i, "message": {"role": "assistant", "content": c.text}} if chat
                      else {"index": i, "text": c.text})
        item.update(logprobs=lp, finish_reason=c.finish)
        if parsed.return_token_ids:
            item["token_ids"] = c.ids
        out.append(item)
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": out,
            "usage": _usage(parsed, sum(len(c.ids) for c in choices))}


def make_app(scheduler: Scheduler, limits: ModelLimits, tokenizer, created: Optional[int] = None) -> FastAPI:
    """The FastAPI application of a server whose engine loop runs ``scheduler``."""
    app = FastAPI(title="tnlg serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = created or int(time.time())
    answers = _Answers(scheduler)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                      "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # pragma: no cover - a bug; the server stays up
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": limits.name, **scheduler.status()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits.name, "object": "model", "created": created,
                                            "owned_by": "tnlg", "max_model_len": limits.seq_length}]}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(resources.files(__package__).joinpath("static/chat.html").read_text(encoding="utf-8"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            parsed = parse_completion(await _body(request), limits, tokenizer)
        except RequestError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return await answers.answer(request, parsed)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            parsed = parse_chat(await _body(request), limits, tokenizer)
        except RequestError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return await answers.answer(request, parsed)

    return app


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}.") from None
