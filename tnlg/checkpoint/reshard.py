"""TP-independent storage: each TP rank's shards plus the partition sizes, re-sliced on load.

Every split parameter is stored as the shard its TP rank held (with the
vocabulary padding of that TP size); ``meta.json`` records, per parameter, the
split dimension, every rank's size along it and the real (unpadded) size. To
load at another TP size, a rank computes the range of the full tensor its new
shard covers and copies the overlapping parts of the old shards (read lazily
with ``safetensors.safe_open(...).get_slice``: only the overlap is read); rows
past the real size (new vocabulary padding) are zero. Replicated parameters
(LayerNorms, position embedding, row-parallel biases) are stored once, in the
TP-rank-0 file. Uneven splits (28 heads over 8 ranks) need nothing special:
the sizes come from the same :func:`tnlg.config.partition_sizes` the layers use.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional

import torch

from ..config import GPTConfig
from ..errors import UserError

__all__ = ["partition_info", "targets_for", "full_targets", "param_records", "names_for_rank",
           "check_same_params", "slice_full", "ShardReader", "write_shard_file"]


@lru_cache(maxsize=64)
def _partition_info(config_json: str, tp_size: int, tp_rank: int) -> dict:
    from ..model import GPT
    from ..parallel.layers import full_shape
    from ..parallel.state import ParallelState
    cfg = GPTConfig.from_dict(json.loads(config_json))
    with torch.device("meta"):  # shapes and split attributes only; nothing allocated
        shard = GPT(cfg, ParallelState.for_virtual_rank(tp_size, tp_rank))
    out = {}
    for name, p in shard.named_parameters():
        rec = dict(shape=list(full_shape(p)), local=list(p.shape), sharded=bool(getattr(p, "tp_sharded", False)))
        if rec["sharded"]:
            rec.update(dim=int(p.partition_dim), sizes=[int(s) for s in p.partition_sizes],
                       full_size=int(p.full_size))
        out[name] = rec
    return out


def partition_info(config: GPTConfig, tp_size: int, tp_rank: int) -> dict[str, dict]:
    """Per parameter of the TP rank's shard: ``shape`` (full, unpadded), ``local`` (this shard),
    ``sharded``, and for split ones ``dim``, ``sizes`` (every rank's, padded) and ``full_size``.
    Built from a meta-device model, so it is exactly what the layers do."""
    try:
        config.check_tensor_parallel(tp_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return _partition_info(json.dumps(config.to_dict(), sort_keys=True), tp_size, tp_rank)


def param_records(config: GPTConfig, tp_size: int) -> dict[str, dict]:
    """The ``params`` section of ``meta.json`` for a checkpoint written at TP size ``tp_size``."""
    return {name: {k: v for k, v in rec.items() if k != "local"}
            for name, rec in partition_info(config, tp_size, 0).items()}


def write_shard_file(path: str, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> int:
    """Write tensors as safetensors (temporary name, fsync, rename); returns the file size."""
    from safetensors.torch import save_file
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, tmp,
              metadata={k: str(v) for k, v in (metadata or {}).items()})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


class ShardReader:
    """Reads the tensors a TP rank needs from the per-TP-rank files of one kind (``model``/``optim``).

    ``tensor(key, name, target)`` returns the shard described by ``target`` (a
    :func:`partition_info` record) of the stored tensor ``key`` of parameter
    ``name``, assembled from the overlapping stored shards.
    """

    def __init__(self, iter_dir: str, meta: dict, file_of):
        self.iter_dir, self.meta, self.file_of = iter_dir, meta, file_of
        self.src_tp = int(meta["layout"]["tp"])
        self._open: dict[int, object] = {}

    def _file(self, tp_rank: int):
        if tp_rank not in self._open:
            from safetensors import safe_open
            path = os.path.join(self.iter_dir, self.file_of(tp_rank))
            try:
                self._open[tp_rank] = safe_open(path, framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - any parse failure means a damaged file
                raise UserError(f"checkpoint file {path!r} cannot be read ({exc}); it is damaged or "
                                f"truncated. Nothing was loaded.") from None
        return self._open[tp_rank]

    def _slice(self, tp_rank: int, key: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        f = self._file(tp_rank)
        try:
            sl = f.get_slice(key)
            idx = tuple(slice(None) for _ in range(dim)) + (slice(lo, hi),)
            return sl[idx]
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"checkpoint file {os.path.join(self.iter_dir, self.file_of(tp_rank))!r} has no "
                            f"readable tensor {key!r} ({exc}); it is damaged or from another model.") from None

    def _whole(self, tp_rank: int, key: str) -> torch.Tensor:
        f = self._file(tp_rank)
        try:
            return f.get_tensor(key)
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"checkpoint file {os.path.join(self.iter_dir, self.file_of(tp_rank))!r} has no "
                            f"readable tensor {key!r} ({exc}); it is damaged or from another model.") from None

    def tensor(self, key: str, name: str, target: dict) -> torch.Tensor:
        src = self.meta["params"][name]
        if not src["sharded"]:
            t = self._whole(0, key)
            if list(t.shape) != list(target["local"]):
                raise UserError(f"checkpoint tensor {key!r} has shape {tuple(t.shape)}, expected "
                                f"{tuple(target['local'])}.")
            return t
        dim, full = int(src["dim"]), int(src["full_size"])
        if not target["sharded"] or target["dim"] != dim or target["full_size"] != full:
            raise UserError(f"parameter {name!r} is split along dim {dim} (size {full}) in the checkpoint but "
                            f"the model splits it differently; the checkpoint is from another model.")
        out = None
        start = sum(target["sizes"][:int(target["tp_rank"])])
        stop = start + target["local"][dim]
        a = 0
        for s, size in enumerate(src["sizes"]):
            b = a + size
            lo, hi = max(start, a), min(stop, b, full)
            if lo < hi:
                piece = self._slice(s, key, dim, lo - a, hi - a)
                if out is None:
                    out = piece.new_zeros(target["local"])
                out.narrow(dim, lo - start, hi - lo).copy_(piece)
            a = b
        if out is None:  # a shard made only of padding (cannot happen with real splits, but be exact)
            out = torch.zeros(target["local"])
        return out


def targets_for(config: GPTConfig, tp_size: int, tp_rank: int) -> dict[str, dict]:
    """:func:`partition_info` records tagged with ``tp_rank`` (what :meth:`ShardReader.tensor` wants)."""
    return {n: dict(r, tp_rank=tp_rank) for n, r in partition_info(config, tp_size, tp_rank).items()}


def check_same_params(meta: dict, targets: dict[str, dict], where: str) -> None:
    """The checkpoint holds exactly the model's parameters with the same full shapes."""
    have, want = set(meta["params"]), set(targets)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise UserError(f"checkpoint {where!r} does not match the model: missing parameters {missing[:4]}"
                        f"{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
                        f"{'...' if len(extra) > 4 else ''}. It was saved from a different architecture.")
    for n in sorted(want):
        if list(meta["params"][n]["shape"]) != list(targets[n]["shape"]):
            raise UserError(f"checkpoint {where!r}: parameter {n!r} has full shape "
                            f"{tuple(meta['params'][n]['shape'])} but the model's is {tuple(targets[n]['shape'])}; "
                            f"it was saved from a different architecture.")


def names_for_rank(records: dict[str, dict], tp_rank: int) -> list[str]:
    """Parameters TP rank ``tp_rank`` stores: its split ones, and the replicated ones on rank 0."""
    return [n for n, r in records.items() if r["sharded"] or tp_rank == 0]


def full_targets(meta: dict) -> dict[str, dict]:
    """Targets that make :meth:`ShardReader.tensor` return every parameter's full, unpadded tensor."""
    out = {}
    for name, rec in meta["params"].items():
        if rec["sharded"]:
            out[name] = dict(rec, sizes=[rec["full_size"]], local=list(rec["shape"]), tp_rank=0)
        else:
            out[name] = dict(rec, local=list(rec["shape"]), tp_rank=0)
    return out


def slice_full(full: torch.Tensor, target: dict) -> torch.Tensor:
    """The shard ``target`` describes of a full (unpadded) tensor, zero-padded past the real size."""
    if not target["sharded"]:
        return full
    dim = target["dim"]
    start = sum(target["sizes"][:target["tp_rank"]])
    out = full.new_zeros(target["local"])
    hi = min(start + target["local"][dim], full.shape[dim])
    if hi > start:
        out.narrow(dim, 0, hi - start).copy_(full.narrow(dim, start, hi - start))
    return out
