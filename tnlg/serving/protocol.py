"""OpenAI's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``: a request body
checked field by field into a :class:`GenerationRequest`, and the JSON objects sent back.

Every bad field is a :class:`RequestError` whose :meth:`~RequestError.body` is OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``) with the HTTP status the server answers with (400 for
a bad request, 404 for an unknown model, as OpenAI and vLLM answer). The limits: the prompt plus ``max_tokens``
within the model's positions (OpenAI's "maximum context length" message), ``n`` and the prompts within the
server's batch rows, ``stop`` at most 4 strings, ``logprobs`` 0-5 (completions; chat's ``logprobs`` /
``top_logprobs`` 0-5). ``top_k`` (``-1`` or ``0``: off) is vLLM's extension, as is ``return_token_ids``
(every choice and stream chunk then carries its ``token_ids``). No collectives, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..data.chat import chat_template_for, prompt_segments
from ..data.sft import tokenize_segments
from ..generation.options import SamplingOptions
from ..errors import UserError

__all__ = ["RequestError", "GenerationRequest", "parse_completion", "parse_chat", "error_body", "MAX_LOGPROBS"]

MAX_LOGPROBS = 5
MAX_STOP = 4
ROLES = ("system", "user", "assistant")


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RequestError(Exception):
    """A request the server refuses: the HTTP ``status`` and OpenAI's error object (:meth:`body`)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type_: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: its prompts (token ids), ``n`` choices per prompt, how tokens are chosen
    (``options``: ``seed`` the first choice's, choice ``i`` drawing from ``seed + i``; ``None``: the
    server draws one), the stop strings, top ``logprobs`` per token (``None``: none), ``stream``."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: tuple[tuple[int, ...], ...]
    options: SamplingOptions
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """Batch rows the request takes: one per choice of each prompt."""
        return len(self.prompts) * self.n


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served name, positions, vocabulary, batch rows."""

    name: str
    seq_length: int
    vocab_size: int
    max_batch: int


def _typed(body: dict, key: str, kinds: tuple, what: str, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:  # (a bool is an int to Python, not to JSON)
        raise RequestError(f"'{key}' must be {what}, got {value!r}.", key)
    if not isinstance(value, kinds):
        raise RequestError(f"'{key}' must be {what}, got {value!r}.", key)
    return value


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = float(_typed(body, key, (int, float), "a number", default))
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RequestError(f"'{key}' must be in {bound}, got {value!r}.", key)
    return value


def _model(body: dict, limits: ModelLimits) -> str:
    model = _typed(body, "model", (str,), "a string (the served model's name, GET /v1/models)", limits.name)
    if model != limits.name:
        raise RequestError(f"The model '{model}' does not exist; this server serves '{limits.name}' "
                           "(GET /v1/models).", "model", 404, code="model_not_found")
    return model


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, "
                           f"got {stop!r}.", "stop")
    return tuple(stop)


def _options(body: dict, limits: ModelLimits, prompts: Sequence[Sequence[int]], default_max: Optional[int],
             eod_id: int) -> SamplingOptions:
    longest = max(len(p) for p in prompts)
    room = limits.seq_length - longest
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(body, key, (int,), "an integer >= 1", None)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    if max_tokens < 1:
        raise RequestError(f"'{key}' must be an integer >= 1, got {max_tokens!r}.", key)
    if longest + max_tokens > limits.seq_length or room < 1:
        raise RequestError(f"This model's maximum context length is {limits.seq_length} tokens. However, you "
                           f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                           f"completion). Please reduce the prompt or '{key}'.", key if room >= 1 else "prompt",
                           code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _typed(body, "top_k", (int,), "an integer (-1 or 0: no top-k filter)", 0)
    if top_k < -1:
        raise RequestError(f"'top_k' must be -1, 0 (off) or a positive integer, got {top_k}.", "top_k")
    seed = _typed(body, "seed", (int,), "an integer", None)
    try:
        return SamplingOptions(max_tokens, temperature == 0, temperature or 1.0, max(top_k, 0), top_p, seed,
                               (eod_id,))
    except UserError as err:  # (every value was checked above; this keeps the server up regardless)
        raise RequestError(str(err)) from None


def _common(body: Any, limits: ModelLimits) -> tuple[str, int, bool, bool, bool]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}.")
    model = _model(body, limits)
    n = _typed(body, "n", (int,), "an integer >= 1", 1)
    if n < 1:
        raise RequestError(f"'n' must be an integer >= 1, got {n}.", "n")
    stream = _typed(body, "stream", (bool,), "true or false", False)
    options = _typed(body, "stream_options", (dict,), "an object", {})
    usage = bool(options.get("include_usage", False))
    ids = _typed(body, "return_token_ids", (bool,), "true or false", False)
    return model, n, stream, usage, ids


def _check_rows(rows: int, limits: ModelLimits) -> None:
    if rows > limits.max_batch:
        raise RequestError(f"the request asks for {rows} sequences (prompts x n) but this server generates at most "
                           f"{limits.max_batch} at once (--max-batch); ask for fewer.", "n")


def _check_ids(prompts: list[list[int]], limits: ModelLimits) -> None:
    for p in prompts:
        bad = [t for t in p if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size}).", "prompt")
    longest = max(len(p) for p in prompts)
    if longest >= limits.seq_length:
        raise RequestError(f"This model's maximum context length is {limits.seq_length} tokens, and the prompt "
                           f"alone is {longest} tokens, leaving no room for a completion. Please shorten the prompt.",
                           "prompt", code="context_length_exceeded")


def _prompts(value: Any, tokenizer) -> list[list[int]]:
    """A completion's ``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    what = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError(f"'prompt' must be {what} (non-empty), got {value!r:.80}.", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    out = []
    for p in value:
        if isinstance(p, str):
            out.append(list(tokenizer.encode(p)) or [tokenizer.eod_id])
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append([int(t) for t in p])
        else:
            raise RequestError(f"'prompt' must be {what} (non-empty), got an item {p!r:.80}.", "prompt")
    return out


