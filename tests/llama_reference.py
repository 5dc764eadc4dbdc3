"""The independent references of the Llama-family tests: transformers' ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` (random weights, built offline), the test's own reading of their weights into tnlg's
names, and a plain ``torch.nn`` Llama trained with ``torch.optim.AdamW``.

Nothing here calls tnlg in a model, its weights' mapping or an optimizer. The layouts, written from
their descriptions (tnlg.model's and tnlg.parallel.layers' docstrings, transformers' module names):

* transformers keeps ``q_proj`` ``[H d, h]``, ``k_proj`` / ``v_proj`` ``[G d, h]`` (rows ``[head][d]``);
  tnlg's grouped-query attention keeps the queries as ``attn.c_q.weight`` (the same rows) and the keys
  and values as ``attn.c_kv.weight`` ``[G, 2, d, h]`` (group, then key / value); without grouping
  (``G = H``) the fused ``attn.c_attn.weight`` rows ``[head][q, k, v][d]``.
* SwiGLU's ``gate_proj`` and ``up_proj`` ``[f, h]`` are tnlg's ``mlp.c_fc.weight`` ``[2, f, h]`` (gate
  first); ``down_proj`` is ``mlp.c_proj.weight``; ``o_proj`` is ``attn.c_proj.weight``.
* ``input_layernorm`` / ``post_attention_layernorm`` / ``model.norm`` are ``ln_1`` / ``ln_2`` / ``ln_f``;
  ``embed_tokens`` is ``transformer.wte``; ``lm_head`` is ``lm_head``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .reference_gpt import fuse_per_head_qkv, megatron_lr, split_per_head_qkv

LAYER = {"input_layernorm.weight": "ln_1.weight", "post_attention_layernorm.weight": "ln_2.weight",
         "self_attn.o_proj.weight": "attn.c_proj.weight", "mlp.down_proj.weight": "mlp.c_proj.weight",
         "self_attn.o_proj.bias": "attn.c_proj.bias", "mlp.down_proj.bias": "mlp.c_proj.bias"}  # (Llama's biases)


def random_llama(kind: str = "llama", layers=2, hidden=48, heads=6, groups=2, ffn=64, vocab=100, seq=32,
                 theta=10000.0, seed=0, **config):
    """A random ``LlamaForCausalLM`` (``kind="qwen2"``: ``Qwen2ForCausalLM``, QKV biases), fp32, untied,
    weights sharpened so attention is far from uniform (queries and keys swapped would show); ``config``:
    further config fields (or other values of those set here)."""
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=groups, max_position_embeddings=seq,
                  rms_norm_eps=1e-5, rope_theta=theta, tie_word_embeddings=False, hidden_act="silu",
                  attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    if kind == "qwen2":
        common.update(dict(use_sliding_window=False), **config)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        common.update(dict(attention_bias=False, mlp_bias=False), **config)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.1 * torch.randn_like(p))  # not ones / zeros: a swapped norm or bias would show
    model.config._attn_implementation = "eager"
    return model.eval()


def tnlg_config_kwargs(hf_config) -> dict:
    """tnlg's GPTConfig fields of a Llama/Qwen2 config (the test's reading)."""
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_theta": hf_config.rope_theta}
    return dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=heads,
                seq_length=hf_config.max_position_embeddings, vocab_size=hf_config.vocab_size,
                ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=hf_config.rms_norm_eps,
                position_embedding_type="rope", rotary_base=float(rope["rope_theta"]), normalization="RMSNorm",
                swiglu=True, add_bias_linear=False, add_qkv_bias=hf_config.model_type == "qwen2",
                untie_embeddings_and_output_weights=True, group_query_attention=groups != heads,
                num_query_groups=groups if groups != heads else None)


def _kv(k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[G d, ...]`` keys and values -> ``[G, 2, d, ...]``."""
    return torch.stack([k.reshape(groups, -1, *k.shape[1:]), v.reshape(groups, -1, *v.shape[1:])], dim=1)


