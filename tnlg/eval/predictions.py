"""Greedy predictions for prompts and their scores (``tnlg eval --task generate``).

A prompt is tokenized as ``tnlg preprocess`` tokenizes a document (``tokenizer.encode``: no end-of-document
id and no BOS beyond what the tokenizer itself adds); an empty prompt starts from the end-of-document id, as
``tnlg generate`` starts one. Generation is :func:`tnlg.generation.generate_tokens`, greedy: the
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

from ..generation import SamplingOptions, check_prompts, continuation_text, generate_tokens
from .completion_rows import CompletionRow
from .scoring import mean_scores, score_example

__all__ = ["prompt_ids", "greedy_predictions", "scored_rows"]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids the model continues: the tokenizer's ids of ``prompt`` (the end-of-document id when empty)."""
    return list(tokenizer.encode(prompt)) or [tokenizer.eod_id]


def greedy_predictions(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
                       micro_batch_size: int) -> list[dict]:
    """Per prompt: ``{"tokens": new ids (the end-of-document id last where generation stopped there),
    "prediction": their text, "cut_by_seq_length": bool}``."""
    seq = model.config.seq_length
    ids = check_prompts([prompt_ids(tokenizer, p) for p in prompts], seq, model.config.vocab_size)
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
    """The predictions file's objects (prompt, reference, prediction, tokens, the row's scores) and the
    mean scores with the count of rows (``use_stemmer``: ROUGE's Porter stemming)."""
    out = []
    for row, pred in zip(rows, predictions):
        reference = row.references[0] if len(row.references) == 1 else list(row.references)
        out.append({"line": row.line, "prompt": row.prompt, "reference": reference,
                    "prediction": pred["prediction"], "tokens": pred["tokens"],
                    **score_example(row.references, pred["prediction"], use_stemmer)})
    return out, {**mean_scores(out), "count": len(out)}
