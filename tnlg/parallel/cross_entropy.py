"""Cross-entropy over vocabulary-parallel logits, never gathering the full vocabulary.

Each rank holds ``logits[..., vocab_start:vocab_end]``. The loss of token ``t``
with target ``y`` is ``log(sum_j exp(z_j - m)) - (z_y - m)`` where ``m`` is the
max logit. Three all-reduces over TP, each of a ``[batch, seq]`` tensor:

1. MAX of the per-rank max (numerical stability);
2. SUM of the target logit (non-zero only on the rank that owns ``y``);
3. SUM of the per-rank ``sum exp``.

Backward is local: ``softmax - onehot(y)`` on this rank's shard, no communication.
Padded vocabulary columns (index >= ``vocab_size``) are excluded from the
softmax, so the loss does not depend on the TP size. Computed in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import all_reduce
from .state import ParallelState

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ps, vocab_start, vocab_size):
        logits = logits.float()
        width = logits.shape[-1]
        vocab_end = vocab_start + width
        n_pad = max(0, vocab_end - max(vocab_size, vocab_start))
        if n_pad:  # padded columns take no part in the softmax
            logits = logits.clone()
            logits[..., width - n_pad:] = float("-inf")

        logits_max = logits.max(dim=-1).values
        all_reduce(logits_max, ps.tp_group, op=dist.ReduceOp.MAX)                  # 1
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(target_logit, ps.tp_group)                                      # 2

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, ps.tp_group)                                           # 3

        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reuse the buffer: d loss / d z = softmax - onehot(target)
        onehot_sub = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_sub.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ps: ParallelState,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss ``[*]`` from this rank's logit shard ``[*, V_pad / tp]`` and targets ``[*]``.

    ``vocab_size`` is the real vocabulary (columns beyond it are padding). Targets
    may live on any rank's shard. Three ``[*]``-sized all-reduces in forward,
    none in backward. The returned loss is fp32.
    """
    if target.min() < 0 or target.max() >= vocab_size:
        bad = target[(target < 0) | (target >= vocab_size)][0].item()
        raise ValueError(f"target id {bad} is outside the vocabulary [0, {vocab_size}).")
    vocab_start = ps.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, ps, vocab_start, vocab_size)
