"""Chat templates for ``messages`` rows: a conversation -> segments, each trained on or not
(docs/finetune.md, "Chat templates").

A conversation becomes a list of *segments* ``(text, counted)``: ``text`` a string, a token's id (a special or
added token cut out of a rendering) or ``None`` for the end-of-document id. The built-in template's texts
are each encoded on its own (:mod:`tnlg.data.sft`), so token boundaries fall on segment boundaries, as a
prompt/completion sample's prompt and completion are encoded apart, and ``counted`` is a bool. A folder's
template gives each stretch of its rendering between added tokens as one text, with ``counted`` the tuple of
its counted character ranges, encoded whole as transformers encodes it (:class:`Continued` where the folder's
tokenizer writes no leading-space prefix).

* **An HF tokenizer folder's template**: when the folder the tokenizer's files lie in has
  ``chat_template.jinja`` or a ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
  ``{"name", "template"}`` of which ``default`` is taken), the conversation is rendered by transformers'
  own renderer with every named special token of the folder, as ``apply_chat_template`` passes them
  (:mod:`tnlg.data.special_tokens`: the tokenizer class's defaults, ``tokenizer_config.json``,
  ``special_tokens_map.json``). The assistant spans: a template's ``{% generation %}`` blocks where it has
  them; otherwise turn by turn, assistant turn ``i`` spanning from the end of the rendering of turns
  ``< i`` with the generation prompt to the end of the rendering of turns ``<= i`` (whatever the template
  writes after the content before the next turn, e.g. ``<|im_end|>``, is trained on), found in one
  rendering with marked contents where the checks of :func:`_spans_in_one_rendering` hold. Every added or
  special token of the folder in the rendering (``<s>``, ``<|im_start|>``, ``eos_token``...) becomes its
  single id, as a transformers tokenizer matches them; an ``eos_token`` the vocabulary lacks becomes the
  end-of-document id.
* **The built-in template** (every tnlg tokenizer, SentencePiece or GPT-2 BPE, whose folder has no
  template): each turn is ``<|role|>\\n`` then its content, then ``\\n`` after a system or user turn and
  the end-of-document id after an assistant turn; the assistant's content and that id are trained on.
  The text before an assistant turn (``...<|user|>\\n{user}\\n<|assistant|>\\n``) is encoded as one text,
  the assistant's content as another, as a prompt and its completion.

Every sample ends with the end-of-document id (appended, trained on, when the rendering does not end
with it). **A prompt** (``tnlg eval --task generate`` on ``messages`` rows, :func:`prompt_segments`) is the
conversation before its last assistant turn, rendered with the generation prompt and cut as in training, so
the model is prompted with the very tokens it was fine-tuned on before that turn. No collectives; transformers is imported only for a folder's template.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..errors import UserError
from .special_tokens import folder_tokens

__all__ = ["ChatTemplate", "BUILTIN", "BUILTIN_JINJA", "Continued", "chat_template_for", "segments", "prompt_segments"]

# (text, a token's id, or None for the end-of-document id; counted: a bool, or a text's counted character ranges)
Segment = tuple[Union[str, int, None], Union[bool, tuple[tuple[int, int], ...]]]
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Continued(str):
    """A stretch of a rendering before which the folder's tokenizer writes no leading-space prefix
    (SentencePiece's dummy ``▁``): encoded by :meth:`~tnlg.data.tokenizer.Tokenizer.encode_with_offsets`
    with ``continued``."""


@dataclass(frozen=True)
class ChatTemplate:
    """A folder's Jinja template (``source`` its file) or the built-in one (``text`` None), with the folder's
    special tokens (:mod:`tnlg.data.special_tokens`): ``named`` the template's variables, ``added`` the texts
    cut out of a rendering as single ids; ``eod_id`` the tokenizer's end-of-document id."""

    source: str
    text: Optional[str] = None
    named: tuple[tuple[str, str], ...] = ()
    added: tuple[tuple[str, int], ...] = ()
    eod_id: int = -1
    prepend: str = ""  # the folder tokenizer's leading-space prefix: "first", "always" or "" (special_tokens)

    @property
    def bos_token(self) -> str:
        return dict(self.named).get("bos_token", "")

    @property
    def eos_token(self) -> str:
        return dict(self.named).get("eos_token", "")

    def describe(self) -> str:
        return "the built-in chat template" if self.text is None else f"the chat template of {self.source}"

    def identity(self) -> list:
        """Everything about the template that decides a conversation's tokens (for cache keys)."""
        return [self.source, self.text, [list(t) for t in self.named], [list(t) for t in self.added], self.eod_id,
                self.prepend]


BUILTIN = ChatTemplate("builtin")


def _folder(tokenizer) -> Optional[str]:
    spec = tokenizer.describe() if hasattr(tokenizer, "describe") else {}
    path = spec.get("path") or spec.get("vocab_file")
    return os.path.dirname(os.fspath(path)) if path else None


def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is not readable JSON ({str(err)[:200]}); the chat template of `messages` rows is "
                        "read from it. Fix or remove the file.") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a JSON {type(config).__name__}, not an object; fix or remove the file.")
    return config


