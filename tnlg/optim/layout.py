"""The flat ZeRO layout, from parameter sizes alone (no tensors): buckets, ownership, segments.

The trainable parameters of a TP shard, in backward order, are packed into one flat buffer
and cut into buckets of whole parameters (a bucket closes once it holds ``bucket_numel``
elements); every bucket is padded to a multiple of ``shards`` so that rank ``r`` owns
elements ``[r n / shards, (r + 1) n / shards)`` of every bucket of ``n`` elements. Ownership
cuts through parameters, so every rank owns the same number of elements. The engine
(:mod:`tnlg.optim.zero`) allocates buffers with this layout; the memory planner and the
partition benchmark use it on meta shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Bucket", "Segment", "FlatLayout", "plan_flat_layout", "partition_report", "MiB"]

MiB = 2 ** 20


@dataclass(frozen=True)
class Bucket:
    """Whole parameters ``params`` (positions in layout order) at ``offsets`` of the flat buffer."""

    index: int
    start: int
    numel: int
    padded_numel: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    shards: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Absolute ``[lo, hi)`` of the slice rank ``rank`` owns."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that lies in one rank's owned slice of one bucket."""

    param: int      # position in layout order
    bucket: int
    flat_lo: int    # absolute offset in the flat buffer
    length: int
    param_lo: int   # offset inside the flattened parameter
    owned_lo: int   # offset inside the rank's compact owned buffer (Adam states)


@dataclass(frozen=True)
class FlatLayout:
    """A flat-buffer partition of parameters of sizes ``numels`` over ``shards`` ranks."""

    numels: tuple[int, ...]
    shards: int
    buckets: tuple[Bucket, ...]
    total_numel: int            # with padding
    owned_numel: int            # per rank (the same on every rank)
    param_offsets: tuple[int, ...] = field(repr=False, default=())

    def segments(self, rank: int) -> list[Segment]:
        """Owned pieces of parameters for ``rank``, in flat-buffer order."""
        out, owned_base = [], 0
        for b in self.buckets:
            lo, hi = b.shard_range(rank)
            for i, off in zip(b.params, b.offsets):
                s, e = max(lo, off), min(hi, off + self.numels[i])
                if s < e:
                    out.append(Segment(i, b.index, s, e - s, s - off, owned_base + s - lo))
            owned_base += b.shard_numel
        return out

    def owned_unpadded(self, rank: int) -> int:
        """Real (non-padding) elements rank ``rank`` owns; summed over ranks this is ``sum(numels)``."""
        return sum(s.length for s in self.segments(rank))


def plan_flat_layout(numels: Sequence[int], shards: int, bucket_numel: int) -> FlatLayout:
    """Bucket whole parameters (sizes in layout order) and pad each bucket to a multiple of ``shards``.

    A bucket closes as soon as it holds at least ``bucket_numel`` elements (a
    larger parameter gets a bucket of its own). Pure arithmetic: no tensors.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}.")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}.")
    buckets, offsets = list[Bucket](), list[int]()
    start = 0
    cur_params: list[int] = []
    cur_offsets: list[int] = []
    cur = 0

    def close():
        nonlocal start, cur, cur_params, cur_offsets
        padded = -(-cur // shards) * shards
        buckets.append(Bucket(len(buckets), start, cur, padded, tuple(cur_params), tuple(cur_offsets), shards))
        start += padded
        cur, cur_params, cur_offsets = 0, [], []

    for i, n in enumerate(numels):
        if n < 1:
            raise ValueError(f"parameter {i} has {n} elements; empty parameters cannot be laid out.")
        cur_params.append(i)
        cur_offsets.append(start + cur)
        offsets.append(start + cur)
        cur += n
        if cur >= bucket_numel:
            close()
    if cur_params:
        close()
    owned = sum(b.shard_numel for b in buckets)
    return FlatLayout(tuple(numels), shards, tuple(buckets), start, owned, tuple(offsets))


def partition_report(numels: Sequence[int], dp: int, bucket_size_mb: float = 25.0,
                     bytes_per_elem: int = 4, state_bytes_per_elem: int = 8) -> dict:
    """Per-rank optimizer-state elements/bytes of our flat partition vs whole-tensor partitioning.

    ``numels`` in layout (backward) order. Returns ``ideal`` (total / dp),
    ``flat`` (every rank's owned elements), ``flat_max_over_ideal``, and the
    same for a greedy largest-first assignment of whole tensors
    (``ZeroRedundancyOptimizer``-style), plus ``total`` and ``flat_unpadded_sum``
    (which equals ``total``).
    """
    layout = plan_flat_layout(numels, dp, max(1, int(bucket_size_mb * MiB) // bytes_per_elem))
    total = sum(numels)
    ideal = total / dp
    flat = [layout.owned_numel] * dp
    loads = [0] * dp
    for n in sorted(numels, reverse=True):
        loads[loads.index(min(loads))] += n
    return dict(dp=dp, total=total, ideal=ideal, flat=flat,
                flat_unpadded_sum=sum(layout.owned_unpadded(r) for r in range(dp)),
                flat_max_over_ideal=max(flat) / ideal, whole_tensor=loads,
                whole_tensor_max_over_ideal=max(loads) / ideal,
                flat_state_bytes=[n * state_bytes_per_elem for n in flat],
                buckets=len(layout.buckets))
