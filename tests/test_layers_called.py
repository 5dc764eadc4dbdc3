"""Every tensor-parallel linear of the decoder is called, never read around: a wrapper on any of them (an adapter,
a hook) sees every use. Each linear is wrapped in an identity module that counts its calls and hands attribute
reads to the layer (as PEFT's wrappers do), so a use that reads the layer's weight instead of calling it leaves a
count short; the wrapped model gives the unwrapped model's logits and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tnlg.config import GPTConfig
from tnlg.model import GPT
from tnlg.model.decoder import OutputLayer
from tnlg.parallel.layers import ColumnParallelLinear, KVGroupParallelLinear, RowParallelLinear
from .pool import run_distributed

LINEARS = (ColumnParallelLinear, RowParallelLinear, KVGroupParallelLinear, OutputLayer)
GPT2 = dict(vocab_size=101, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4, hidden_dropout=0.0,
            attention_dropout=0.0, seed=5)
LLAMA = dict(GPT2, num_attention_heads=6, hidden_size=48, group_query_attention=True, num_query_groups=2, normalization="RMSNorm", swiglu=True,
             position_embedding_type="rope", add_bias_linear=False, untie_embeddings_and_output_weights=True,
             ffn_hidden_size=64)


class Counting(nn.Module):
    """An identity wrapper: counts its calls, hands the call and every other attribute to the layer."""

    def __init__(self, layer: nn.Module, counts: dict, name: str):
        super().__init__()
        self.layer, self.counts, self.name = layer, counts, name

    def forward(self, *args, **kwargs):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.layer(*args, **kwargs)

    def __getattr__(self, attr):
        try:
            return super().__getattr__(attr)
        except AttributeError:
            return getattr(self.layer, attr)


def wrap_linears(model: nn.Module) -> dict:
    """Every TP linear of ``model`` replaced in its parent by a :class:`Counting` wrapper; the counts by name."""
    counts: dict = {}
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, LINEARS)]
    for name, layer in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Counting(layer, counts, name))
        counts[name] = 0
    return counts


def _forward_backward(model, tokens):
    labels = torch.roll(tokens, -1, dims=1)
    loss = model(tokens, labels=labels)
    loss.backward()
    grads = {n.replace(".layer.", "."): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def _check(ps, fields: dict, sequence_parallel: bool):
    torch.manual_seed(0)
    cfg = GPTConfig(**fields, sequence_parallel=sequence_parallel)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    plain, wrapped = GPT(cfg, ps), GPT(cfg, ps)
    counts = wrap_linears(wrapped)
    expected = len(counts)
    loss, grads = _forward_backward(plain, tokens)
    loss_w, grads_w = _forward_backward(wrapped, tokens)
    assert torch.equal(loss, loss_w)
    assert grads.keys() == grads_w.keys() and all(torch.equal(grads[n], grads_w[n]) for n in grads)
    assert counts == dict.fromkeys(counts, 1), {n: c for n, c in counts.items() if c != 1}
    # incremental decoding (the KV cache, the head's last position) calls every layer once per step too
    from tnlg.model.kv_cache import KVCache
    wrapped.eval()
    cache = KVCache(wrapped, 2, 12)
    with torch.no_grad():
        wrapped(tokens[:, :5], kv_cache=cache, last_only=True)
        wrapped(tokens[:, 5:6], kv_cache=cache, last_only=True)
    assert counts == dict.fromkeys(counts, 3)
    return expected


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_linear_is_called_once_per_forward_at_tp_1(family):
    from tnlg.parallel.state import ParallelState
    n = _check(ParallelState.single(), GPT2 if family == "gpt2" else LLAMA, False)
    assert n == (4 * 2 if family == "gpt2" else 5 * 2 + 1)  # per block c_attn/c_q+c_kv, c_proj, c_fc, c_proj; head


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_every_linear_is_called_once_per_forward_at_tp_2(sequence_parallel):
    for fields in (GPT2, LLAMA):
        run_distributed(_check, 2, 2, fields, sequence_parallel)
