"""The typed batch: what every dataset's samples become on their way to the loss.

A :class:`Batch` holds a micro batch's ``tokens`` and ``labels`` (``[b, s]``, aligned: ``labels`` are the
next tokens, the model does not shift), and the optional ``loss_mask`` (``[b, s]``, 1 = the target counts),
``position_ids`` (``[b, s]``, positions restarting at each document of a packed sequence) and
``attention_mask``: the documents of a packed sequence as per-position ids ``[b, s]`` (int64; equal ids, one
document; the block-causal mask is built where attention runs, :func:`tnlg.parallel.masks.document_mask`, so a
sample costs O(s), not O(s^2)), or a mask ``[b, s, s]`` bool (True = may attend) from a user's own loop.
Datasets yield one sample as a dict of these names (:data:`FIELDS`, unbatched ``[s]``); :meth:`Batch.collate`
stacks them; from there to the loss (the training step, the pipeline schedule, evaluation) the batch is this
one type. :meth:`Batch.of` also takes a dict of the same names (a user's own loop).

No collectives; the only import is torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

__all__ = ["Batch", "FIELDS"]


@dataclass(frozen=True)
class Batch:
    """One micro batch (module docstring: shapes and meanings)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, batch: Union["Batch", Mapping[str, Any]]) -> "Batch":
        """``batch`` itself, or the batch of a dict with these fields' names (an unknown name is refused)."""
        if isinstance(batch, Batch):
            return batch
        unknown = sorted(set(batch) - set(FIELDS))
        if unknown:
            raise ValueError(f"a batch holds {', '.join(FIELDS)}; got the unknown key(s) {', '.join(unknown)}.")
        return cls(**batch)

    @classmethod
    def collate(cls, items: Sequence[Mapping[str, torch.Tensor]]) -> "Batch":
        """The samples ``items`` (dicts of unbatched tensors, the fields of the first item) stacked along a new
        first dimension."""
        if not items:
            raise ValueError("collate needs at least one sample")
        return cls.of({k: torch.stack([it[k] for it in items]) for k in items[0]})

    @classmethod
    def cat(cls, batches: Sequence["Batch"]) -> "Batch":
        """Micro batches ``batches`` (the same fields set) concatenated along the batch dimension."""
        first = batches[0]
        return first.map(lambda name, _: torch.cat([getattr(b, name) for b in batches]))

    def map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> "Batch":
        """A batch of ``fn(name, tensor)`` for every field that is set (the others stay ``None``)."""
        return dataclasses.replace(self, **{name: fn(name, t) for name, t in self.items()})

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the fields that are set, in :data:`FIELDS` order."""
        return [(name, t) for name in FIELDS if (t := getattr(self, name)) is not None]

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        """Every field on ``device``."""
        return self.map(lambda _, t: t.to(device, non_blocking=non_blocking))

    def tokens_counted(self) -> torch.Tensor:
        """The targets the loss counts (fp32 scalar on the labels' device): the loss mask's sum, else every label."""
        if self.loss_mask is None:
            return torch.tensor(float(self.labels.numel()), device=self.labels.device)
        return self.loss_mask.to(torch.float32).sum()

    def mask_or_ones(self) -> torch.Tensor:
        """The loss mask, or ones (every target counts) in the labels' shape."""
        return self.loss_mask if self.loss_mask is not None else torch.ones_like(self.labels, dtype=torch.float32)


FIELDS = tuple(f.name for f in dataclasses.fields(Batch))
