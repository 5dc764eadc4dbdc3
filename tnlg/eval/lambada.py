"""LAMBADA-style last-word accuracy (Megatron's ``tasks/zeroshot_gpt``, teacher forcing).

Each example's target is its last word; it counts as correct only when the argmax
at every target position equals the target token (Megatron's definition; docs/eval.md).

* non-strict: tokenize the whole text; the target is its last token, the context
  every token before it;
* strict (Megatron, GPT-2 BPE): context = tokens of ``text[:text.rfind(word)].strip()``,
  target = tokens of ``" " + word``, where ``word = text.split()[-1]`` (possibly several
  tokens);
* strict with a SentencePiece tokenizer: such models add a dummy prefix, so
  ``" " + word`` would encode with an extra ``▁`` piece that never occurs in running
  text. The target is instead the shortest tail of the whole text's tokenization
  whose decoding contains the last word (the tokens covering it), and the context
  is everything before that.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

import torch

from ..data.rows import RowFormat, iter_rows
from ..errors import UserError
from ..parallel.mappings import all_reduce
from ..model.inference import forward_logits, from_last_stage, model_device
from ..parallel.vocab import vocab_parallel_argmax
from .batches import eval_mode, micro_batches

__all__ = ["read_lambada_texts", "lambada_examples", "split_last_word", "lambada_accuracy"]


FORMAT = RowFormat("LAMBADA data", 'each row is an object like {"text": "..."} with a non-empty "text" string '
                   "(the LAMBADA test file format)")


def read_lambada_texts(path: str) -> list[str]:
    """The ``"text"`` of every row of a JSON Lines file (the public LAMBADA format; blank lines skipped), a
    Parquet file or a ``datasets`` folder (:mod:`tnlg.data.rows`)."""
    texts = []
    for where, obj in iter_rows(path, FORMAT):
        text = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise FORMAT.error(where, f"this row has no text: {json.dumps(obj, ensure_ascii=False, default=str)[:80]}")
        texts.append(text)
    if not texts:
        raise FORMAT.file_error(path, "is empty: it has no rows to evaluate")
    return texts


def _uses_dummy_prefix(tokenizer) -> bool:
    return getattr(tokenizer, "kind", None) == "sentencepiece"


def split_last_word(tokenizer, text: str, strict: bool) -> tuple[list[int], list[int]]:
    """``(context tokens, target tokens)`` of one example (see the module docstring)."""
    if not strict:
        tokens = list(tokenizer.encode(text))
        return tokens[:-1], tokens[-1:]
    word = text.split()[-1]
    if _uses_dummy_prefix(tokenizer):
        tokens = list(tokenizer.encode(text))
        for j in range(len(tokens) - 1, -1, -1):
            if word in tokenizer.decode(tokens[j:]):
                return tokens[:j], tokens[j:]
        return [], tokens
    start = text.rfind(word)
    return list(tokenizer.encode(text[:start].strip())), list(tokenizer.encode(" " + word))


def lambada_examples(texts: Sequence[str], tokenizer, strict: bool, seq_length: int,
                     path: str = "input") -> tuple[list[tuple[list[int], list[int]]], int]:
    """Tokenized ``(context, target)`` pairs and how many contexts were cut on the left to fit
    ``seq_length + 1`` tokens (the model sees ``seq_length`` inputs)."""
    examples, truncated = [], 0
    for number, text in enumerate(texts, 1):
        context, target = split_last_word(tokenizer, text, strict)
        if not context or not target:
            raise UserError(f"example {number} of {path!r} ({text[:60]!r}) has no context before its last "
                            "word (it tokenizes to a single piece); every LAMBADA example needs a passage "
                            "and a final word.")
        if len(target) > seq_length:
            raise UserError(f"example {number} of {path!r}: its last word is {len(target)} tokens, more than "
                            f"seq_length={seq_length}.")
        excess = len(context) + len(target) - (seq_length + 1)
        if excess > 0:
            context = context[excess:]
            truncated += 1
        examples.append((context, target))
    return examples, truncated


@torch.no_grad()
def lambada_accuracy(model, examples: Sequence[tuple[Sequence[int], Sequence[int]]], micro_batch_size: int = 8,
                     pad_id: int = 0, progress: bool = False, strict: Optional[bool] = None) -> dict:
    """Accuracy of ``(context, target)`` examples: correct when the argmax at every target
    position equals the target token.

    Examples are spread over DP ranks (``i % dp_size``) and right-padded per batch.
    Collectives: the model's TP all-reduces (through a pipeline also its sends between stages),
    on the last stage one ``[b, s]`` all-gather over TP for the vocab-parallel argmax, and one
    all-reduce of the correct count over DP (through a pipeline, then broadcast from the last stage).
    """
    ps = model.ps
    device = model_device(model)
    vocab = model.config.vocab_size
    mine = list(examples)[ps.dp_rank::ps.dp_size]
    correct = torch.zeros((), dtype=torch.float64, device=device)
    with eval_mode(model):
        for chunk in micro_batches(mine, micro_batch_size, progress, "lambada"):
            width = max(len(c) + len(t) for c, t in chunk)
            rows = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            scored = torch.zeros(len(chunk), width - 1, dtype=torch.bool)
            for r, (c, t) in enumerate(chunk):
                rows[r, :len(c) + len(t)] = torch.tensor(list(c) + list(t))
                scored[r, len(c) - 1:len(c) + len(t) - 1] = True  # positions predicting the target
            rows, scored = rows.to(device), scored.to(device)
            logits = forward_logits(model, rows[:, :-1])
            if logits is None:  # a pipeline stage before the last
                continue
            ok = (vocab_parallel_argmax(logits, ps, vocab) == rows[:, 1:]) | ~scored
            correct += ok.all(dim=1).sum()
    from_last_stage(all_reduce(correct, ps.dp_group), ps)
    n = len(examples)
    out = {"num_examples": n, "correct": int(correct), "accuracy": float(correct) / n}
    if strict is not None:
        out["strict"] = strict
    return out