def tnlg_weights_from_hf(named: dict, heads: int, groups: int) -> dict[str, torch.Tensor]:
    """tnlg's full state dict from a Llama/Qwen2's named parameters (or gradients); every name read."""
    out, attn = {}, {}
    for name, t in named.items():
        t = t.detach().clone()
        if name == "model.embed_tokens.weight":
            out["transformer.wte.weight"] = t
        elif name == "model.norm.weight":
            out["transformer.ln_f.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        else:
            _, _, i, rest = name.split(".", 3)
            pre = f"transformer.h.{i}."
            if rest in LAYER:
                out[pre + LAYER[rest]] = t
            else:
                attn.setdefault(i, {})[rest] = t
    for i, p in attn.items():
        pre = f"transformer.h.{i}."
        for kind in ("weight", "bias"):  # (mlp_bias: gate and up biases [2, f] as the weights)
            if f"mlp.gate_proj.{kind}" in p:
                gate, up = p.pop(f"mlp.gate_proj.{kind}"), p.pop(f"mlp.up_proj.{kind}")
                out[pre + f"mlp.c_fc.{kind}"] = torch.stack([gate, up])
        for kind in ("weight", "bias"):
            if f"self_attn.q_proj.{kind}" not in p:
                continue
            q, k, v = (p.pop(f"self_attn.{x}_proj.{kind}") for x in "qkv")
            if groups == heads:
                out[pre + f"attn.c_attn.{kind}"] = fuse_per_head_qkv(q, k, v, heads)
            else:
                out[pre + f"attn.c_q.{kind}"], out[pre + f"attn.c_kv.{kind}"] = q, _kv(k, v, groups)
        assert not p, f"unread Hugging Face parameters {sorted(p)}"
    return {n: t.contiguous() for n, t in out.items()}


# --------------------------------------------------------------------------- the plain torch.nn Llama
def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rope at positions 0..s-1 of ``x`` ``[b, heads, s, d]`` (Su et al.; Llama's layout)."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.outer(torch.arange(s).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaBlock(nn.Module):
    def __init__(self, hidden, heads, groups, ffn, eps, theta):
        super().__init__()
        self.heads, self.groups, self.theta, d = heads, groups, theta, hidden // heads
        self.ln_1, self.ln_2 = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.q = nn.Linear(hidden, heads * d, bias=False)
        self.k, self.v = (nn.Linear(hidden, groups * d, bias=False) for _ in range(2))
        self.o = nn.Linear(heads * d, hidden, bias=False)
        self.gate, self.up = (nn.Linear(hidden, ffn, bias=False) for _ in range(2))
        self.down = nn.Linear(ffn, hidden, bias=False)

    def attention(self, x):
        b, s, _ = x.shape
        d = self.q.out_features // self.heads
        q = self.q(x).view(b, s, self.heads, d).transpose(1, 2)
        k, v = (lin(x).view(b, s, self.groups, d).transpose(1, 2) for lin in (self.k, self.v))
        q, k = _rope(q, self.theta), _rope(k, self.theta)
        rep = self.heads // self.groups  # head i reads group i // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        return self.o((scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        h = self.ln_2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ReferenceLlama(nn.Module):
    """Llama in plain ``torch.nn``: embedding, RMSNorm pre-norm blocks (rope, grouped-query attention,
    SwiGLU), final RMSNorm, untied head; ``forward(tokens)`` gives the logits."""

    def __init__(self, layers, hidden, heads, groups, ffn, vocab, eps=1e-5, theta=10000.0):
        super().__init__()
        self.heads, self.groups = heads, groups
        self.wte = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, groups, ffn, eps, theta) for _ in range(layers))
        self.ln_f = RMSNorm(hidden, eps)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def load_tnlg(self, full: dict) -> "ReferenceLlama":
        used = {"transformer.wte.weight", "transformer.ln_f.weight", "lm_head.weight"}
        self.wte.weight.copy_(full["transformer.wte.weight"])
        self.ln_f.weight.copy_(full["transformer.ln_f.weight"])
        self.head.weight.copy_(full["lm_head.weight"])
        for i, blk in enumerate(self.blocks):
            pre = f"transformer.h.{i}."
            for ours, theirs in (("ln_1.weight", blk.ln_1.weight), ("ln_2.weight", blk.ln_2.weight),
                                 ("attn.c_proj.weight", blk.o.weight), ("mlp.c_proj.weight", blk.down.weight)):
                theirs.copy_(full[pre + ours])
                used.add(pre + ours)
            blk.gate.weight.copy_(full[pre + "mlp.c_fc.weight"][0])
            blk.up.weight.copy_(full[pre + "mlp.c_fc.weight"][1])
            if self.groups == self.heads:
                q, k, v = split_per_head_qkv(full[pre + "attn.c_attn.weight"], self.heads)
                used |= {pre + "attn.c_attn.weight"}
            else:
                kv = full[pre + "attn.c_kv.weight"]  # [G, 2, d, h]
                q, k, v = full[pre + "attn.c_q.weight"], kv[:, 0].flatten(0, 1), kv[:, 1].flatten(0, 1)
                used |= {pre + "attn.c_q.weight", pre + "attn.c_kv.weight"}
            blk.q.weight.copy_(q)
            blk.k.weight.copy_(k)
            blk.v.weight.copy_(v)
            used.add(pre + "mlp.c_fc.weight")
        assert used == set(full), f"names differ: {sorted(used ^ set(full))}"
        return self


def train_llama_reference(model: ReferenceLlama, batches, *, lr, min_lr, warmup, decay, style, weight_decay,
                          betas, eps, clip_grad, snapshot_after: int = 0) -> dict:
    """One ``torch.optim.AdamW`` step per global batch (decay on matrices), the global norm clipped;
    the losses and the norms before clipping; with ``snapshot_after`` ``k``, also ``state``: a copy of the
    model's state dict after ``k`` steps (what a checkpoint of iteration ``k`` holds)."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([dict(params=matrices, weight_decay=weight_decay), dict(params=vectors, weight_decay=0.0)],
                            lr=0.0, betas=betas, eps=eps)
    losses, norms, state = [], [], None
    for step, batch in enumerate(batches):
        loss = F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["labels"].flatten())
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad.double() for p in model.parameters()])
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_grad, norm)
        norms.append(norm.item())
        for group in opt.param_groups:
            group["lr"] = megatron_lr(step, lr, min_lr, warmup, decay, style)
        opt.step()
        losses.append(loss.item())
        if step + 1 == snapshot_after:
            state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return dict(losses=losses, grad_norms=norms, state=state)