def parse_completion(body: Any, limits: ModelLimits, tokenizer) -> GenerationRequest:
    """A ``/v1/completions`` body checked (OpenAI's default ``max_tokens`` is 16)."""
    model, n, stream, usage, ids = _common(body, limits)
    if "prompt" not in body:
        raise RequestError("'prompt' is required.", "prompt")
    prompts = _prompts(body["prompt"], tokenizer)
    _check_ids(prompts, limits)
    _check_rows(len(prompts) * n, limits)
    logprobs = _typed(body, "logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {logprobs}.", "logprobs")
    for unsupported in ("suffix", "best_of"):
        if body.get(unsupported) not in (None, 1) and not (unsupported == "best_of" and body[unsupported] == n):
            raise RequestError(f"'{unsupported}' is not supported by this server.", unsupported)
    if body.get("echo"):
        raise RequestError("'echo' is not supported by this server.", "echo")
    options = _options(body, limits, prompts, 16, tokenizer.eod_id)
    return GenerationRequest("completion", model, tuple(map(tuple, prompts)), options, n, _stop(body), logprobs,
                             stream, usage, ids)


def _messages(value: Any) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects.", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object whose 'role' is one of {', '.join(ROLES)}, "
                               f"got {m!r:.120}.", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported.", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string, got {content!r:.80}.",
                               f"messages[{i}].content")
        out.append((m["role"], content))
    return out


def chat_prompt(messages: Sequence[tuple[str, str]], tokenizer) -> list[int]:
    """The ids a chat model is prompted with to write the next assistant turn: the conversation rendered
    with the chat template fine-tuning uses and its generation prompt, encoded segment by segment as
    fine-tuning encodes it (:func:`tnlg.data.chat.prompt_segments`, :func:`tnlg.data.sft.tokenize_segments`)."""
    template = chat_template_for(tokenizer)
    segs = prompt_segments(list(messages) + [("assistant", "")], template, "the request")
    return [int(t) for t in tokenize_segments([segs], tokenizer).ids]


def parse_chat(body: Any, limits: ModelLimits, tokenizer) -> GenerationRequest:
    """A ``/v1/chat/completions`` body checked (the default ``max_tokens``: what the context leaves)."""
    model, n, stream, usage, ids = _common(body, limits)
    messages = _messages(body.get("messages"))
    try:
        prompt = chat_prompt(messages, tokenizer)
    except UserError as err:
        raise RequestError(str(err), "messages") from None
    _check_ids([prompt], limits)
    _check_rows(n, limits)
    want = _typed(body, "logprobs", (bool,), "true or false", False)
    top = _typed(body, "top_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]", 0)
    if not 0 <= top <= MAX_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {top}.", "top_logprobs")
    options = _options(body, limits, [prompt], None, tokenizer.eod_id)
    return GenerationRequest("chat", model, (tuple(prompt),), options, n, _stop(body), top if want else None,
                             stream, usage, ids)
