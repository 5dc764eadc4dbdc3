"""Where the distributed optimizer's buckets are stored (:mod:`.buckets` says what they hold).

:class:`DcpBuckets` reads the ``dp_reshardable`` tensors of a ``torch_dist`` store (through the
store's index: a span is assembled from the chunks that overlap it); :class:`LegacyBuckets` the
legacy ``distrib_optim.pt`` files (memory-mapped: a span reads its own pages). Both check, before
anything is written, that the checkpoint holds the buckets the layout gives, with their sizes.
"""

from __future__ import annotations

import os
import re

import torch

from ...errors import UserError
from .safe_load import load_pt, shown

__all__ = ["DcpBuckets", "LegacyBuckets", "STATES", "DISTRIB_OPTIM"]

STATES = ("param", "exp_avg", "exp_avg_sq")
DISTRIB_OPTIM = "distrib_optim.pt"
_BUCKET_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                         r"\.(\w+)$")
_ADVICE = ("The layout follows the saved args (--overlap-grad-reduce, --ddp-bucket-size, --ddp-num-buckets, "
           "data_parallel_size) and megatron-core 0.16.1's bucketing; a run whose args do not describe its buckets "
           "(or a model with parameters of several dtypes, or other than a GPT's) cannot be mapped. Convert without "
           "--with-optimizer (fresh Adam moments). Nothing was written.")


def _mismatch(where: str, what: str) -> UserError:
    return UserError(f"{where}: {what}. {_ADVICE}")


class DcpBuckets:
    """The ``dp_reshardable`` bucket tensors of a ``torch_dist`` store, by model-parallel rank."""

    def __init__(self, source):
        self.source = source
        self.keys: dict = {}
        self.buffers: dict = {}
        for key in source.meta.state_dict_metadata:
            m = _BUCKET_KEY.match(key)
            if m:
                rank, gbuf, dtype, bucket, state = m.groups()
                self.keys.setdefault(int(rank), {})[(int(gbuf), dtype, int(bucket), state)] = key

    def check(self, t: int, p: int, layout, where: str) -> None:
        rank = p * self.source.layout.tp + t
        keys = self.keys.get(rank, {})
        buffers = sorted({(g, d) for g, d, _, _ in keys})
        if len(buffers) != 1:
            raise _mismatch(where, f"model-parallel rank {rank} (TP {t}, PP {p}) has {len(buffers)} gradient buffers "
                                   f"({buffers}) in its optimizer.distributed.dp_group_idx_{rank}.* tensors; tnlg "
                                   "reads one")
        self.buffers[rank] = buffers[0]
        meta = self.source.meta.state_dict_metadata
        for state in STATES:
            sizes = [meta[keys[k]].size[0] for k in sorted(keys, key=lambda k: k[2]) if k[3] == state]
            if tuple(sizes) != layout.unpadded:
                raise _mismatch(where, f"model-parallel rank {rank}'s {state!r} buckets hold {sizes} elements, the "
                                       f"layout of its parameters gives {list(layout.unpadded)}")
        starts = [{int(offsets[0]) for offsets, _ in self.source.chunks[self._key(rank, b, "exp_avg")]}
                  for b in range(len(layout.unpadded))]
        for (name, layer), span in layout.spans.items():  # every parameter begins a piece (of its first DP rank)
            if span.offset not in starts[span.bucket]:
                raise _mismatch(where, f"{name}{'' if layer is None else f' of layer {layer}'} should begin at element "
                                       f"{span.offset} of bucket {span.bucket} of model-parallel rank {rank}, where no "
                                       "stored piece begins")

    def _key(self, rank: int, bucket: int, state: str) -> str:
        gbuf, dtype = self.buffers[rank]
        return self.keys[rank][(gbuf, dtype, bucket, state)]

    def flat(self, t: int, p: int, state: str, layout, span) -> torch.Tensor:
        key = self._key(p * self.source.layout.tp + t, span.bucket, state)
        return self.source.region(key, [span.offset], [span.numel])


class LegacyBuckets:
    """The ``distrib_optim.pt`` file of each model-parallel rank (``save_parameter_state``)."""

    def __init__(self, source):
        self.source, self.files = source, {}

    def _path(self, t: int, p: int) -> str:
        return os.path.join(os.path.dirname(self.source._path(t, p)), DISTRIB_OPTIM)  # beside model_optim_rng.pt

    def check(self, t: int, p: int, layout, where: str) -> None:
        path = self._path(t, p)
        if not os.path.isfile(path):
            raise UserError(f"{where}: the args say --use-distributed-optimizer but {path!r} (its optimizer state) is "
                            "missing; every model-parallel rank's file is needed. Nothing was written.")
        state = load_pt(path, "Megatron distributed optimizer file")
        buffers = [k for k in state if k != "buckets_coalesced"] if isinstance(state, dict) else []
        if not isinstance(state, dict) or state.get("buckets_coalesced") is not True or buffers != [0] or (
                not isinstance(state[0], dict) or len(state[0]) != 1):
            raise _mismatch(where, f"{path!r} is not megatron-core's coalesced-bucket state of one gradient buffer "
                                   "({'buckets_coalesced': True, 0: {dtype: {...}}}; older Megatron versions wrote "
                                   "other layouts)")
        tensors = next(iter(state[0].values()))
        if not isinstance(tensors, dict):
            raise _mismatch(where, f"{path!r}: its buffer holds {shown(tensors)}, not megatron-core's dict of the "
                                   f"states {', '.join(map(repr, STATES))} (each a flat tensor)")
        for s in STATES:
            got = tensors.get(s)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (sum(layout.unpadded),):
                raise _mismatch(where, f"{path!r}: its {s!r} has shape {tuple(getattr(got, 'shape', ()))}, the layout "
                                       f"of the rank's parameters gives {sum(layout.unpadded)} elements (buckets of "
                                       f"{list(layout.unpadded)})")
        self.files[(t, p)] = tensors

    def flat(self, t: int, p: int, state: str, layout, span) -> torch.Tensor:
        start = layout.coalesced_offset(span)
        return self.files[(t, p)][state][start:start + span.numel].clone()
