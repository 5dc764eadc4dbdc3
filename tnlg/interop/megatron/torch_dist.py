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

A mixture of experts (:mod:`.names`): the router, the shared expert and its gate are layer tensors as the
others; the routed experts are ``mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2 f, h]`` and
``linear_fc2.weight`` ``[L, E, h, f]`` (EP- and TP-independent: megatron-core re-slices them for any EP x TP).
Where the model mixes dense and MoE layers (``moe_layer_freq``), megatron-core keys every layer's tensors
per layer, ``decoder.layers.<l>.<name>`` (its ``non_homogeneous_layers``): both are read, and written as
megatron-core would save the model. A save with ``singleton_local_shards`` keys each expert apart
(``decoder.layers.<l>.mlp.experts.experts.<e>.linear_fc1.weight``, SwiGLU's as ``_w`` / ``_v``): read too.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Optional

import torch

from ...checkpoint import torch_file
from ...errors import UserError
from .args import MegatronLayout
from .names import CORE_LAYER_PREFIX, EXPERT_TAKES, GLOBAL_ROLES, LAYER_ROLES, LOCAL_EXTRA_STATE, Role
from .safe_load import load_chunk, load_dcp_metadata

__all__ = ["is_torch_dist", "TorchDistSource", "TorchDistWriter", "METADATA_JSON", "FLOAT_DTYPES"]

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


def is_torch_dist(iter_dir: str) -> bool:
    path = os.path.join(iter_dir, "metadata.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _key(role: Role, layer: Optional[int], prefix: str = "") -> str:
    """The DCP key of ``role``; ``prefix`` selects an optimizer state of it (``optimizer.state.exp_avg.``)."""
    return prefix + (role.dist_key if layer is None else CORE_LAYER_PREFIX + role.dist_key)


# the element types of a GPT's weights and Adam states
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class TorchDistSource:
    """The tensors of a ``torch_dist`` checkpoint, assembled from its chunks in Megatron's layout.

    The index is data from disk, checked before anything is read by it (:mod:`.torch_dist_index`):
    each data file it names is a plain name inside the folder, each chunk lies inside its tensor and
    has its bytes in a file that is there, each tensor is covered by the union of its chunks (they may
    overlap; a hole is refused) and fits in the data files' bytes (so nothing is allocated for sizes the
    files cannot hold)."""

    format = "torch_dist"

    def __init__(self, iter_dir: str, layout: MegatronLayout):
        from .torch_dist_index import check_index
        self.iter_dir, self.layout = iter_dir, layout
        index = os.path.join(iter_dir, ".metadata")
        if not os.path.isfile(index):
            raise UserError(f"{iter_dir!r} says it is a torch_dist checkpoint (metadata.json) but has no .metadata "
                            "index; it is incomplete. Nothing was written.")
        self.meta = load_dcp_metadata(index)
        self.storage, self.paths, self.chunks = check_index(self.meta, iter_dir, index)  # chunks: distinct, by key

    def _metadata(self, key: str):
        """The index's record of tensor ``key`` (``None``: none), its element type a float one."""
        md = self.meta.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "size"):
            return None
        dtype = md.properties.dtype
        if dtype not in FLOAT_DTYPES:
            raise UserError(f"{self.iter_dir!r}: the torch_dist index gives {key!r} the element type {dtype}; the "
                            "weights and Adam states of a Megatron GPT are floating point (float32, float16, "
                            "bfloat16), so the checkpoint is damaged or not a GPT's. Nothing was written.")
        return md

    def _parts(self, role: Role, layer: Optional[int], prefix: str = "") -> Optional[list[tuple[str, bool]]]:
        """Where ``role``'s tensor (of ``layer``) is in the index, as ``(key, stacked)`` pairs joined on the row
        axis; ``None`` where it is not. megatron-core saves a layer's tensor in one of two ways:

        * stacked (the default): one key ``decoder.layers.<name>`` of shape ``[L, ...]``, layer ``l`` its slice;
        * per layer (``non_homogeneous_layers``, which the ``singleton_local_shards`` metadata implies):
          ``decoder.layers.<l>.<name>``;

        and SwiGLU's fc1 either as one key or, under ``singleton_local_shards``
        (``apply_swiglu_sharded_factory``), as ``<key>_w`` (every rank's gate rows) and ``<key>_v`` (their up
        rows), which joined on the row axis are the one-key save's ``[gate; up]``."""
        keys = [(_key(role, layer, prefix), layer is not None)]
        if layer is not None:
            keys.append((f"{prefix}{CORE_LAYER_PREFIX}{layer}.{role.dist_key}", False))
        for key, stacked in keys:
            if self._metadata(key) is not None:
                return [(key, stacked)]
            if role.take == "swiglu":
                mw, mv = self._metadata(key + "_w"), self._metadata(key + "_v")
                if mw is not None and mv is not None:
                    if list(mw.size) != list(mv.size) or mw.properties.dtype != mv.properties.dtype:
                        raise UserError(
                            f"{self.iter_dir!r}: SwiGLU's {key + '_w'!r} and {key + '_v'!r} (the gate and up halves "
                            f"of one fc1) have shapes {list(mw.size)} and {list(mv.size)} ({mw.properties.dtype}, "
                            f"{mv.properties.dtype}); they must be equal. The checkpoint is damaged. Nothing was "
                            "written.")
                    return [(key + "_w", stacked), (key + "_v", stacked)]
        return None

    def _per_expert(self, role: Role, layer: Optional[int], prefix: str = "") -> Optional[list[Role]]:
        """An expert role saved one key per expert (``singleton_local_shards``:
        ``decoder.layers.<l>.mlp.experts.experts.<e>.linear_fc1.weight``, SwiGLU's as ``<key>_w`` and ``<key>_v``):
        a role per expert ``0, 1, ...`` that the index holds; ``None`` where it holds none."""
        if role.take not in EXPERT_TAKES or layer is None:
            return None
        out: list[Role] = []
        while True:
            key = role.dist_key.replace("mlp.experts.experts.", f"mlp.experts.experts.{len(out)}.")
            one = Role(role.tnlg, role.split, (key,), (), "swiglu" if role.take == "experts_fc1" else None)
            if self._parts(one, layer, prefix) is None:
                return out or None
            out.append(one)

    def shape(self, role: Role, layer: Optional[int], stage: Optional[int] = None,
              prefix: str = "") -> Optional[tuple[int, ...]]:
        """The full shape of ``role`` (from the index); ``None`` where the checkpoint has none."""
        parts = self._parts(role, layer, prefix)
        experts = self._per_expert(role, layer, prefix) if parts is None else None
        if experts is not None:
            shapes = [self.shape(one, layer, prefix=prefix) for one in experts]  # each found: not None
            if any(s != shapes[0] for s in shapes) or shapes[0] is None:
                raise UserError(f"{self.iter_dir!r}: the experts' {role.dist_key!r} of layer {layer} have the shapes "
                                f"{shapes[:4]}; every expert's must be the same. The checkpoint is damaged. "
                                "Nothing was written.")
            return (len(experts), *shapes[0])
        if parts is None:
            return None
        sizes = [list(self.meta.state_dict_metadata[k].size[1 if stacked else 0:]) for k, stacked in parts]
        return (sum(s[0] for s in sizes), *sizes[0][1:])

    def layers(self) -> Optional[int]:
        """How many layers the store holds (from the index: the stacked layer tensors' first axis, or the
        per-layer keys' count; ``None``: none)."""
        md = self._metadata(_key(LAYER_ROLES[0], 0))
        if md is not None:
            return int(md.size[0]) if len(md.size) else None
        n = 0
        while self._metadata(f"{CORE_LAYER_PREFIX}{n}.{LAYER_ROLES[0].dist_key}") is not None:
            n += 1
        return n or None

    def tensor(self, role: Role, layer: Optional[int], stage: Optional[int] = None,
               prefix: str = "") -> Optional[torch.Tensor]:
        """The full tensor of ``role`` (of ``layer``; with ``prefix``, an optimizer state of it);
        ``None`` where the checkpoint has none."""
        parts = self._parts(role, layer, prefix)
        experts = self._per_expert(role, layer, prefix) if parts is None else None
        if experts is not None:
            found = [self.tensor(one, layer, prefix=prefix) for one in experts]
            return torch.stack([t for t in found if t is not None])  # (each found by _per_expert)
        if parts is None:
            return None
        out = []
        for key, stacked in parts:
            size = list(self.meta.state_dict_metadata[key].size)
            lo = [0] * len(size)
            if stacked:
                assert layer is not None  # only a layer's tensor is stacked
                lo[0], size[0] = layer, 1
            t = self.region(key, lo, size)
            out.append(t[0] if stacked else t)
        return out[0] if len(out) == 1 else torch.cat(out)

    def region(self, key: str, lo: list, size: list) -> torch.Tensor:
        """The box ``[lo, lo + size)`` of the tensor ``key``, assembled from the chunks that overlap it
        (one chunk read at a time; the index's check made sure they cover it)."""
        md = self._metadata(key)
        if md is None:
            raise UserError(f"{self.iter_dir!r}: the torch_dist index has no tensor {key!r}. Nothing was written.")
        if len(lo) != len(md.size) or any(a < 0 or a + n > m for a, n, m in zip(lo, size, md.size)):
            raise UserError(f"{self.iter_dir!r}: the part [{lo}, +{size}) of {key!r} lies outside its size "
                            f"{list(md.size)} in the torch_dist index; the checkpoint does not match its args. Nothing "
                            "was written.")
        out = torch.empty(size, dtype=md.properties.dtype)
        for offsets, sizes in self.chunks[key]:
            a = [max(o, l) for o, l in zip(offsets, lo)]
            b = [min(o + s, l + n) for o, s, l, n in zip(offsets, sizes, lo, size)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            info = self.storage[(key, offsets)]
            what = f"torch_dist tensor {key!r}"
            data = load_chunk(self.paths[info.relative_path], info.offset, info.length, what)
            if not isinstance(data, torch.Tensor) or data.dtype != md.properties.dtype or (
                    tuple(data.shape) != sizes):
                got = (f"a {data.dtype} tensor of shape {tuple(data.shape)}" if isinstance(data, torch.Tensor)
                       else f"a {type(data).__name__}")
                raise UserError(f"{what}: the chunk at {offsets} in {info.relative_path!r} holds {got}, "
                                f"the index gives a {md.properties.dtype} tensor of shape {sizes}; the "
                                "checkpoint is damaged. Nothing was written.")
            src = data[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, offsets))]
            out[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = src
            del data
        return out

    def load_object(self, key: str):
        """The object stored under ``key`` (a ``ShardedObject`` of megatron-core: ``<name>/shard_0_1``),
        read with ``weights_only``; ``None`` where the store has none."""
        info = self.storage.get((key, None))
        if info is None:
            return None
        return load_chunk(self.paths[info.relative_path], info.offset, info.length, f"torch_dist object {key!r}")

    @property
    def dtype(self) -> torch.dtype:
        md = self._metadata(_key(GLOBAL_ROLES[0], None))
        if md is None:
            raise UserError(f"{self.iter_dir!r}: the torch_dist index has no word embedding. Nothing was written.")
        return md.properties.dtype

    def has_key(self, prefix: str) -> bool:
        """Whether any key of the store starts with ``prefix``."""
        return any(k.startswith(prefix) for k in self.meta.state_dict_metadata)


class TorchDistWriter:
    """Writes a ``torch_dist`` store one chunk at a time: :meth:`add` each tensor (or layer slice of a
    stacked key) as it is produced, then :meth:`close` writes the index, ``common.pt`` and
    ``metadata.json``. Holds only the index in memory."""

    DATA = "__0_0.distcp"

    def __init__(self, iter_dir: str, num_layers: int, per_layer: bool = False):
        from torch.distributed.checkpoint import metadata as M
        self.M, self.iter_dir, self.num_layers, self.per_layer = M, iter_dir, num_layers, per_layer
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
        """``tensor``: ``role``'s full tensor (of ``layer``), a slice of the stacked key or, with ``per_layer``
        (megatron-core's ``non_homogeneous_layers``), the layer's own key ``decoder.layers.<l>.<name>``."""
        if layer is not None and self.per_layer:
            key, layer = f"{CORE_LAYER_PREFIX}{layer}.{role.dist_key}", None
        else:
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

    def add_extra_states(self, layer: int, names: tuple[str, ...] = LOCAL_EXTRA_STATE, experts: int = 0,
                         expert_names: tuple[str, ...] = ()) -> None:
        """The (empty) ``_extra_state`` objects megatron-core's linear layers ``names`` of ``layer`` expect, and
        of each of the ``experts`` experts' ``expert_names`` (``mlp.experts.experts.linear_fc1``): stacked,
        ``<name>._extra_state/shard_<layer>_<L>`` (an expert's ``shard_<layer>.<e>_<L>.<E>``); per layer,
        ``decoder.layers.<layer>.<name>._extra_state/shard_0_1`` (``shard_<e>_<E>``)."""
        buf = io.BytesIO()
        torch.save([None], buf)  # megatron-core stores the list of its sharded objects' data
        fqns = []
        for name in names:
            fqns.append(f"{CORE_LAYER_PREFIX}{layer}.{name}._extra_state/shard_0_1" if self.per_layer else
                        f"{CORE_LAYER_PREFIX}{name}._extra_state/shard_{layer}_{self.num_layers}")
        for name in expert_names:
            for e in range(experts):
                fqns.append(f"{CORE_LAYER_PREFIX}{layer}.{name}._extra_state/shard_{e}_{experts}" if self.per_layer
                            else f"{CORE_LAYER_PREFIX}{name}._extra_state/shard_{layer}.{e}_{self.num_layers}.{experts}")
        for fqn in fqns:
            self.tensors[fqn] = self.M.BytesStorageMetadata()
            self._store(fqn, None, buf.getvalue())

    def close(self, common: dict) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        meta = self.M.Metadata(state_dict_metadata=self.tensors, storage_data=self.storage)
        with open(os.path.join(self.iter_dir, ".metadata"), "wb") as f:
            pickle.dump(meta, f)
        torch_file.save(common, os.path.join(self.iter_dir, "common.pt"))  # a full disk: its OSError
        with open(os.path.join(self.iter_dir, "metadata.json"), "w") as f:
            json.dump(METADATA_JSON, f)
