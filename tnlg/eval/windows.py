"""Overlapping-window scoring of token streams, shared by WikiText and text-file perplexity.

Windows of ``seq`` input tokens start every ``stride`` tokens of a stream. The first window
scores all its targets; every later window only its last ``stride`` positions (fewer in the
final, right-padded window), so each of a stream's ``T - 1`` targets is scored exactly once,
with at least ``seq - stride`` tokens of context after the first window (Megatron's
``tasks/zeroshot_gpt``). Windows never cross from one stream into the next.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import UserError
from ..parallel.mappings import all_reduce
from ..model.inference import forward_logits, from_last_stage, model_device
from ..parallel.vocab import vocab_parallel_cross_entropy
from .batches import eval_mode, micro_batches

__all__ = ["eval_windows", "window_loss_sums"]


def eval_windows(num_tokens: int, seq_length: int, stride: int) -> list[tuple[int, int]]:
    """``(start, first_scored)`` of every window: inputs ``tokens[start:start + seq]``,
    targets ``tokens[start + 1:start + seq + 1]``; positions ``>= first_scored`` are scored
    (0 for the first window, ``seq - stride`` after). Windows scoring nothing are left out."""
    if not 1 <= stride <= seq_length:
        raise UserError(f"--overlapping-eval (stride) must be in [1, seq_length={seq_length}], got {stride}: "
                        "a larger stride would skip targets.")
    targets = num_tokens - 1
    count = 1 + max(0, math.ceil((targets - seq_length) / stride))
    return [(k * stride, 0 if k == 0 else seq_length - stride) for k in range(count)]


@torch.no_grad()
def window_loss_sums(model, streams: Sequence[Sequence[int]], seq: int, stride: int, micro_batch_size: int = 8,
                     pad_id: int = 0, progress: bool = False, desc: str = "eval") -> tuple[list[float], int]:
    """``(summed loss in nats per stream, number of windows)``: every target of every stream scored once.

    Windows (of all streams together) are spread over data-parallel ranks (``window % dp_size``);
    within a TP group (and a pipeline group) every rank runs the same windows. Collectives: per forward
    the model's TP all-reduces (and, through a pipeline, :func:`~tnlg.model.inference.forward_logits`'
    sends) and, on the last stage, the vocab-parallel cross-entropy's three ``[b, seq]`` all-reduces; at the end
    one float64 all-reduce of the ``[streams]`` sums over DP and, through a pipeline, their broadcast from the
    last stage. Every rank returns the same figures.
    """
    ps = model.ps
    if seq > model.config.max_position_embeddings:
        raise UserError(f"--seq-length {seq} is longer than the model's {model.config.max_position_embeddings} "
                        f"positions (max_position_embeddings); give --seq-length "
                        f"{model.config.max_position_embeddings} or less.")
    windows = [(i, s, first) for i, toks in enumerate(streams) for s, first in eval_windows(len(toks), seq, stride)]
    mine = windows[ps.dp_rank::ps.dp_size]
    device = model_device(model)
    data = [torch.tensor(list(toks) + [pad_id] * (seq + 1), dtype=torch.long) for toks in streams]
    totals = torch.zeros(len(streams), dtype=torch.float64, device=device)
    pos = torch.arange(seq)
    with eval_mode(model):
        for chunk in micro_batches(mine, micro_batch_size, progress, desc):
            rows = torch.stack([data[i][s:s + seq + 1] for i, s, _ in chunk]).to(device)
            scored = torch.stack([(pos >= first) & (s + 1 + pos <= len(streams[i]) - 1)
                                  for i, s, first in chunk]).to(device)
            logits = forward_logits(model, rows[:, :-1])
            if logits is None:  # a pipeline stage before the last
                continue
            losses = vocab_parallel_cross_entropy(logits, rows[:, 1:], ps, model.config.vocab_size)
            which = torch.tensor([i for i, _, _ in chunk], device=device)
            totals.index_add_(0, which, (losses.double() * scored).sum(dim=1))
    from_last_stage(all_reduce(totals, ps.dp_group), ps)
    return totals.tolist(), len(windows)
