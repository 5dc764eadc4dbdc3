"""Hugging Face references the tests share: a small random GPT-2 of ``transformers`` and GPT-2's byte table."""

from __future__ import annotations

import pytest
import torch


def random_gpt2(vocab: int, seq: int, seed: int = 0, n_embd: int = 32, n_head: int = 4, n_layer: int = 2,
                std: float = 0.2, **config):
    """A random ``transformers`` GPT-2 in eval mode, without dropout, its weights drawn from N(0, ``std``) after
    ``torch.manual_seed(seed)``; its LayerNorms and biases are moved off their initial 1 and 0 (so a mapping that
    drops or swaps one shows). ``config``: further ``GPT2Config`` fields (token ids)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq, vocab_size=vocab,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=std, **config)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable unicode table (openai/gpt-2 encoder.py), written out here to build local
    vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
