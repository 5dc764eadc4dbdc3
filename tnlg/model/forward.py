"""What one forward of the decoder's layers shares: :class:`ForwardContext`, worked out once per forward.

The decoder (:meth:`tnlg.model.decoder.DecoderBase.run`) builds it from the call's arguments and the
model's settings, and every block, its attention and its MLP read it, instead of a tuple of parallel
sizes and per-call arguments passed through each layer's signature.

**The activation layout.** Without sequence parallelism the activations between the TP regions are
batch-first ``[b, s, h]``. With it (``sp``: every TP rank's number of positions,
:func:`tnlg.parallel.mappings.sequence_sizes`) they are this rank's positions, sequence-first
``[s_r, b, h]`` (Megatron's layout: the collectives need no transposed copies), and inside the TP
regions (after the all-gather) the whole sequence, sequence-first ``[s, b, ...]``. The context's
methods turn between those and the attention core's ``[b, heads, s, d]``, so no layer branches on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ForwardContext"]


@dataclass
class ForwardContext:
    """One forward's shared values.

    ``sp``: every TP rank's positions when this forward runs sequence-parallel, else ``None``;
    ``rotary``: rope's ``(cos, sin)`` of the tokens' positions (fp32 ``[b, 1, s, rotary_dim]``), or ``None``;
    ``attention_mask``: ``[b, s, kv]`` / ``[s, kv]`` (True = may attend), or with context parallelism the
    whole sequence's document ids ``[b, s]``, or ``None`` (causal); ``kv_cache``: the
    :class:`~tnlg.model.attention.KVCache` of incremental decoding, or ``None``; ``last_only``: the head
    computes the last position's logits only."""

    sp: Optional[tuple[int, ...]] = None
    rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    attention_mask: Optional[torch.Tensor] = None
    kv_cache: Optional[Any] = None
    last_only: bool = False

    @property
    def sequence_parallel(self) -> bool:
        """Whether the activations between the TP regions are this rank's positions ``[s_r, b, h]``."""
        return self.sp is not None

    def heads_first(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, s, heads, d]`` (or sequence-parallel ``[s, b, heads, d]``) -> ``[b, heads, s, d]`` (a view)."""
        return t.permute(1, 2, 0, 3) if self.sp is not None else t.permute(0, 2, 1, 3)

    def tokens_first(self, y: torch.Tensor) -> torch.Tensor:
        """The attention core's ``[b, heads, s, d]`` -> ``[b, s, heads * d]`` (sequence-parallel
        ``[s, b, heads * d]``), the row-parallel projection's input."""
        b, heads, s, d = y.shape
        if self.sp is not None:
            return y.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        return y.transpose(1, 2).reshape(b, s, heads * d)

    def batch_first(self, t: torch.Tensor) -> torch.Tensor:
        """The head's output (sequence-parallel ``[s, b, ...]``) batch-first ``[b, s, ...]`` (a view);
        ``[b, s]`` labels or masks the other way round, :meth:`like_head`."""
        return t.transpose(0, 1) if self.sp is not None else t

    def like_head(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` labels or a loss mask in the head's layout (sequence-first when sequence-parallel)."""
        return t.t() if self.sp is not None else t
