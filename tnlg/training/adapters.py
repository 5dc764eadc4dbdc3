"""A fine-tuning run with low-rank adapters (``--lora-rank`` / ``--load-adapter``): the frozen base read from
``--load``, the adapters added (or PEFT's folder read), and the adapters written as PEFT's folder at each save.

The base is built on the run's device and read from its checkpoint parameter by parameter
(:func:`tnlg.checkpoint.loading.load_weights_into`), in 16-bit under ``--bf16`` / ``--fp16``; the engine then holds
the adapters alone (ZeRO over them; 16-bit, with fp32 master weights and moments, as any trained parameter).
A save writes ``SAVE/adapter`` (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``, replaced
whole: written beside it, then renamed), which ``peft.PeftModel.from_pretrained`` loads onto the base's
Hugging Face export and ``tnlg finetune --load-adapter`` reads. Resuming a stopped adapter run (the optimizer's
moments, the data position) is not built yet: refused by name.
"""

from __future__ import annotations

import os
import shutil

import torch

from ..adapters.lora import LoraSettings
from ..checkpoint.loading import load_weights_into
from ..config import GPTConfig
from ..errors import UserError
from ..interop.peft import add_lora, load_peft_adapter, save_peft_adapter
from ..model import GPT
from ..options import Options
from ..parallel.state import ParallelState

__all__ = ["adapted_model", "save_adapters", "ADAPTER_DIR", "settings_of"]

ADAPTER_DIR = "adapter"  # under --save


def settings_of(o: Options, cfg: GPTConfig) -> LoraSettings:
    a = o.adapters
    assert a.lora_rank is not None
    return LoraSettings(a.lora_rank, a.lora_alpha, a.lora_dropout, a.use_rslora, seed=cfg.seed)


def adapted_model(o: Options, cfg: GPTConfig, ps: ParallelState, chunks: list[range]):
    """``(model, settings)``: the base of ``--load`` with its weights, frozen, and the run's adapters; at PP > 1 this
    pipeline rank's layers (``chunks``: its model chunks' layers)."""
    load = o.checkpoint.load
    if load is None:
        raise UserError("adapters train on the weights of --load; give --load DIR.")
    model: torch.nn.Module
    if ps.pp_size > 1:  # this pipeline rank's layers, by the GPT's names
        from ..model.stage import StageModel
        model = StageModel(cfg, ps, chunks, device=ps.device)
    else:
        model = GPT(cfg, ps, device=ps.device)
    load_weights_into(load, model, ps)
    prec = o.precision
    if prec.bf16 or prec.fp16:  # the frozen base in 16-bit (2 bytes a parameter); the engine keeps the adapters'
        model.to(torch.bfloat16 if prec.bf16 else torch.float16)  # fp32 master weights and moments
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