def _pick(value, path: str) -> Optional[str]:
    """A ``chat_template`` value: a string, or the ``default`` of a list of named templates."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise UserError(f"the chat_template of {path} is neither a string nor a list of named templates with a "
                    f"'default' one; fix it, or remove it to use the built-in template.")


def chat_template_for(tokenizer) -> ChatTemplate:
    """The folder's template of ``tokenizer`` (a tnlg :class:`~tnlg.data.tokenizer.Tokenizer`), else the
    built-in one (also for a folder whose template is the built-in one's Jinja, :data:`BUILTIN_JINJA`: a folder
    tnlg exported); a :class:`UserError` for a tokenizer tnlg has no built-in template for."""
    folder = _folder(tokenizer)
    config_path = os.path.join(folder, "tokenizer_config.json") if folder else ""
    config = _read_config(config_path) if config_path and os.path.isfile(config_path) else {}
    jinja = os.path.join(folder, "chat_template.jinja") if folder else ""
    text, source = None, None
    if jinja and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            text, source = f.read(), jinja
    elif config:
        text, source = _pick(config.get("chat_template"), config_path), config_path
    if text and text == BUILTIN_JINJA and getattr(tokenizer, "kind", None) in ("sentencepiece", "gpt2bpe"):
        return BUILTIN  # (a folder tnlg exported: its own template, each text encoded as fine-tuning encoded it)
    if text:
        tokens = folder_tokens(folder, tokenizer)
        added = dict(tokens.added)
        eos = tokens.get("eos_token")
        if eos and eos not in added:  # an eos text the vocabulary lacks: the end-of-document id, as before
            added[eos] = int(tokenizer.eod_id)
        return ChatTemplate(str(source), text, tokens.named,
                            tuple(sorted(added.items(), key=lambda kv: (-len(kv[0]), kv[0]))), int(tokenizer.eod_id),
                            tokens.prepend)
    if getattr(tokenizer, "kind", None) not in ("sentencepiece", "gpt2bpe"):
        raise UserError(f"`messages` rows need a chat template, and tokenizer {tokenizer!r} has none (no "
                        f"chat_template.jinja or chat_template in tokenizer_config.json in {folder!r}) and is not a "
                        "SentencePiece or GPT-2 BPE tokenizer, for which tnlg has a built-in one. Add a template "
                        "to the tokenizer folder or write the rows as prompt/completion.")
    return BUILTIN


# The built-in template as Jinja, for exported folders (``apply_chat_template``): the same text as
# :func:`_builtin` with ``eos_token`` the end-of-document token, its assistant turns in ``{% generation %}``
# blocks (transformers' assistant mask). ``<|assistant|>\n`` follows every user turn already, so the
# generation prompt adds nothing.
BUILTIN_JINJA = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
                 "{{ message['content'] }}{{ eos_token }}{% endgeneration %}{% else %}"
                 "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
                 "{% if message['role'] == 'user' %}{{ '<|assistant|>\n' }}{% endif %}{% endif %}{% endfor %}")


def _builtin(messages: Sequence[tuple[str, str]]) -> list[Segment]:
    out: list[Segment] = []
    for role, content in messages:
        if role == "assistant":
            out += [(content, True), (None, True)]
        else:
            out.append((f"<|{role}|>\n{content}\n", False))
        if role == "user":
            out.append(("<|assistant|>\n", False))
    return out


def _render(template: ChatTemplate, messages, generation_prompt: bool = False, spans: bool = False
            ) -> tuple[str, list]:
    """The rendering and (with ``spans``) the character spans of the ``{% generation %}`` blocks."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        raise UserError(f"{template.describe()} is a Jinja template, rendered by transformers' renderer, which is "
                        "not installed: pip install transformers.") from None
    chat = [{"role": r, "content": c} for r, c in messages]
    variables: dict = dict(template.named)  # the named special tokens, as apply_chat_template passes them
    try:
        result: tuple = render_jinja_template(  # type: ignore[assignment]  # annotated str, returns a pair
            [chat], chat_template=template.text, return_assistant_tokens_mask=spans,
            add_generation_prompt=generation_prompt, **variables)
    except Exception as err:  # noqa: BLE001 - a user's template: its syntax errors and raise_exception()
        raise UserError(f"{template.describe()} failed on a conversation with roles {[r for r, _ in messages]}: "
                        f"{type(err).__name__}: {str(err)[:300]}. Fix the template or the rows.") from None
    rendered, indices = result
    return str(rendered[0]), list(indices[0] if indices else [])


