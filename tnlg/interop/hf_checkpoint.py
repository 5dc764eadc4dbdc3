"""Hugging Face GPT-2, Llama, Qwen2, Mistral and Qwen3 folders <-> tnlg checkpoints, offline (``tnlg convert --from hf`` / ``--to hf``):
the weights mapped by :mod:`tnlg.interop.hf`, the tokenizer by :mod:`tnlg.data.hf_tokenizer`. No
collectives; one process.

The family a folder was read as is part of the architecture transformers sees but not of tnlg's
(a Mistral without a window computes what a Llama does), so a converted checkpoint records it beside the
source's path: the manifest's ``converted_from`` is ``{"hf": PATH, "model_type": TYPE}``. Exporting that
checkpoint writes the recorded family's class where it computes the model, so config.json's
``model_type`` and ``architectures`` come back as they were read (a checkpoint saved by training or
resharded since records where it came from instead, and gets the class the architecture picks).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Optional

import torch

from ..checkpoint import files as F
from ..checkpoint.manifest import CONVERTED_KEYS, FORMAT, Layout, Manifest, OptimizerState
from ..checkpoint.offline import open_source, write_converted
from ..checkpoint.reshard import ShardReader, full_targets, slice_full, targets_for
from ..config import GPTConfig
from ..data.hf_tokenizer import hf_tokenizer_files
from ..data.tokenizer import load_tokenizer
from ..errors import UserError
from ..model import GPT
from .hf import build_hf_model, write_hf_folder
from .hf_mapping import TNLG_DTYPE
from .hf_reader import HFTensors, open_hf_folder

__all__ = ["hf_to_checkpoint", "checkpoint_to_hf"]


def hf_to_checkpoint(hf_dir: str, dst: str, tokenizer_model=None, tp_size: int = 1) -> str:
    """A Hugging Face folder of a family tnlg reads -> a tnlg checkpoint
    (iteration 0, weights only) at TP ``tp_size``; the folder is read by
    :func:`tnlg.interop.hf_reader.open_hf_folder` (exactly what transformers computes, or one paragraph).
    Each rank's shard of each tensor is built when written, from only the Hugging Face tensors it is made
    of, and let go: the process holds about one full tnlg tensor and its shard at a time, never the model."""
    cfg, tensors = open_hf_folder(hf_dir)  # every check before anything is written
    source = dict(hf=os.path.abspath(hf_dir), model_type=tensors.found.family.model_type)
    tok = None
    if tokenizer_model:
        tok = load_tokenizer(tokenizer_model)
        if tok.vocab_size > cfg.vocab_size:
            raise UserError(f"--tokenizer-model {tokenizer_model!r} has {tok.vocab_size} tokens but the model's "
                            f"vocabulary has {cfg.vocab_size}; it is not this model's tokenizer.")
    manifest = Manifest(format=FORMAT, iteration=0, consumed_samples=0, config=cfg.to_dict(), options={}, data=None,
                        tokenizer=None if tok is None else tok.describe(),
                        layout=Layout(param_dtype=str(TNLG_DTYPE).replace("torch.", "")), optimizer=OptimizerState(),
                        schedule=None, converted_from=source, torch=torch.__version__,
                        key_order=CONVERTED_KEYS)

    layout = GPT.describe(cfg, tp_size)

    def shard(r, names):
        return _Shard(tensors, targets_for(layout, r)), None

    return write_converted(dst, manifest, cfg, tp_size, shard, layout=layout)


class _Shard(Mapping):
    """One TP rank's shards, each sliced (:func:`~tnlg.checkpoint.reshard.slice_full`) from its full tensor
    (read and built by ``tensors``) when looked up: :func:`write_converted` looks each up once."""

    def __init__(self, tensors: HFTensors, targets: dict[str, dict]):
        self.tensors, self.targets = tensors, targets

    def __getitem__(self, name: str) -> torch.Tensor:
        return slice_full(self.tensors[name], self.targets[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.targets)

    def __len__(self) -> int:
        return len(self.targets)


def checkpoint_to_hf(path: str, hf_dir: str, tokenizer_model=None, with_tokenizer: bool = True) -> str:
    """A tnlg checkpoint -> a new Hugging Face folder (safetensors) of the class the checkpoint's source family
    or else its architecture picks (module docstring), written atomically
    (:func:`tnlg.interop.hf.write_hf_folder`). With ``with_tokenizer``, the tokenizer ``tokenizer_model``,
    else the checkpoint's recorded one (if any), rides along as ``tokenizer.json`` & co., and its
    end-of-document id is the config's ``bos_token_id``/``eos_token_id``."""
    iter_dir, manifest, cfg = open_source(path)
    tok = _export_tokenizer(manifest, cfg, tokenizer_model) if with_tokenizer else None
    files = None if tok is None else hf_tokenizer_files(tok, cfg.max_position_embeddings)  # checked before reading weights
    reader = ShardReader(iter_dir, manifest, F.model_file)
    full = {n: reader.tensor(n, n, t) for n, t in full_targets(manifest).items()}
    hf = build_hf_model(full, cfg, None if tok is None else tok.eod_id, where=f"checkpoint {iter_dir!r}",
                        family=_source_family(manifest))
    return write_hf_folder(hf, hf_dir, files)


def _source_family(manifest: Manifest) -> Optional[str]:
    """The ``model_type`` of the Hugging Face folder a checkpoint was converted from, where its manifest records
    one (a value this tnlg does not know is no family: the architecture picks)."""
    source = manifest.converted_from or {}
    family = source.get("model_type") if "hf" in source else None
    return family if isinstance(family, str) else None


def _export_tokenizer(manifest: Manifest, cfg: GPTConfig, tokenizer_model=None):
    """The tokenizer an exported folder carries: ``tokenizer_model``, else the checkpoint's, else ``None``."""
    spec = tokenizer_model or manifest.tokenizer
    if not spec:
        return None
    try:
        tok = load_tokenizer(spec)
    except UserError as err:
        flag = "--tokenizer-model" if tokenizer_model else "the checkpoint's tokenizer"
        raise UserError(f"{flag}: {err} The Hugging Face folder carries the tokenizer: pass --tokenizer-model with "
                        "its files, or --no-tokenizer to write the weights alone.") from None
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer {tok!r} has {tok.vocab_size} tokens but the model's vocabulary has "
                        f"{cfg.vocab_size}; it is not this model's tokenizer.")
    return tok
