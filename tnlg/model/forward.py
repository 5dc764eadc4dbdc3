"""What one forward of the decoder's layers shares: :class:`ForwardContext`, worked out once per forward.

The decoder (:meth:`tnlg.model.decoder.DecoderBase.run`) builds it from the call's arguments and the
model's settings, and every block, its attention and its MLP read it, instead of a tuple of parallel
sizes and per-call arguments passed through each layer's signature.

**The activation layout.** Inside the decoder the activations are always sequence-first, Megatron's
layout: ``[s, b, h]`` between the TP regions from the embedding (which looks up ``tokens.t()``) through
every block to the head, whose logits are ``[s, b, V_pad / tp]``. With sequence parallelism (``sp``:
every TP rank's number of positions, :func:`tnlg.parallel.mappings.sequence_sizes`) the same layout
holds this rank's positions, ``[s_r, b, h]``, and inside the TP regions (after the all-gather) the whole
sequence, ``[s, b, ...]``: the collectives split and gather along dim 0 with no transposed copy. ``sp``
decides only the collectives (whether the linears all-gather and reduce-scatter along the sequence, and
the sizes), never the layout. The context's methods turn between the layout and the attention core's
``[b, heads, s, d]``, read ``[b, s]`` labels and loss masks in the head's layout (:meth:`like_head`), and
give the logits batch-first ``[b, s, ...]`` (a transposed view, :meth:`batch_first`) at the one place
the decoder hands them out.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch

__all__ = ["ForwardContext", "AuxLosses", "SharedMapping"]


class SharedMapping(MutableMapping):
    """A mapping that is deliberately no ``dict``, for what every block of one forward shares. FSDP2's hooks pass a
    unit's arguments through ``torch.distributed.utils._apply_to_tensors``, which rebuilds every dict and dataclass
    it meets; a ``dict`` would then be a fresh copy in each block, and what the later blocks add (or read of what
    the earlier ones added) would be lost. This object is passed through as it is (the context around it may be
    copied: the copies share it)."""

    def __init__(self) -> None:
        self._items: dict = {}

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value) -> None:
        self._items[key] = value

    def __delitem__(self, key) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"


class AuxLosses(SharedMapping):
    """The named auxiliary losses of one forward (:attr:`ForwardContext.aux`), name -> loss tensor."""


@dataclass
class ForwardContext:
    """One forward's shared values.

    ``sp``: every TP rank's positions when this forward runs sequence-parallel, else ``None``;
    ``rotary``: rope's ``(cos, sin)`` of the tokens' positions (fp32 ``[b, 1, s, rotary_dim]``), or ``None``;
    ``attention_mask``: ``[b, s, kv]`` / ``[s, kv]`` (True = may attend), the documents' ids ``[b, s]`` (int), or with context parallelism the
    whole sequence's document ids ``[b, s]``, or ``None`` (causal); ``kv_cache``: the
    :class:`~tnlg.model.attention.KVCache` of incremental decoding, or ``None``; ``last_only``: the head
    computes the last position's logits only; ``aux``: named auxiliary losses a layer adds during the forward
    (a mixture of experts' balance loss, weighted by its coefficient), which the loss adds to the language
    model's (:class:`tnlg.parallel.loss.LossTerms`); ``masks``: what the layers share of the mask, built once
    per forward (:meth:`shared`)."""

    sp: Optional[tuple[int, ...]] = None
    rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    attention_mask: Optional[torch.Tensor] = None
    kv_cache: Optional[Any] = None
    last_only: bool = False
    aux: AuxLosses = field(default_factory=AuxLosses)
    masks: SharedMapping = field(default_factory=SharedMapping, repr=False)  # key -> (attention_mask, value)

    def shared(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value ``build()`` gives for ``key`` (e.g. ``(s, kv_len, window)``), built by the first layer that
        asks and handed to every later one: a forward's attention mask is built once, not once per layer (and,
        saved for backward, held once). Kept with the ``attention_mask`` it was built from, so a context whose
        mask is replaced builds anew. Inside ``torch.compile`` built every time (a compiled block's graph
        then does not depend on what an earlier block left here)."""
        if torch.compiler.is_compiling():
            return build()
        entry = self.masks.get(key)
        if entry is not None and entry[0] is self.attention_mask:
            return entry[1]
        value = build()
        self.masks[key] = (self.attention_mask, value)
        return value

    @property
    def sequence_parallel(self) -> bool:
        """Whether the activations between the TP regions are this rank's positions only (``[s_r, b, h]``):
        the linears all-gather and reduce-scatter along the sequence."""
        return self.sp is not None

    @staticmethod
    def heads_first(t: torch.Tensor) -> torch.Tensor:
        """``[s, b, heads, d]`` -> the attention core's ``[b, heads, s, d]`` (a view)."""
        return t.permute(1, 2, 0, 3)

    @staticmethod
    def tokens_first(y: torch.Tensor) -> torch.Tensor:
        """The attention core's ``[b, heads, s, d]`` -> ``[s, b, heads * d]``, the row-parallel projection's input."""
        b, heads, s, d = y.shape
        return y.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    @staticmethod
    def batch_first(t: torch.Tensor) -> torch.Tensor:
        """The head's sequence-first output ``[s, b, ...]`` batch-first ``[b, s, ...]`` (a view); ``[b, s]``
        labels or masks the other way round, :meth:`like_head`."""
        return t.transpose(0, 1)

    @staticmethod
    def like_head(t: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` labels or a loss mask in the head's sequence-first layout ``[s, b]`` (a view)."""
        return t.t()
