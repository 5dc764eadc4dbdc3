"""Megatron's ``torch_dist`` checkpoints (``--ckpt-format torch_dist``, its default): read and write.

An iteration folder holds ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``, megatron-core's
``dist_checkpointing``), ``common.pt`` (the entries that are not sharded tensors: ``args``,
``checkpoint_version``, ``iteration``, ...), and a ``torch.distributed.checkpoint`` (DCP) store:
``.metadata`` (the index: per key the global shape, dtype and chunks ``(offsets, sizes)``, per chunk
its file, byte offset and length) and ``__R_N.distcp`` files, each chunk a ``torch.save`` stream.

Keys are the model's ``sharded_state_dict`` keys, independent of TP and PP: a transformer
layer's tensors are stacked over all layers (``decoder.layers.self_attention.linear_qkv.weight`` of
global shape ``[L, 3h, h]``, layer ``N`` at offset ``N`` of dimension 0), LayerNorms under the
Transformer Engine names for both specs, ``_extra_state`` as byte objects
(``<key>/shard_<layer>_<L>``). Reading assembles any region from the chunks that overlap it, one
chunk at a time (the index is read through a restricted unpickler: :mod:`.safe_load`); writing
stores one chunk per layer and tensor, unsplit, which megatron-core re-slices for any TP x PP on load.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Optional

import torch

from ...errors import UserError
from .args import MegatronLayout
from .names import CORE_LAYER_PREFIX, LOCAL_EXTRA_STATE, Role
from .safe_load import load_chunk, load_dcp_metadata

__all__ = ["is_torch_dist", "TorchDistSource", "TorchDistWriter", "METADATA_JSON"]

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


def is_torch_dist(iter_dir: str) -> bool:
    path = os.path.join(iter_dir, "metadata.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def _key(role: Role, layer: Optional[int], prefix: str = "") -> str:
    """The DCP key of ``role``; ``prefix`` selects an optimizer state of it (``optimizer.state.exp_avg.``)."""
    return prefix + (role.dist_key if layer is None else CORE_LAYER_PREFIX + role.dist_key)


class TorchDistSource:
    """The tensors of a ``torch_dist`` checkpoint, assembled from its chunks in Megatron's layout."""

    format = "torch_dist"

    def __init__(self, iter_dir: str, layout: MegatronLayout):
        self.iter_dir, self.layout = iter_dir, layout
        index = os.path.join(iter_dir, ".metadata")
        if not os.path.isfile(index):
            raise UserError(f"{iter_dir!r} says it is a torch_dist checkpoint (metadata.json) but has no .metadata "
                            "index; it is incomplete. Nothing was written.")
        self.meta = load_dcp_metadata(index)
        self.storage = {(k.fqn, tuple(k.offset) if k.offset is not None else None): v
                        for k, v in self.meta.storage_data.items()}
        for (_, _), info in self.storage.items():  # a missing data file is named before anything is written
            path = os.path.join(iter_dir, info.relative_path)
            if not os.path.isfile(path):
                raise UserError(f"{path!r}, named by the torch_dist index of {iter_dir!r}, is missing. Nothing was "
                                "written.")
            if os.path.getsize(path) < info.offset + info.length:
                raise UserError(f"{path!r} is truncated: the torch_dist index needs {info.offset + info.length} "
                                f"bytes, it has {os.path.getsize(path)}. Nothing was written.")

    def shape(self, role: Role, layer: Optional[int], stage: Optional[int] = None,
              prefix: str = "") -> Optional[tuple[int, ...]]:
        """The full shape of ``role`` (from the index); ``None`` where the checkpoint has none."""
        md = self.meta.state_dict_metadata.get(_key(role, layer, prefix))
        if md is None or not hasattr(md, "size"):
            return None
        return tuple(md.size[1:] if layer is not None else md.size)

    def tensor(self, role: Role, layer: Optional[int], stage: Optional[int] = None,
               prefix: str = "") -> Optional[torch.Tensor]:
        """The full tensor of ``role`` (of ``layer``; with ``prefix``, an optimizer state of it);
        ``None`` where the checkpoint has none."""
        key = _key(role, layer, prefix)
        md = self.meta.state_dict_metadata.get(key)
        if md is None:
            return None
        size = list(md.size)
        lo = [0] * len(size)
        if layer is not None:
            lo[0], size[0] = layer, 1
        out = self.region(key, lo, size)
        return out[0] if layer is not None else out

    def region(self, key: str, lo: list, size: list) -> torch.Tensor:
        """The box ``[lo, lo + size)`` of the tensor ``key``, assembled from the chunks that overlap it
        (one chunk read at a time)."""
        md = self.meta.state_dict_metadata[key]
        out = torch.empty(size, dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            a = [max(o, l) for o, l in zip(chunk.offsets, lo)]
            b = [min(o + s, l + n) for o, s, l, n in zip(chunk.offsets, chunk.sizes, lo, size)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            info = self.storage[(key, tuple(chunk.offsets))]
            data = load_chunk(os.path.join(self.iter_dir, info.relative_path), info.offset, info.length,
                              f"torch_dist tensor {key!r}")
            src = data[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, chunk.offsets))]
            out[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = src
            covered += src.numel()
            del data
        if covered != out.numel():
            raise UserError(f"{self.iter_dir!r}: the chunks of {key!r} cover {covered} of its {out.numel()} elements; "
                            "the checkpoint is incomplete. Nothing was written.")
        return out

    def load_object(self, key: str):
        """The object stored under ``key`` (a ``ShardedObject`` of megatron-core: ``<name>/shard_0_1``),
        read with ``weights_only``; ``None`` where the store has none."""
        info = self.storage.get((key, None))
        if info is None:
            return None
        return load_chunk(os.path.join(self.iter_dir, info.relative_path), info.offset, info.length,
                          f"torch_dist object {key!r}")

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.state_dict_metadata["embedding.word_embeddings.weight"].properties.dtype

    def has_key(self, prefix: str) -> bool:
        """Whether any key of the store starts with ``prefix``."""
        return any(k.startswith(prefix) for k in self.meta.state_dict_metadata)


class TorchDistWriter:
    """Writes a ``torch_dist`` store one chunk at a time: :meth:`add` each tensor (or layer slice of a
    stacked key) as it is produced, then :meth:`close` writes the index, ``common.pt`` and
    ``metadata.json``. Holds only the index in memory."""

    DATA = "__0_0.distcp"

    def __init__(self, iter_dir: str, num_layers: int):
        from torch.distributed.checkpoint import metadata as M
        self.M, self.iter_dir, self.num_layers = M, iter_dir, num_layers
        os.makedirs(iter_dir, exist_ok=True)
        self.f = open(os.path.join(iter_dir, self.DATA), "wb")
        self.tensors: dict = {}
        self.storage: dict = {}

    def _store(self, fqn: str, offset, payload: bytes) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        start = self.f.tell()
        self.f.write(payload)
        index = self.M.MetadataIndex(fqn, None if offset is None else torch.Size(offset))
        self.storage[index] = _StorageInfo(relative_path=self.DATA, offset=start, length=len(payload))

    def add(self, role: Role, layer: Optional[int], tensor: torch.Tensor) -> None:
        key = _key(role, layer)
        tensor = tensor.detach().contiguous().cpu()
        shape = list(tensor.shape) if layer is None else [self.num_layers, *tensor.shape]
        offset = [0] * len(shape) if layer is None else [layer] + [0] * tensor.dim()
        sizes = list(tensor.shape) if layer is None else [1, *tensor.shape]
        md = self.tensors.get(key)
        if md is None:
            md = self.tensors[key] = self.M.TensorStorageMetadata(
                properties=self.M.TensorProperties(dtype=tensor.dtype), size=torch.Size(shape), chunks=[])
        md.chunks.append(self.M.ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes)))
        buf = io.BytesIO()
        torch.save(tensor.reshape(sizes), buf)
        self._store(key, offset, buf.getvalue())

    def add_extra_states(self, layer: int) -> None:
        """The (empty) ``_extra_state`` objects megatron-core's linear layers of ``layer`` expect."""
        buf = io.BytesIO()
        torch.save([None], buf)  # megatron-core stores the list of its sharded objects' data
        for name in LOCAL_EXTRA_STATE:
            fqn = f"{CORE_LAYER_PREFIX}{name}._extra_state/shard_{layer}_{self.num_layers}"
            self.tensors[fqn] = self.M.BytesStorageMetadata()
            self._store(fqn, None, buf.getvalue())

    def close(self, common: dict) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        meta = self.M.Metadata(state_dict_metadata=self.tensors, storage_data=self.storage)
        with open(os.path.join(self.iter_dir, ".metadata"), "wb") as f:
            pickle.dump(meta, f)
        torch.save(common, os.path.join(self.iter_dir, "common.pt"))
        with open(os.path.join(self.iter_dir, "metadata.json"), "w") as f:
            json.dump(METADATA_JSON, f)
