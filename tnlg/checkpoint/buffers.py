"""A model's saved buffers: state that is no parameter (no gradient, no optimizer state) but that training
changes, so a resumed run must continue from it: a mixture of experts' expert bias
(``--moe-router-enable-expert-bias``, DeepSeek-V3's auxiliary-loss-free balancing, moved after each step outside
the gradient; :func:`tnlg.model.moe.update_expert_bias`).

Every persistent buffer (what ``state_dict`` holds beside the parameters) is saved whole, once: it is the same
on every TP, DP and EP rank (each updates it alike from counts summed over DP x CP), so the rank of TP 0 and
DP 0 of its pipeline stage writes it into its model file after the parameters (:func:`specs`), and rank 0 lists
it in the manifest's ``buffers`` (shape, dtype, the stage at PP > 1). A load copies each into the model's
buffer of that name (at any layout); a buffer the checkpoint does not hold (one written before buffers were
saved) keeps the model's own value, and the load says so.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn

from ..errors import UserError
from . import files as F
from .manifest import Manifest
from .stream import SafetensorsReader

__all__ = ["persistent_buffers", "specs", "records", "buffer_files", "load_buffers"]


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every persistent buffer of ``model`` (names as ``state_dict``'s), in module order."""
    out = []
    for prefix, m in model.named_modules():
        for n, b in m.named_buffers(recurse=False):
            if b is not None and n not in m._non_persistent_buffers_set:
                out.append((f"{prefix}.{n}" if prefix else n, b))
    return out


def specs(model: nn.Module) -> list[tuple[str, tuple, torch.dtype]]:
    """The stream specs (``(key, shape, dtype)``) of ``model``'s persistent buffers, for its model file."""
    return [(n, tuple(b.shape), b.dtype) for n, b in persistent_buffers(model)]


def records(model: nn.Module, pp_rank: Optional[int]) -> dict:
    """The manifest's ``buffers`` entries of ``model``'s persistent buffers (``pp_rank``: the stage whose model
    file holds them, ``None`` at PP 1)."""
    return {n: dict(shape=list(b.shape), dtype=str(b.dtype).replace("torch.", ""),
                    **({} if pp_rank is None else dict(pp_rank=pp_rank))) for n, b in persistent_buffers(model)}


def _file(rec: dict) -> str:
    return F.model_file(0, rec.get("pp_rank"))


def buffer_files(manifest: Manifest, model: Optional[nn.Module] = None) -> set:
    """The files holding the buffers of ``model`` (``None``: every buffer) that the checkpoint saved (their
    checksums are verified before loading)."""
    saved = manifest.buffers or {}
    names = saved if model is None else [n for n, _ in persistent_buffers(model) if n in saved]
    return {_file(saved[n]) for n in names}


@torch.no_grad()
def load_buffers(iter_dir: str, manifest: Manifest, model: nn.Module) -> list[str]:
    """Copy every buffer of ``model`` the checkpoint saved into it; returns the notes to print (the buffers it
    does not hold, which keep the model's values)."""
    saved, missing = manifest.buffers or {}, []
    readers: dict[str, SafetensorsReader] = {}
    for name, buf in persistent_buffers(model):
        rec = saved.get(name)
        if rec is None:
            missing.append(name)
            continue
        fname = _file(rec)
        path = os.path.join(iter_dir, fname)
        try:
            if fname not in readers:
                readers[fname] = SafetensorsReader(path)
            value = readers[fname].get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - a damaged file: one message
            raise UserError(f"checkpoint file {path!r} has no readable buffer {name!r} ({exc}); it is damaged or "
                            f"from another model.") from None
        if tuple(value.shape) != tuple(buf.shape):
            raise UserError(f"checkpoint {iter_dir!r}: buffer {name!r} has shape {tuple(value.shape)} but the "
                            f"model's is {tuple(buf.shape)}; it was saved from a different architecture.")
        buf.copy_(value.to(buf.dtype))
    if not missing:
        return []
    shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
    return [f"note: checkpoint {iter_dir!r} holds no {shown} ({len(missing)} buffer(s): it was written before "
            f"tnlg saved buffers); they keep their initial values (a router's expert bias restarts at 0)."]
