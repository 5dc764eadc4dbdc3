"""Megatron's pretraining sampler: split each global micro step across data-parallel ranks.

Samples are consumed in dataset order ``consumed, consumed + 1, ...`` (the dataset
itself is already shuffled). Each micro step takes the next
``micro_batch_size * data_parallel_size`` indices; rank ``r`` gets the ``r``-th slice
of ``micro_batch_size``. So the global order of samples - the concatenation of the
ranks' micro batches in rank order, step after step - is the same for every
data-parallel size, and a run resumed at ``consumed_samples = k`` continues with
sample ``k`` exactly as an uninterrupted run would.
"""

from __future__ import annotations

from typing import Iterator


from ..errors import UserError

__all__ = ["MegatronPretrainingSampler"]


class MegatronPretrainingSampler:
    """Yield, for this rank, the list of dataset indices of each micro batch.

    Use it as ``batch_sampler`` of a ``torch.utils.data.DataLoader`` (with
    ``collate_fn=Batch.collate``, :class:`tnlg.data.batch.Batch`) or iterate it directly. Stops when fewer than a full
    global micro step of samples remain before ``total_samples`` (or yields the
    remainder with ``drop_last=False``, possibly an empty list on some ranks).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise UserError(f"the sampler needs a positive number of samples, got total_samples={total_samples}.")
        if not 0 <= consumed_samples <= total_samples:
            raise UserError(f"consumed_samples={consumed_samples} is outside 0..{total_samples} (the dataset "
                            "size); was the checkpoint written for a larger dataset?")
        if micro_batch_size < 1:
            raise UserError(f"micro_batch_size must be positive, got {micro_batch_size}.")
        if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise UserError(f"data_parallel_rank={data_parallel_rank} must be in 0..{data_parallel_size - 1}.")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.drop_last = drop_last
        self.global_micro = self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Micro batches left for this rank."""
        left = self.total_samples - self.consumed_samples
        return left // self.global_micro + (0 if self.drop_last or left % self.global_micro == 0 else 1)

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self.global_micro <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += self.global_micro
        if start < self.total_samples and not self.drop_last:
            yield list(range(min(start + lo, self.total_samples),
                             min(start + lo + self.micro_batch_size, self.total_samples)))
