"""The loop every evaluation shares: the model in eval mode, items in micro batches, a progress bar.

Used by :mod:`.wikitext` (windows), :mod:`.lambada` (examples) and :mod:`.loss`
(dataset samples); each decides which items are this rank's and what to do with
a batch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence, TypeVar

from tqdm import tqdm

__all__ = ["eval_mode", "micro_batches"]

T = TypeVar("T")


@contextlib.contextmanager
def eval_mode(model) -> Iterator[None]:
    """``model.eval()`` for the ``with`` body, then the training mode it had before (also on error)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def micro_batches(items: Sequence[T], micro_batch_size: int, progress: bool = False,
                  desc: str = "eval") -> Iterator[Sequence[T]]:
    """``items[i:i + micro_batch_size]`` in order, with a tqdm bar (one tick a batch) when ``progress``."""
    starts = range(0, len(items), micro_batch_size)
    for i in tqdm(starts, desc=desc, unit="batch") if progress else starts:
        yield items[i:i + micro_batch_size]
