"""Adapters on a frozen model: low-rank adapters (LoRA) on the tensor-parallel linear layers
(:mod:`tnlg.adapters.lora`)."""

from .lora import LoraLinear, LoraSettings, adapter_parameters, apply_lora

__all__ = ["LoraLinear", "LoraSettings", "adapter_parameters", "apply_lora"]
