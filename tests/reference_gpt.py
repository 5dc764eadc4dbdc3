"""A plain ``torch.nn`` GPT-2 and its training loop: the independent reference of the training tests.

Nothing here calls tnlg in the model, the optimizer or the schedule. The model is GPT-2 as the
paper and nanoGPT write it: token embedding plus learned positions, pre-LayerNorm blocks (causal
softmax attention with separate query, key and value projections, a GELU MLP), a final LayerNorm and
the LM head tied to the token embedding (or its own weight, Megatron's untied output layer).

The weights come from a tnlg model's full (TP 1) state dict, read by tnlg's parameter names. The one
layout that differs is the fused QKV weight: tnlg lays its ``3 h`` rows out per head,
``[head][q, k, v][head_dim]`` (so a contiguous TP split gives whole heads; docs/megatron.md and the
docstring of tnlg.model), while here query, key and value are three ``h x h`` linears whose rows run
``[head][head_dim]``; :func:`split_per_head_qkv` and :func:`fuse_per_head_qkv` convert, written from
that description alone (not from tnlg.interop's mapping).

:func:`train_reference` trains it as Megatron does: plain ``torch.optim.AdamW`` with weight decay on
the matrices only, the global gradient norm clipped (``torch.nn.utils.clip_grads_with_norm_``, the norm
before clipping reported), and Megatron's learning-rate schedule (linear warmup from 0, then linear
or cosine decay to ``min_lr``; the update of iteration ``i`` uses the rate after ``i - 1`` steps),
on the whole global batch of each iteration in one micro batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def split_per_head_qkv(t: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of a fused tensor whose first dim is ``[head][q, k, v][head_dim]`` (a weight's
    rows or a bias); each comes out ``[head][head_dim]`` along that dim."""
    rows = t.shape[0]
    per_head = t.reshape(heads, 3, rows // (3 * heads), *t.shape[1:])
    return tuple(per_head[:, i].reshape(rows // 3, *t.shape[1:]) for i in range(3))


def fuse_per_head_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`split_per_head_qkv`: rows ``[head][q, k, v][head_dim]``."""
    rows = q.shape[0]
    parts = [x.reshape(heads, 1, rows // heads, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * rows, *q.shape[1:])


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float, gelu: str):
        super().__init__()
        self.heads, self.gelu = heads, gelu
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.fc, self.fc_out = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (lin(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.attn_out((weights @ v).transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate=self.gelu))


class ReferenceGPT(nn.Module):
    """GPT-2 in plain ``torch.nn`` (no dropout): ``forward(tokens)`` gives the logits ``[b, s, vocab]``."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int, ffn: int | None = None,
                 eps: float = 1e-5, tanh_gelu: bool = True, untied_head: bool = False):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn or 4 * hidden, eps, "tanh" if tanh_gelu else "none")
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        self.head = nn.Linear(hidden, vocab, bias=False) if untied_head else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return x @ (self.wte.weight if self.head is None else self.head.weight).t()

    def tnlg_names(self) -> dict[str, list[nn.Parameter]]:
        """For every tnlg parameter name, the reference parameters that hold it (three for the fused QKV)."""
        names = {"transformer.wte.weight": [self.wte.weight], "transformer.wpe.weight": [self.wpe.weight],
                 "transformer.ln_f.weight": [self.ln_f.weight], "transformer.ln_f.bias": [self.ln_f.bias]}
        if self.head is not None:
            names["lm_head.weight"] = [self.head.weight]
        for i, blk in enumerate(self.blocks):
            pre = f"transformer.h.{i}."
            for kind in ("weight", "bias"):
                names[pre + "ln_1." + kind] = [getattr(blk.ln_1, kind)]
                names[pre + "attn.c_attn." + kind] = [getattr(blk.q, kind), getattr(blk.k, kind), getattr(blk.v, kind)]
                names[pre + "attn.c_proj." + kind] = [getattr(blk.attn_out, kind)]
                names[pre + "ln_2." + kind] = [getattr(blk.ln_2, kind)]
                names[pre + "mlp.c_fc." + kind] = [getattr(blk.fc, kind)]
                names[pre + "mlp.c_proj." + kind] = [getattr(blk.fc_out, kind)]
        return names

    @torch.no_grad()
    def load_tnlg(self, full: dict[str, torch.Tensor]) -> "ReferenceGPT":
        """Copy a tnlg full state dict in (every name used, none missing)."""
        names = self.tnlg_names()
        assert set(names) == set(full), f"names differ: {sorted(set(names) ^ set(full))}"
        for name, params in names.items():
            parts = split_per_head_qkv(full[name], self.heads) if len(params) == 3 else (full[name],)
            for p, t in zip(params, parts):
                p.copy_(t)
        return self

    def as_tnlg(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The parameters (or their gradients) under tnlg's names and layout."""
        out = {}
        for name, params in self.tnlg_names().items():
            ts = [(p.grad if grads else p).detach() for p in params]
            out[name] = fuse_per_head_qkv(*ts, self.heads) if len(ts) == 3 else ts[0].clone()
        return out


def megatron_lr(n: int, max_lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    """The learning rate after ``n`` optimizer steps: linear warmup from 0 over ``warmup`` steps, then
    ``linear`` or ``cosine`` decay to ``min_lr`` at step ``decay``, ``min_lr`` after."""
    if warmup > 0 and n <= warmup:
        return max_lr * n / warmup
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    coeff = {"linear": 1.0 - ratio, "cosine": 0.5 * (math.cos(math.pi * ratio) + 1.0)}[style]
    return min_lr + coeff * (max_lr - min_lr)


def train_reference(model: ReferenceGPT, batches, *, lr: float, min_lr: float, warmup: int, decay: int,
                    style: str, weight_decay: float, betas: tuple[float, float], eps: float,
                    clip_grad: float) -> dict:
    """Train ``model`` one step per global batch of ``batches`` (dicts of ``tokens``/``labels``
    ``[b, s]``); return the losses, the gradient norms (before clipping) and the parameters under
    tnlg's names after the last step."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([dict(params=matrices, weight_decay=weight_decay), dict(params=vectors, weight_decay=0.0)],
                            lr=0.0, betas=betas, eps=eps)
    losses, norms, fp32_norms = [], [], []
    for step, batch in enumerate(batches):
        logits = model(batch["tokens"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        opt.zero_grad()
        loss.backward()
        # the global norm accumulated in fp64 (in fp32 it is off by ~1e-5 relative over 1e5 elements)
        grads = [p.grad.double() for p in model.parameters()]
        norm = torch.nn.utils.get_total_norm(grads)
        fp32_norms.append(fp32_reduced_norms([p.grad for p in model.parameters()]))
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, norm)
        norms.append(norm.item())
        for group in opt.param_groups:
            group["lr"] = megatron_lr(step, lr, min_lr, warmup, decay, style)
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, grad_norms=norms, fp32_reduced_norms=fp32_norms, params=model.as_tnlg())


def fp32_reduced_norms(grads: list[torch.Tensor]) -> list[float]:
    """The same global norm with each tensor's sum of squares reduced in fp32 by two kernels (BLAS's
    ``torch.dot`` and ``torch.linalg.vector_norm``), the per-tensor sums added in fp64: how far an fp32
    reduction of these very gradients lands from their fp64 norm on this CPU (its vector width and
    blocking set the rounding)."""
    flats = [g.detach().float().flatten() for g in grads]
    dot = sum(torch.dot(f, f).double() for f in flats)
    vec = sum(torch.linalg.vector_norm(f).double() ** 2 for f in flats)
    return [math.sqrt(dot.item()), math.sqrt(vec.item())]
