"""Other frameworks' checkpoints: :mod:`tnlg.interop.megatron` (Megatron-LM, both ways). Hugging Face
GPT-2, Llama, Qwen2, Mistral and Qwen3 (one entry each in :mod:`tnlg.interop.families`, what every other
module here derives from): :mod:`tnlg.interop.hf` (models and folders), :mod:`tnlg.interop.hf_reader` (reading a
folder: exactly transformers' model, or one paragraph), :mod:`tnlg.interop.hf_files` (its weight files),
:mod:`tnlg.interop.hf_fields` (every config field's list), :mod:`tnlg.interop.hf_mapping` and
:mod:`tnlg.interop.hf_llama` (configs and state dicts). :mod:`tnlg.interop.sources`: what a model folder is, and
whether it is still the same one."""

import importlib

_PARTS = ("families", "hf", "hf_checkpoint", "hf_fields", "hf_files", "hf_llama", "hf_mapping", "hf_reader", "megatron",
          "sources")


def __getattr__(name: str):
    """``tnlg.interop.hf`` (and the other modules) reachable as attributes whatever imported this package first:
    imported on first use (``import tnlg.interop.hf_fields`` alone binds only that module here)."""
    if name in _PARTS:
        return importlib.import_module(f".{name}", __name__)  # binds itself on this package
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
