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


def _check_targets(target: torch.Tensor, vocab_size: int) -> None:
    """Refuse target ids outside ``[0, vocab_size)`` without a per-step device synchronisation.

    In host memory (CPU) the check is one ``aminmax`` pass and a clear ``ValueError``.
    On an accelerator, reading the result back would stall the device every step, so
    the check is queued on the device instead (``torch._assert_async``): a bad id stops
    the run at the next synchronisation rather than silently giving a wrong loss. The
    clear, early error there comes from where batches are built: the GPT dataset
    refuses a corpus with token ids outside the vocabulary (``vocab_size=``), and
    tokenizers and ``generate`` produce or check ids in range.
    """
    if target.numel() == 0:
        return
    if target.device.type == "cpu" and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(target)
        lo, hi = int(lo), int(hi)  # host memory: no device synchronisation
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"target id {bad} is outside the vocabulary [0, {vocab_size}); labels must be "
                             "token ids of the model's vocabulary (was the data tokenized with another "
                             "tokenizer, or an ignore index such as -100 passed? mask such positions with "
                             "the loss mask instead).")
        return
    torch._assert_async(((target >= 0) & (target < vocab_size)).all(),
                        f"a target id is outside the vocabulary [0, {vocab_size})")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ps: ParallelState,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss ``[*]`` from this rank's logit shard ``[*, V_pad / tp]`` and targets ``[*]``.

    ``vocab_size`` is the real vocabulary (columns beyond it are padding). Targets
    may live on any rank's shard. Three ``[*]``-sized all-reduces in forward,
    none in backward, and no host synchronisation (see :func:`_check_targets` for
    how out-of-range targets are refused). The returned loss is fp32.
    """
    _check_targets(target, vocab_size)
    vocab_start = ps.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, ps, vocab_start, vocab_size)
