"""Mean loss over the samples of a preprocessed ``.bin/.idx`` dataset (the number pretraining logs).

Samples come from :mod:`tnlg.data.gpt_dataset` exactly as pretraining builds them
(``seq_length + 1`` tokens across document boundaries, seeded order, Megatron's
document split), so ``--split 949,50,1 --eval-split valid --seed S`` evaluates
pretraining's validation set.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..data.gpt_dataset import build_train_valid_test_datasets
from ..data.indexed import IndexedDataset
from ..errors import UserError
from ..data.batch import Batch
from ..parallel.context import context_parallel_batch
from ..parallel.loss import loss_sum
from ..parallel.mappings import all_reduce
from ..model.inference import forward_logits, from_last_stage, model_device
from .batches import eval_mode, micro_batches

__all__ = ["build_eval_dataset", "dataset_loss"]

SPLITS = ("train", "valid", "test")


def build_eval_dataset(prefix: str, seq_length: int, split: str = "0,100,0", eval_split: str = "valid",
                       seed: int = 1234, num_samples: int = 0, eod_id: Optional[int] = None,
                       vocab_size: Optional[int] = None, cache_dir: Optional[str] = None,
                       eod_mask_loss: bool = False, reset_position_ids: bool = False,
                       reset_attention_mask: bool = False):
    """One split of a Megatron-format dataset (``num_samples = 0``: one pass over it).

    Call on every rank; with a process group, rank 0 builds missing index files and
    the others wait at a barrier (the only collective).
    """
    if eval_split not in SPLITS:
        raise UserError(f"--eval-split {eval_split!r} is not one of {list(SPLITS)}.")
    if not IndexedDataset.exists(prefix):
        raise UserError(f"dataset {prefix!r} not found: --input needs the prefix of a PREFIX.bin + PREFIX.idx "
                        "pair written by `tnlg preprocess` (or Megatron's preprocess_data.py).")
    counts = [0, 0, 0]
    counts[SPLITS.index(eval_split)] = num_samples
    barrier = dist.barrier if dist.is_available() and dist.is_initialized() else None
    datasets = build_train_valid_test_datasets(
        [prefix], split, seq_length, counts, seed, cache_dir=cache_dir, eod_id=eod_id, eod_mask_loss=eod_mask_loss,
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask, vocab_size=vocab_size,
        barrier=barrier)
    ds = datasets[SPLITS.index(eval_split)]
    if ds is None:
        raise UserError(f"the {eval_split} split of {prefix!r} is empty with --split {split!r}; give it a "
                        "non-zero weight (e.g. --split 0,100,0 evaluates every document).")
    return ds


@torch.no_grad()
def dataset_loss(model, dataset, micro_batch_size: int = 8, max_samples: Optional[int] = None,
                 progress: bool = False) -> dict:
    """Token-mean loss (over ``loss_mask``) of a dataset's samples, and ``exp(min(20, loss))``.

    Samples are spread over DP ranks (``i % dp_size``). Collectives: the model's TP
    all-reduces (through a pipeline also its sends between stages) and, on the last stage,
    :func:`tnlg.parallel.loss.loss_sum`'s per batch (the cross-entropy's three ``[b, s]`` all-reduces over
    TP; with CP one ``[sum, tokens]`` all-reduce over the CP group), then one float64 all-reduce of
    ``[loss sum, token count]`` over DP (through a pipeline, then broadcast from the last stage).
    """
    ps = model.ps
    device = model_device(model)
    n = len(dataset) if not max_samples else min(len(dataset), max_samples)
    if n == 0:
        raise UserError("the dataset has no samples to evaluate.")
    mine = list(range(ps.dp_rank, n, ps.dp_size))
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    with eval_mode(model):
        for chunk in micro_batches(mine, micro_batch_size, progress, "loss"):
            batch = Batch.collate([dataset[j] for j in chunk]).to(device)
            batch = context_parallel_batch(batch, ps)  # this CP rank's chunks (the batch itself at CP 1)
            logits = forward_logits(model, batch.tokens, position_ids=batch.position_ids,
                                    attention_mask=batch.attention_mask)
            if logits is None:  # a pipeline stage before the last
                continue
            # (with CP, over every CP rank's chunks of the same samples)
            total, count = loss_sum(logits, batch.labels, batch.loss_mask, ps, model.config.vocab_size,
                                    dtype=torch.float64)
            sums += torch.stack([total, count])
    from_last_stage(all_reduce(sums, ps.dp_group), ps)
    tokens = int(sums[1])
    loss = float(sums[0]) / max(tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(20.0, loss)), "num_samples": n, "num_tokens": tokens,
            "total_loss": float(sums[0])}
