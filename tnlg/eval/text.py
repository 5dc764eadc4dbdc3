"""Perplexity of any text files (``tnlg eval --task text``): per token, weighted by tokens.

Each file is one stream of tokens (its whole text, no detokenisation, no end-of-document token
added), scored with the overlapping windows of :mod:`.windows`: each of a file's ``T - 1``
targets exactly once (its first token has no context and is not scored). Over several files the
figure is token-weighted: ``val_loss = sum of every file's summed loss / sum of their targets``,
``ppl = exp(min(20, val_loss))``; each file's own figures come along. No word-level adjusted
perplexity: a word count is only defined for WikiText's tokenisation (``--task wikitext``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ..errors import UserError
from .wikitext import check_text_file
from .windows import window_loss_sums

__all__ = ["read_text_files", "text_perplexity"]


def read_text_files(paths: Sequence[str], tokenizer) -> list[list[int]]:
    """The tokens of each file; a clear error for a missing, unreadable, empty or one-token file."""
    streams = []
    for path in paths:
        tokens = list(tokenizer.encode(check_text_file(path)))
        if len(tokens) < 2:
            raise UserError(f"input file {path!r} has {len(tokens)} token(s); its perplexity needs at least 2 "
                            "(the first token is context only). Remove it from --input.")
        streams.append(tokens)
    return streams


def _figures(total: float, targets: int) -> dict:
    val = total / targets
    return {"total_loss": total, "num_targets": targets, "val_loss": val, "ppl": math.exp(min(20.0, val))}


def text_perplexity(model, streams: Sequence[Sequence[int]], paths: Sequence[str], stride: int = 32,
                    micro_batch_size: int = 8, seq_length: Optional[int] = None, pad_id: int = 0,
                    progress: bool = False) -> dict:
    """Token-weighted perplexity of ``streams`` (the tokens of the files ``paths``), with each file's
    figures under ``"files"``. Collectives: :func:`tnlg.eval.windows.window_loss_sums`."""
    seq = seq_length or model.config.seq_length
    totals, windows = window_loss_sums(model, streams, seq, stride, micro_batch_size, pad_id, progress, "text")
    files = [{"path": p, "num_tokenized_tokens": len(t), **_figures(total, len(t) - 1)}
             for p, t, total in zip(paths, streams, totals)]
    out = _figures(sum(totals), sum(len(t) - 1 for t in streams))
    out.update(num_tokenized_tokens=sum(len(t) for t in streams), num_files=len(files), files=files,
               seq_length=seq, stride=stride, windows=windows)
    return out
