"""Hugging Face GPT-2 interop: ``GPT2LMHeadModel`` <-> tnlg full state dicts.

Differences handled here: GPT-2 stores linear weights as ``Conv1D`` (``[in, out]``,
transposed) and its fused QKV as ``[q | k | v]`` over all heads, where tnlg lays
QKV out per head (``[head][q, k, v][head_dim]``) so a contiguous TP split gives
whole heads. No network access: give a model object or a local folder.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .config import GPTConfig
from .errors import UserError
from .parallel.state import ParallelState
from .shards import full_state_dict, load_full_state_dict

__all__ = ["from_hf", "to_hf", "config_from_hf", "hf_to_tnlg_state_dict", "tnlg_to_hf_state_dict"]

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    act = getattr(hf_config, "activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"GPT-2 activation {act!r} is not supported; tnlg uses GELU in tanh form "
                        f"(activation_function 'gelu_new' or 'gelu_pytorch_tanh').")
    fields = dict(num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                  num_attention_heads=hf_config.n_head, seq_length=hf_config.n_positions,
                  vocab_size=hf_config.vocab_size, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                  hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                  layernorm_epsilon=hf_config.layer_norm_epsilon, init_method_std=hf_config.initializer_range)
    fields.update(overrides)
    return GPTConfig(**fields)


def hf_config_from(cfg: GPTConfig):
    from transformers import GPT2Config
    return GPT2Config(n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
                      n_positions=cfg.seq_length, vocab_size=cfg.vocab_size, n_inner=cfg.ffn_hidden_size,
                      resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
                      attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
                      initializer_range=cfg.init_method_std, activation_function="gelu_new",
                      tie_word_embeddings=True)


def _qkv_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[3h, ...]`` rows in ``[q|k|v]`` order -> per-head ``[head][q,k,v][hd]`` order."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_from_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def hf_to_tnlg_state_dict(hf_sd: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in hf_sd.items():
        if not name.startswith("transformer.") or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # lm_head is tied to wte; attn.bias is GPT-2's causal-mask buffer
        t = t.detach().float()
        if name.endswith(_CONV1D):
            t = t.t()
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            t = _qkv_to_per_head(t, cfg.num_attention_heads)
        out[name] = t.contiguous()
    return out


def tnlg_to_hf_state_dict(full: dict, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in full.items():
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            t = _qkv_from_per_head(t, cfg.num_attention_heads)
        if name.endswith(_CONV1D):
            t = t.t()
        out[name] = t.contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def _load_hf_model(model_or_dir):
    if isinstance(model_or_dir, (str, os.PathLike)):
        if not os.path.isdir(model_or_dir):
            raise UserError(f"Hugging Face model folder {str(model_or_dir)!r} does not exist; give a folder "
                            f"written by save_pretrained (config.json + model.safetensors).")
        from transformers import GPT2LMHeadModel
        return GPT2LMHeadModel.from_pretrained(model_or_dir, local_files_only=True)
    return model_or_dir


def from_hf(model_or_dir, ps: Optional[ParallelState] = None, **overrides):
    """A TP-sharded :class:`tnlg.GPT` with the weights of a GPT-2 model or folder."""
    from .model import GPT
    ps = ps or ParallelState.single()
    hf = _load_hf_model(model_or_dir)
    cfg = config_from_hf(hf.config, **overrides)
    model = GPT(cfg, ps)
    load_full_state_dict(model, hf_to_tnlg_state_dict(hf.state_dict(), cfg), ps)
    return model


def to_hf(model, out_dir: Optional[str] = None):
    """Gather a tnlg model into a ``GPT2LMHeadModel`` (collective over TP); optionally
    ``save_pretrained`` it (safetensors) to ``out_dir`` from the first rank only."""
    from transformers import GPT2LMHeadModel
    full = full_state_dict(model, model.ps)
    hf = GPT2LMHeadModel(hf_config_from(model.config))
    sd = tnlg_to_hf_state_dict(full, model.config)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"HF conversion mismatch: missing {missing}, unexpected {unexpected}")
    if out_dir is not None and model.ps.rank == 0:
        tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
        hf.save_pretrained(tmp, safe_serialization=True)
        if os.path.exists(out_dir):
            import shutil
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    return hf
