"""Operations on vocabulary-parallel logits: cross-entropy, gather, top-k and argmax.

The LM head leaves every tensor-parallel rank with a contiguous shard of the
(padded) vocabulary, ``[*, V_pad / tp]``, rank ``r`` holding ids
``[r * V_pad / tp, (r + 1) * V_pad / tp)`` (equal shards: the vocabulary is padded to a
multiple of ``128 * tp``, as Megatron's). Ids ``>= vocab_size`` are padding: they take
no part in the softmax and are never chosen (:func:`mask_padding`), so no result
depends on the TP size.

Cross-entropy (Megatron paper, section 3) never gathers the vocabulary. The loss of
token ``t`` with target ``y`` is ``log(sum_j exp(z_j - m)) - (z_y - m)`` where ``m`` is
the max logit. Three all-reduces over TP, each of a ``[batch, seq]`` tensor:

1. MAX of the per-rank max (numerical stability);
2. SUM of the target logit (non-zero only on the rank that owns ``y``);
3. SUM of the per-rank ``sum exp``.

Its backward is local: ``softmax - onehot(y)`` on this rank's shard, no communication.
Computed in fp32: one fp32 ``[*, V / tp]`` tensor (the shifted logits, then in place their
exponentials and the softmax kept for backward, whose buffer the gradient reuses), with no
fp32 copy of 16-bit logits and no clone for the padding mask.

Greedy choice and top-k need no full logits either: each rank takes its local top
``k`` (value, global id) pairs and one all-gather of ``[tp, *, k]`` candidates gives
every rank the same set, from which the global top ``k`` follows exactly. Only
:func:`gather_logits` and :func:`full_vocab_candidates` all-gather the full vocabulary.
Candidates come in one canonical order - value descending, ties by smaller id - so the
result does not depend on how the vocabulary was split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .mappings import all_reduce, gather_from_tp
from .state import ParallelState

__all__ = ["mask_padding", "vocab_parallel_cross_entropy", "gather_logits", "vocab_parallel_topk",
           "vocab_parallel_argmax", "full_vocab_candidates", "canonical_order"]


def mask_padding(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """``logits`` (a shard whose first column is id ``vocab_start``) with the padded columns (ids
    ``>= vocab_size``) set to ``-inf``; a copy only when there are any. No communication."""
    pad_from = max(0, vocab_size - vocab_start)
    if pad_from >= logits.shape[-1]:
        return logits
    logits = logits.clone()
    logits[..., pad_from:] = float("-inf")
    return logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ps, vocab_start, vocab_size):
        # The max skips the padded columns (a view, no copy); ``shifted`` is the one fp32 [*, V/tp]
        # tensor made here (the subtraction promotes 16-bit logits), and the padding is masked in it in
        # place, so the 16-bit logits are never copied to fp32 nor cloned for the mask.
        pad_from = max(0, vocab_size - vocab_start)
        real = logits if pad_from >= logits.shape[-1] else logits[..., :pad_from]
        vocab_end = vocab_start + logits.shape[-1]

        if real.shape[-1]:
            logits_max = real.max(dim=-1).values.float()
        else:  # a shard of padding only: it takes no part
            logits_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        all_reduce(logits_max, ps.tp_group, op=dist.ReduceOp.MAX)                  # 1
        if logits.device.type == "cpu" and logits.dtype != torch.float32:
            # The CPU runs a mixed-dtype broadcast subtraction element by element, unvectorised: 18 ms
            # against 1.1 ms for cast-then-subtract-in-place at [1024, 4096] bf16 (one thread, AMD
            # EPYC, 2026-12-02). The same one fp32 tensor, one more pass over it.
            shifted = logits.float().sub_(logits_max.unsqueeze(-1))
        else:
            shifted = logits - logits_max.unsqueeze(-1)  # fp32: type promotion, casting on the fly on a GPU
        if pad_from < logits.shape[-1]:
            shifted[..., pad_from:] = float("-inf")

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
    if target.numel() == 0 or is_fake(target):  # a fake-tensor simulation has no ids to check
        return
    if target.device.type == "cpu" and not torch.compiler.is_compiling():
        lo_t, hi_t = torch.aminmax(target)
        lo, hi = int(lo_t), int(hi_t)  # host memory: no device synchronisation
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


def gather_logits(logits: torch.Tensor, ps: ParallelState, vocab_size: int) -> torch.Tensor:
    """Full logits ``[*, vocab_size]`` from vocab shards. Forward: all-gather over TP along the
    last dim (padding removed); backward: this rank's slice of the gradient."""
    return gather_from_tp(logits, ps)[..., :vocab_size]


def canonical_order(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort candidates along the last dim by value (descending), ties by id (ascending)."""
    by_id = torch.argsort(ids, dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = torch.argsort(values, dim=-1, descending=True, stable=True)
    return values.gather(-1, by_value), ids.gather(-1, by_value)


def vocab_parallel_topk(logits: torch.Tensor, ps: ParallelState, vocab_size: int,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-``k`` ``(values, ids)`` ``[*, k]`` of vocab-sharded logits, in canonical order.

    One all-gather over TP of ``[*, k]`` values and ids (none at TP = 1); every TP rank
    returns the same tensors. ``k`` is clamped to ``vocab_size``. Values keep the
    logits' dtype. No backward (the logits are detached).
    """
    k = max(1, min(int(k), vocab_size))
    start = ps.tp_rank * logits.shape[-1]
    masked = mask_padding(logits.detach(), start, vocab_size)
    values, ids = torch.topk(masked, min(k, masked.shape[-1]), dim=-1)
    ids = ids + start
    if ps.tp_size > 1:
        parts_v = [torch.empty_like(values) for _ in range(ps.tp_size)]
        parts_i = [torch.empty_like(ids) for _ in range(ps.tp_size)]
        dist.all_gather(parts_v, values.contiguous(), group=ps.tp_group)
        dist.all_gather(parts_i, ids.contiguous(), group=ps.tp_group)
        values, ids = torch.cat(parts_v, dim=-1), torch.cat(parts_i, dim=-1)
    values, ids = canonical_order(values, ids)
    return values[..., :k], ids[..., :k]


def vocab_parallel_argmax(logits: torch.Tensor, ps: ParallelState, vocab_size: int) -> torch.Tensor:
    """Id of the largest logit over the real vocabulary, ``[*]`` (ties: the smaller id, as
    ``torch.argmax``). One all-gather of ``[*, 1]`` values and ids over TP."""
    return vocab_parallel_topk(logits, ps, vocab_size, 1)[1][..., 0]


def full_vocab_candidates(logits: torch.Tensor, ps: ParallelState,
                          vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All ``vocab_size`` logits ``[*, V]`` (all-gather over TP, padding dropped) and their ids,
    in canonical order."""
    full = gather_logits(logits.detach(), ps, vocab_size)
    ids = torch.arange(vocab_size, device=full.device).expand_as(full)
    return canonical_order(full, ids)
