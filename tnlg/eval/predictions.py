"""Greedy predictions for prompts and their scores (``tnlg eval --task generate``).

A prompt is tokenized as ``tnlg preprocess`` tokenizes a document (``tokenizer.encode``: no end-of-document
id and no BOS beyond what the tokenizer itself adds); an empty prompt starts from the end-of-document id, as
``tnlg generate`` starts one. A conversation's prompt is the turns before its last assistant turn, rendered by
the chat template fine-tuning uses with the generation prompt (:func:`tnlg.data.chat.prompt_segments`) and
encoded segment by segment as fine-tuning encodes them (:func:`tnlg.data.sft.tokenize_segments`). Generation is :func:`tnlg.generation.generate_tokens`, greedy: the
KV cache, batches of ``micro_batch_size`` prompts (each row at its own length), any TP x PP layout, stopping after the
end-of-document id or ``max_new_tokens``. The prediction is the text the new ids add after the prompt
(:func:`tnlg.generation.continuation_text`), the end-of-document id not part of it.

A prompt with fewer than ``max_new_tokens`` positions left before ``seq_length`` is generated alone, up to
``seq_length`` (in a batch the longest prompt would cut every row); one that ends there without the
end-of-document id is counted as cut.
Collectives: those of :func:`tnlg.generation.generate_tokens` (every TP rank and pipeline stage of a group
calls this with the same prompts and gets the same result).
"""

from __future__ import annotations

from typing import Sequence

from ..data.chat import chat_template_for, prompt_segments
from ..data.sft import tokenize_segments
from ..generation import SamplingOptions, check_prompts, continuation_text, generate_tokens
from .completion_rows import CompletionRow
from .scoring import mean_scores, score_example

__all__ = ["prompt_ids", "rows_prompt_ids", "greedy_predictions", "scored_rows"]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids the model continues: the tokenizer's ids of ``prompt`` (the end-of-document id when empty)."""
    return list(tokenizer.encode(prompt)) or [tokenizer.eod_id]


def rows_prompt_ids(tokenizer, rows: Sequence[CompletionRow]) -> list[list[int]]:
    """Each row's prompt ids: :func:`prompt_ids` of a text prompt; for a conversation the ids fine-tuning gives
    the turns before its last assistant turn (the tokenizer's chat template, :func:`chat_template_for`)."""
    chats = [r for r in rows if r.messages is not None]
    template = chat_template_for(tokenizer) if chats else None
    per_chat = [prompt_segments(r.messages, template, str(r.where)) for r in chats]  # type: ignore[arg-type]
    samples = tokenize_segments(per_chat, tokenizer)
    out, k = [], 0
    for r in rows:
        if r.messages is None:
            out.append(prompt_ids(tokenizer, str(r.prompt)))
        else:
            out.append([int(i) for i in samples.sample(k)[0]])
            k += 1
    return out


def greedy_predictions(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       micro_batch_size: int) -> list[dict]:
    """Per prompt (its ids, :func:`rows_prompt_ids`): ``{"tokens": new ids (the end-of-document id last where
    generation stopped there), "prediction": their text, "cut_by_seq_length": bool}``."""
    seq = model.config.max_position_embeddings  # (the longest sequence the model reads)
    ids = check_prompts([list(p) for p in prompts], seq, model.config.vocab_size)
    vocab = tokenizer.vocab_size
    fits = [i for i, p in enumerate(ids) if len(p) + max_new_tokens <= seq]
    new: list = [None] * len(ids)
    if fits:
        out = generate_tokens(model, [ids[i] for i in fits], _greedy(max_new_tokens, tokenizer), vocab_size=vocab,
                              batch_size=micro_batch_size)
        for i, n in zip(fits, out):
            new[i] = n
    for i in (i for i in range(len(ids)) if new[i] is None):  # alone, up to seq_length
        new[i] = generate_tokens(model, [ids[i]], _greedy(seq - len(ids[i]), tokenizer), vocab_size=vocab)[0]
    return [{"tokens": n, "prediction": continuation_text(tokenizer, p, n, True),
             "cut_by_seq_length": len(p) + max_new_tokens > seq and not (n and n[-1] == tokenizer.eod_id)}
            for p, n in zip(ids, new)]


def _greedy(max_new_tokens: int, tokenizer) -> SamplingOptions:
    return SamplingOptions(max_new_tokens, greedy=True, stop_ids=(tokenizer.eod_id,))


def scored_rows(rows: Sequence[CompletionRow], predictions: Sequence[dict],
                use_stemmer: bool = False) -> tuple[list[dict], dict]:
    """The predictions file's objects (``line`` or, for a table, ``row``; ``prompt`` or the ``messages`` before
    the reference; reference, prediction, tokens, the row's scores) and the
    mean scores with the count of rows (``use_stemmer``: ROUGE's Porter stemming)."""
    out = []
    for row, pred in zip(rows, predictions):
        reference = row.references[0] if len(row.references) == 1 else list(row.references)
        where = {"line": row.where.line} if row.where.row is None else {"row": row.where.row}
        asked = ({"prompt": row.prompt} if row.messages is None else
                 {"messages": [{"role": r, "content": c} for r, c in row.messages[:-1]]})
        out.append({**where, **asked, "reference": reference,
                    "prediction": pred["prediction"], "tokens": pred["tokens"],
                    **score_example(row.references, pred["prediction"], use_stemmer)})
    return out, {**mean_scores(out), "count": len(out)}
