"""transformers' ``GPT2LMHeadModel`` as the reference of the whole model (:func:`random_gpt2`,
:func:`hf_reference`), the test's own reading of its weights into tnlg's names (written here from the
two layouts, not taken from tnlg.interop.hf), and GPT-2's byte table (:func:`bytes_to_unicode`).

Hugging Face GPT-2 keeps its linears as ``Conv1D`` (weight ``[in, out]``, ``y = x W + b``) and fuses
attention's query, key and value as ``[q | k | v]`` along the output; tnlg keeps ``nn.Linear``-shaped
weights ``[out, in]`` and lays the fused QKV out per head, ``[head][q, k, v][head_dim]``
(tests/reference_gpt.py). So every Conv1D weight is transposed, and the fused QKV's three ``h``-wide
blocks are re-laid per head; all other parameters keep their names and values.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from tnlg.config import GPTConfig

from .reference_gpt import fuse_per_head_qkv

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def tnlg_weights_from_hf(named: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """tnlg's full state dict from a GPT2LMHeadModel's named parameters (or their gradients): every
    Hugging Face name is read, none left over."""
    out = {}
    for name, t in named.items():
        if not (name.startswith("transformer.") or name == "lm_head.weight"):
            raise KeyError(f"unexpected Hugging Face parameter {name}")
        if name.endswith(CONV1D):
            t = t.t()
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):  # [q | k | v] -> per head
            t = fuse_per_head_qkv(*t.chunk(3, dim=0), heads)
        out[name] = t.detach().clone().contiguous()
    return out


class HFReference(NamedTuple):
    """A random-weight GPT-2, tnlg's config and weights of it (the test's own mapping), one batch of
    tokens and labels, and the reference's logits, loss and weight gradients (under tnlg's names)."""
    hf: torch.nn.Module
    cfg: GPTConfig
    weights: dict
    tokens: torch.Tensor
    labels: torch.Tensor
    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict


def hf_reference(n_layer=2, n_embd=32, n_head=4, vocab=100, seq=16, batch=2, seed=0, tanh_gelu=True,
                 untied=False) -> HFReference:
    """GPT2LMHeadModel with the chosen GELU (``gelu_new`` is the tanh form, ``gelu`` the exact one) and
    tying, its loss under tnlg's label convention (labels are the targets of the same positions)."""
    hf = random_gpt2(vocab, seq, seed, n_embd, n_head, n_layer, std=0.02, bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=not untied, activation_function="gelu_new" if tanh_gelu else "gelu")
    with torch.no_grad():  # (untied) a head unlike the embedding, and sharp attention
        for name, p in hf.named_parameters():
            if name == "lm_head.weight" and untied:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("attn.c_attn.weight"):
                # at GPT-2's init (std 0.02) attention is near uniform, and queries swapped with keys
                # change the logits by 1e-4 only (0.09 after this, measured on the default model)
                p.mul_(10.0)
    assert (hf.lm_head.weight is hf.transformer.wte.weight) == (not untied)
    tokens, labels = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    logits = hf(tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    loss.backward()
    cfg = GPTConfig(num_layers=n_layer, hidden_size=n_embd, num_attention_heads=n_head, seq_length=seq,
                    vocab_size=vocab, openai_gelu=tanh_gelu, untie_embeddings_and_output_weights=untied)
    params = dict(hf.named_parameters())  # a tied head is the embedding, listed once
    return HFReference(hf, cfg, tnlg_weights_from_hf(params, n_head), tokens, labels, logits.detach(),
                       loss.detach(), tnlg_weights_from_hf({n: p.grad for n, p in params.items()}, n_head))


def _forward_backward(ps, cfg, weights, tokens, labels):
    """tnlg's model on this rank with the full weights loaded: full logits, loss, full gradients, and the
    gradients of the replicated parameters as this rank holds them."""
    from tnlg.model import GPT
    from tnlg.parallel.sharding import gather_full, load_full_state_dict
    from tnlg.parallel.vocab import gather_logits
    model = GPT(cfg, ps)
    load_full_state_dict(model, weights, ps)
    logits = gather_logits(model(tokens), ps, cfg.vocab_size)
    loss = model(tokens, labels=labels)
    loss.backward()
    grads = {n: gather_full(p.grad, p, ps) for n, p in model.named_parameters()}
    replicated = {n: p.grad.clone() for n, p in model.named_parameters() if not p.tp_sharded}
    return dict(logits=logits.detach(), loss=loss.detach(), grads=grads, replicated=replicated,
                tp_rank=ps.tp_rank, dp_rank=ps.dp_rank)


def check_against_hf(world: int, tp: int, ref: HFReference, tol: float) -> None:
    """tnlg at ``world`` processes and TP ``tp`` gives the reference's logits, loss and gradients; the
    replicated parameters' gradients are bit-identical on every rank of a TP group."""
    from .pool import run_distributed
    results = run_distributed(_forward_backward, world, tp, ref.cfg, ref.weights, ref.tokens, ref.labels)
    for res in results:
        torch.testing.assert_close(res["logits"], ref.logits, atol=tol, rtol=tol)
        torch.testing.assert_close(res["loss"], ref.loss, atol=tol, rtol=tol)
        assert set(res["grads"]) == set(ref.grads)
        for name, g in ref.grads.items():
            torch.testing.assert_close(res["grads"][name], g, atol=tol, rtol=tol, msg=f"grad of {name}")
    for res in results:
        peer = results[res["dp_rank"] * tp]
        for name, g in res["replicated"].items():
            assert torch.equal(g, peer["replicated"][name]), f"replicated grad {name} differs across TP"


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
