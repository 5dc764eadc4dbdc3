"""``tnlg demo``: build a small GPT split over TP ranks, print each rank's shards, and check
logits, loss and gradients against the same model in one process."""

from __future__ import annotations

import argparse

import torch

from .config import GPTConfig
from .errors import UserError
from .model import GPT, gather_logits
from .parallel.sharding import gather_full
from .testing import run_distributed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=2, help="local processes to launch (default 2)")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=2,
                   help="tensor-parallel size (default 2; must divide --nproc-per-node)")


def _demo_body(ps, cfg):
    model = GPT(cfg, ps)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    lines = [f"[{ps.describe()}]"]
    for name, p in list(model.named_parameters())[:6]:
        lines.append(f"  {name:34s} {str(tuple(p.shape)):>14s}  {'split' if p.tp_sharded else 'replicated'}")
    logits = gather_logits(model(tokens), ps, cfg.vocab_size)
    loss = model(tokens, labels=tokens.roll(-1, 1))
    loss.backward()
    grads = {n: gather_full(p.grad, p, ps) for n, p in model.named_parameters()}
    return "\n".join(lines), logits.detach(), loss.item(), grads


def run(args) -> int:
    if args.nproc_per_node < 1 or args.tp < 1 or args.nproc_per_node % args.tp:
        raise UserError(f"--tensor-model-parallel-size {args.tp} must be a positive divisor of "
                        f"--nproc-per-node {args.nproc_per_node}.")
    # 6 heads: split evenly at TP 2 and 3, unevenly (2, 2, 1, 1) at TP 4
    cfg = GPTConfig(num_layers=2, hidden_size=60, num_attention_heads=6, seq_length=32, vocab_size=1000)
    cfg.check_tensor_parallel(args.tp)
    print(f"tnlg demo: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
          f"(per rank {cfg.heads_per_rank(args.tp)}), on {args.nproc_per_node} gloo processes at TP={args.tp}\n")
    results = run_distributed(_demo_body, args.nproc_per_node, args.tp, cfg)
    for text, *_ in results:
        print(text)
    ref = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    ref_logits = ref(tokens)[..., :cfg.vocab_size]
    ref_loss = ref(tokens, labels=tokens.roll(-1, 1))
    ref_loss.backward()
    worst_logit = max((r[1] - ref_logits).abs().max().item() for r in results)
    worst_loss = max(abs(r[2] - ref_loss.item()) for r in results)
    worst_grad = max((r[3][n] - gather_full(p.grad, p, ref.ps)).abs().max().item()
                     for r in results for n, p in ref.named_parameters())
    ok = max(worst_logit, worst_loss, worst_grad) < 1e-5
    print(f"\nagainst one process: max |logit diff| {worst_logit:.2e}, |loss diff| {worst_loss:.2e}, "
          f"max |grad diff| {worst_grad:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1
