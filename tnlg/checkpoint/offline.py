"""Checkpoints written in one process, outside a run: resharding (``tnlg convert --from CKPT --to CKPT2
--tensor-model-parallel-size N``) and what the converters from other formats share (opening a source
checkpoint, writing a converted one for virtual TP ranks). No collectives: everything is read and
written here, one slice at a time."""

from __future__ import annotations

import os
from typing import Callable, Mapping

import torch

from ..config import GPTConfig
from ..errors import UserError
from ..parallel.sharding import ShardSpec
from . import files as F
from .loading import read_states
from .manifest import Manifest, need
from .saving import write_offline

__all__ = ["open_source", "reshard_checkpoint", "write_converted"]

Describe = Callable[[GPTConfig, int], Mapping[str, ShardSpec]]  # (config, TP size) -> the parameters' TP layout


def write_converted(dst: str, manifest: Manifest, cfg: GPTConfig, tp_size: int, shard_of_rank,
                    rng_of_rank=None, *, layout: Mapping[str, ShardSpec]) -> str:
    """Write a checkpoint for ``tp_size`` virtual TP ranks (DP 1): see
    :func:`tnlg.checkpoint.saving.write_offline` (``layout``: ``cfg``'s at ``tp_size``)."""
    return write_offline(dst, manifest.replace(config=cfg.to_dict()), tp_size, shard_of_rank, rng_of_rank,
                         layout=layout)


def open_source(path: str) -> tuple[str, Manifest, GPTConfig]:
    """``(iteration directory, manifest, model config)`` of the tnlg checkpoint ``path`` (``--from``), its
    files checked at their sizes."""
    iter_dir = F.resolve(path, "--from")
    if iter_dir is None:
        raise UserError(f"--from {path!r} holds no tnlg checkpoint (no {F.LATEST} and no iter_* directory).")
    manifest = Manifest.read(iter_dir)
    manifest.check_holds_weights(f"--from {iter_dir!r}")
    F.check_files(iter_dir, manifest)
    return iter_dir, manifest, GPTConfig.from_dict(need(manifest.config, "config"))


def reshard_checkpoint(path: str, dst: str, tp_size=None, *, describe: Describe) -> str:
    """Rewrite a checkpoint's shards for TP ``tp_size`` (weights, optimizer, RNG of DP rank 0). ``describe(config,
    tp_size)``: how the model of a configuration splits over a TP size (:meth:`tnlg.model.GPT.describe`)."""
    iter_dir, manifest, cfg = open_source(path)
    src_tp = int(need(manifest.layout.tp, "layout.tp"))
    tp_size = tp_size or src_tp
    try:
        cfg.check_tensor_parallel(tp_size)
    except ValueError as exc:
        raise UserError(f"--tensor-model-parallel-size {tp_size}: {exc}") from None
    layout = describe(cfg, tp_size)

    def shard(r, names):
        return read_states(iter_dir, manifest, layout, r, names=names)

    rng_of_rank = None
    if manifest.rng:
        stage = F.stage_tag(0, manifest.layout.pp_size)  # the first stage's (PP 1 is written)
        base = torch.load(os.path.join(iter_dir, F.rng_file(0, 0, stage)), weights_only=True)

        def rng_of_rank(r):
            if tp_size == src_tp and stage is None:  # same TP: every TP rank keeps its dropout stream
                return torch.load(os.path.join(iter_dir, F.rng_file(0, r)), weights_only=True)
            return dict(base, tp=None, tp_device=None)  # reseeded on load

    manifest = manifest.replace(converted_from=dict(checkpoint=os.path.abspath(iter_dir), tp=src_tp))
    return write_converted(dst, manifest, cfg, tp_size, shard, rng_of_rank, layout=layout)