def _assistant_spans(template: ChatTemplate, messages, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendering and the character spans trained on (see the module docstring): a template's
    ``{% generation %}`` blocks, else the turn-by-turn spans, found in one rendering where the template allows
    (:func:`_spans_in_one_rendering`), else by rendering every prefix of the conversation."""
    assert template.text is not None
    if _GENERATION.search(template.text):
        text, spans = _render(template, messages, spans=True)
        return text, [(int(a), int(b)) for a, b in spans]
    text, _ = _render(template, messages)
    found = _spans_in_one_rendering(template, messages, text)
    return text, found if found is not None else _spans_turn_by_turn(template, messages, text, where)


def _spans_turn_by_turn(template: ChatTemplate, messages, text: str, where: str) -> list[tuple[int, int]]:
    """Assistant turn ``i`` spans from the end of the rendering of turns ``< i`` with the generation prompt to
    the end of the rendering of turns ``<= i``: two renderings per assistant turn (time quadratic in the
    conversation's length)."""
    spans = []
    for i, (role, _) in enumerate(messages):
        if role != "assistant":
            continue
        before, _ = _render(template, messages[:i], generation_prompt=True)
        through, _ = _render(template, messages[:i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise UserError(f"{where}: {template.describe()} renders the first turns of this conversation "
                            f"differently alone than inside the whole (turn {i}), so the assistant turns cannot be "
                            "found by rendering turn by turn; give the template {% generation %} blocks around "
                            "the assistant text.")
        spans.append((len(before), len(through)))
    return spans


_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around each content in a marked rendering
_MARKS = re.compile("[\ue000\ue001]")


def _marked(messages, trimmed: bool) -> list[tuple[str, str]]:
    """Each content wrapped in the two marks: the whole content, or (``trimmed``, for a template that trims
    contents) its text between its leading and trailing whitespace."""
    if not trimmed:
        return [(role, _OPEN + content + _CLOSE) for role, content in messages]
    out = []
    for role, content in messages:
        core = content.strip()
        lead = content[:len(content) - len(content.lstrip())]
        out.append((role, lead + _OPEN + core + _CLOSE + content[len(lead) + len(core):]))
    return out


def _content_ends(template: ChatTemplate, messages, text: str, generation_prompt: bool = False,
                  variants: tuple[bool, ...] = (False, True)) -> tuple[Optional[list[int]], bool]:
    """Where each message's content ends in ``text``, the rendering of ``messages``, and whether the contents
    were marked trimmed: from a rendering with marked contents, whole or else trimmed (``None`` when the
    template carries neither through in order and otherwise unchanged)."""
    for trimmed in variants:
        marked, _ = _render(template, _marked(messages, trimmed), generation_prompt)
        if _MARKS.sub("", marked) != text:
            continue
        ends, seen = [], 0
        for k, m in enumerate(_MARKS.finditer(marked)):
            if m.group() != (_OPEN if k % 2 == 0 else _CLOSE):
                break
            if m.group() == _CLOSE:
                ends.append(m.start() - k)
            seen = k + 1
        else:
            if seen == 2 * len(messages):
                return ends, trimmed
    return None, False


def _spans_in_one_rendering(template: ChatTemplate, messages, text: str) -> Optional[list[tuple[int, int]]]:
    """The turn-by-turn spans of :func:`_spans_turn_by_turn` in time linear in the conversation's length, for a
    template that writes the same text after every assistant content (``after``: through the end of its turn)
    and the same before it after each role's content (``before``: through the generation prompt). Found in
    one rendering with marked contents (:func:`_content_ends`); ``after`` is the end of the conversation's
    rendering, ``before`` the end of the rendering of the turns before the first assistant turn that follows
    that role, with the generation prompt. Every turn is checked to hold those texts, and the first and last
    assistant turns against their two turn-by-turn renderings; ``None`` (render turn by turn) otherwise."""
    if (any(_OPEN in c or _CLOSE in c for _, c in messages) or not messages or messages[0][0] == "assistant"
            or messages[-1][0] != "assistant"):
        return None
    ends, trimmed = _content_ends(template, messages, text)
    if ends is None:
        return None
    after = text[ends[-1]:]
    before: dict[str, str] = {}
    spans = []
    for i, (role, _) in enumerate(messages):
        if role != "assistant":
            continue
        prev = messages[i - 1][0]
        if prev not in before:
            head, _ = _render(template, messages[:i], generation_prompt=True)
            head_ends, _ = _content_ends(template, messages[:i], head, True, (trimmed,))
            if head_ends is None or head_ends != ends[:i]:
                return None
            before[prev] = head[head_ends[-1]:]
        a, b = ends[i - 1] + len(before[prev]), ends[i] + len(after)
        if text[ends[i - 1]:a] != before[prev] or text[ends[i]:b] != after:
            return None
        spans.append((a, b))
    assistants = [i for i, (role, _) in enumerate(messages) if role == "assistant"]
    for i, span in ((assistants[0], spans[0]), (assistants[-1], spans[-1])):
        head, _ = _render(template, messages[:i], generation_prompt=True)
        through = text if i == len(messages) - 1 else _render(template, messages[:i + 1])[0]
        if (len(head), len(through)) != span or not (through.startswith(head) and text.startswith(through)):
            return None
    return spans


def _split_added(text: str, counted: bool, template: ChatTemplate) -> list[Segment]:
    """``text`` cut at every added token (longest first, left to right), each becoming its id."""
    if not template.added or not text:
        return [(text, counted)] if text else []
    ids = dict(template.added)
    out: list[Segment] = []
    at = 0
    for m in re.finditer("|".join(re.escape(t) for t, _ in template.added), text):
        if m.start() > at:
            out.append((text[at:m.start()], counted))
        out.append((ids[m.group()], counted))
        at = m.end()
    if at < len(text):
        out.append((text[at:], counted))
    return out


def _merge(segs: list[Segment]) -> list[Segment]:
    """Neighbouring texts of the same kind joined, so they are encoded as one text."""
    out: list[Segment] = []
    for text, counted in segs:
        if out and isinstance(text, str) and isinstance(out[-1][0], str) and out[-1][1] == counted:
            out[-1] = (str(out[-1][0]) + text, counted)
        else:
            out.append((text, counted))
    return out


def segments(messages: Sequence[tuple[str, str]], template: ChatTemplate, where: str = "") -> list[Segment]:
    """The conversation's segments, ending with the end-of-document id. The built-in template: ``(text or
    None for the end-of-document id, counted)``, each text encoded on its own. A folder's template: each
    stretch of the rendering between added tokens as one ``(text, counted character ranges)``, encoded whole
    (:class:`Continued` where it takes no leading-space prefix), and each added token ``(id, counted)``."""
    if template.text is None:
        return _merge(_builtin(messages))
    text, spans = _assistant_spans(template, list(messages), where)
    out = _cut(text, spans, template)
    if not out or out[-1][0] not in (None, template.eod_id):
        out.append((None, True))
    return _continued(_stretches(out), template.prepend)


def prompt_segments(messages: Sequence[tuple[str, str]], template: ChatTemplate, where: str = "") -> list[Segment]:
    """The segments a model fine-tuned on conversations is prompted with to write the last (assistant) turn of
    ``messages``: the turns before it rendered with the generation prompt (a template's
    ``add_generation_prompt``; the built-in template's ``<|assistant|>\\n``), cut as :func:`segments` cuts the
    whole conversation (its added tokens as their ids, its stretches encoded whole), so their tokens are
    those the model was fine-tuned on before that turn. Where a template renders that prompt otherwise than
    the start of the whole conversation, the prompt's rendering is cut on its own."""
    messages = list(messages)
    if template.text is None:
        return _merge(_builtin(messages[:-1]))
    prompt, _ = _render(template, messages[:-1], generation_prompt=True)
    text, spans = _assistant_spans(template, messages, where)
    if not text.startswith(prompt):
        return _continued(_stretches(_split_added(prompt, False, template)), template.prepend)
    cut = len(prompt)
    return _continued(_stretches(_cut(prompt, [(a, min(b, cut)) for a, b in spans if a < cut], template)),
                      template.prepend)


def _cut(text: str, spans: Sequence[tuple[int, int]], template: ChatTemplate) -> list[Segment]:
    """``text`` cut into segments: the character ``spans`` counted, the rest not, each added token its id."""
    out: list[Segment] = []
    at = 0
    for a, b in sorted(spans):
        out += _split_added(text[at:a], False, template) + _split_added(text[max(a, at):b], True, template)
        at = max(at, b)
    return out + _split_added(text[at:], False, template)


def _stretches(segs: list[Segment]) -> list[Segment]:
    """Neighbouring texts joined into one ``(text, counted character ranges)``, as a transformers tokenizer
    encodes each stretch between added tokens whole."""
    out: list[Segment] = []
    for text, counted in segs:
        if isinstance(text, str):
            if out and isinstance(out[-1][0], str):
                before, ranges = out[-1]
                assert isinstance(before, str) and isinstance(ranges, tuple)
                out[-1] = (before + text, ranges + (((len(before), len(before) + len(text)),) if counted else ()))
            else:
                out.append((text, ((0, len(text)),) if counted else ()))
        else:
            out.append((text, counted))
    return out


def _continued(segs: list[Segment], prepend: str) -> list[Segment]:
    """Each stretch that the folder's tokenizer writes without a leading-space prefix marked :class:`Continued`
    (:func:`tnlg.data.special_tokens.folder_tokens`): the prefix goes before the rendering's first stretch
    (``first``), or before every stretch (``always``, ``every``), and (``first``, ``always``: a ``Metaspace``)
    never before a stretch that starts with a space."""
    if not prepend:
        return segs
    out: list[Segment] = []
    for k, (text, counted) in enumerate(segs):
        if isinstance(text, str) and ((k > 0 and prepend == "first") or (prepend != "every" and text.startswith(" "))):
            text = Continued(text)
        out.append((text, counted))
    return out
