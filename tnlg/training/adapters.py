"""A fine-tuning run with low-rank adapters (``--lora-rank`` / ``--load-adapter``): the frozen base read from
``--load``, the adapters added (or PEFT's folder read), and the adapters written as PEFT's folder at each save.

The base is built on the run's device and read from its checkpoint parameter by parameter
(:func:`tnlg.checkpoint.loading.load_weights_into`), in 16-bit under ``--bf16`` / ``--fp16``; the engine then holds
the adapters alone (ZeRO over them; 16-bit, with fp32 master weights and moments, as any trained parameter).
A save writes ``SAVE/adapter`` (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``, replaced
whole: written beside it, then renamed), which ``peft.PeftModel.from_pretrained`` loads onto the base's
Hugging Face export and ``tnlg finetune --load-adapter`` reads; beside it, the run's checkpoint holds the adapters
and the run's state for an exact resume (:mod:`.adapter_checkpoint`).
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

import torch

from ..adapters.lora import LoraSettings
from ..checkpoint.loading import load_weights_into
from ..config import GPTConfig
from ..errors import UserError
from ..interop.peft import add_lora, load_peft_adapter, save_peft_adapter
from ..model import GPT
from ..options import Options
from ..parallel.initialization import SelfInitializing
from ..parallel.state import ParallelState

__all__ = ["adapted_model", "frozen_base", "save_adapters", "ADAPTER_DIR", "settings_of"]

ADAPTER_DIR = "adapter"  # under --save


def settings_of(o: Options, cfg: GPTConfig) -> LoraSettings:
    a = o.adapters
    assert a.lora_rank is not None
    return LoraSettings(a.lora_rank, a.lora_alpha, a.lora_dropout, a.use_rslora, seed=cfg.seed)


def frozen_base(cfg: GPTConfig, ps: ParallelState, chunks: list[range], dtype: Optional[torch.dtype],
                read: Optional[Callable[[torch.nn.Module], object]] = None) -> torch.nn.Module:
    """The base model an adapter run freezes, on the run's device: at PP > 1 this pipeline rank's layers (``chunks``:
    its model chunks' layers), its weights read by ``read(model)`` (``None``: its initial ones, as ``tnlg plan
    --simulate --lora-rank`` runs it on fake tensors), held in ``dtype`` (``None``: fp32; 16-bit under ``--bf16`` /
    ``--fp16``: 2 bytes a parameter). A 16-bit base is built on the meta device and its parameters allocated in
    16-bit, then read (each value rounded once, as ``Module.to`` rounds it): no fp32 copy of the model (4 bytes a
    parameter) at setup."""
    def build(device) -> torch.nn.Module:
        if ps.pp_size > 1:  # this pipeline rank's layers, by the GPT's names
            from ..model.stage import StageModel
            return StageModel(cfg, ps, chunks, device=device)
        return GPT(cfg, ps, device=device)

    model = build(ps.device if dtype is None else "meta")
    if dtype is not None:
        _allocate(model, ps.device, dtype)
    if read is not None:
        read(model)
    elif dtype is not None:  # the initial weights, rounded once
        for m in model.modules():
            if isinstance(m, SelfInitializing):
                m.reset_parameters()
    return model


def _allocate(model: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """Every parameter of ``model`` (built on the meta device) allocated on ``device``, floating ones in ``dtype``,
    wherever it is registered (a tied weight stays one parameter), with the attributes tnlg sets on it (its TP
    split, ``pipeline_duplicate``); values unset."""
    places: dict[int, tuple[torch.nn.Parameter, list]] = {}
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                places.setdefault(id(p), (p, []))[1].append((m, k))
        if any(b is not None for b in m._buffers.values()):
            raise ValueError(f"{type(m).__name__} holds buffers, which a frozen base does not allocate")
    for p, holders in places.values():
        new = torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype if p.is_floating_point() else p.dtype),
                                 requires_grad=p.requires_grad)
        for k, v in vars(p).items():
            if not k.startswith("_"):
                setattr(new, k, v)
        for m, k in holders:
            m._parameters[k] = new


def adapted_model(o: Options, cfg: GPTConfig, ps: ParallelState, chunks: list[range]):
    """``(model, settings)``: the base of ``--load`` with its weights, frozen, and the run's adapters; at PP > 1 this
    pipeline rank's layers (``chunks``: its model chunks' layers)."""
    load = o.checkpoint.load
    if load is None:
        raise UserError("adapters train on the weights of --load; give --load DIR.")
    prec = o.precision
    dtype = torch.bfloat16 if prec.bf16 else torch.float16 if prec.fp16 else None
    model = frozen_base(cfg, ps, chunks, dtype, lambda m: load_weights_into(load, m, ps))
    if o.adapters.load_adapter is not None:
        return model, load_peft_adapter(model, o.adapters.load_adapter)  # (its own rank, alpha, dropout, targets)
    settings = settings_of(o, cfg)
    add_lora(model, settings, o.adapters.lora_target_modules)
    return model, settings


def save_adapters(model, save: str, settings: LoraSettings, base: str | None) -> str:
    """PEFT's folder of ``model``'s adapters as ``save/adapter``, replaced whole (collective over TP; the first
    rank writes). Returns its path."""
    final = os.path.join(save, ADAPTER_DIR)
    tmp = final + ".writing"
    if model.ps.rank == 0 and os.path.isdir(tmp):
        shutil.rmtree(tmp)
    save_peft_adapter(model, tmp, settings, base_model=base)
    if model.ps.rank == 0:
        old = final + ".old"
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    return final
