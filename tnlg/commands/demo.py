"""``tnlg demo``: build a small GPT split over TP ranks, print each rank's shards, and check
logits, loss and gradients against the same model in one process.

The ranks are started by the launcher like every other job (:mod:`tnlg.runtime.launch`: this command
relaunched on ``--nproc-per-node`` local processes, or joined under ``torchrun``). Each rank builds its
shards, runs forward and backward, and all-gathers its report (shard list, logits, loss, full gradients)
to rank 0 (``all_gather_object`` over the world), which builds the same model in one process and
compares. Every rank then leaves with rank 0's verdict. Torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from ..layout import ParallelDims, World, add_layout_arguments, check_positive
from ..runtime.launch import join, launcher_world_size, relaunch


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_layout_arguments(p, dict(nproc=2, tp=2), help=dict(nproc="default 2", tp="default 2; must divide "
                                                           "--nproc-per-node"))


def _config():
    from ..config import GPTConfig

    # 6 heads: split evenly at TP 2 and 3, unevenly (2, 2, 1, 1) at TP 4
    return GPTConfig(num_layers=2, hidden_size=60, num_attention_heads=6, seq_length=32, vocab_size=1000)


def _tokens(cfg):
    import torch
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))


def _rank_report(ps, cfg):
    """This rank's shard list, full logits, loss and full gradients (its TP group gathers them)."""
    from ..model import GPT, gather_logits
    from ..parallel.sharding import gather_full
    model = GPT(cfg, ps)
    tokens = _tokens(cfg)
    lines = [f"[{ps.describe()}]"]
    for name, p in list(model.named_parameters())[:6]:
        lines.append(f"  {name:34s} {str(tuple(p.shape)):>14s}  {'split' if getattr(p, 'tp_sharded', False) else 'replicated'}")
    logits = gather_logits(model(tokens), ps, cfg.vocab_size)
    loss = model(tokens, labels=tokens.roll(-1, 1))
    loss.backward()
    grads = {n: gather_full(_grad(p), p, ps) for n, p in model.named_parameters()}
    return "\n".join(lines), logits.detach(), loss.item(), grads


def _grad(p):
    """``p.grad`` after the reference's backward (every parameter of the model takes part in the loss)."""
    if p.grad is None:
        raise AssertionError("a parameter of the one-process model has no gradient after backward")
    return p.grad


def _compare(results, cfg) -> bool:
    """Print the ranks' reports and their distance from the one-process model; ``True`` when all agree."""
    from ..model import GPT
    from ..parallel.sharding import gather_full
    for text, *_ in results:
        print(text)
    ref = GPT(cfg)
    tokens = _tokens(cfg)
    ref_logits = ref(tokens)[..., :cfg.vocab_size]
    ref_loss = ref(tokens, labels=tokens.roll(-1, 1))
    ref_loss.backward()
    worst_logit = max((r[1] - ref_logits).abs().max().item() for r in results)
    worst_loss = max(abs(r[2] - ref_loss.item()) for r in results)
    worst_grad = max((r[3][n] - gather_full(_grad(p), p, ref.ps)).abs().max().item()
                     for r in results for n, p in ref.named_parameters())
    ok = max(worst_logit, worst_loss, worst_grad) < 1e-5
    print(f"\nagainst one process: max |logit diff| {worst_logit:.2e}, |loss diff| {worst_loss:.2e}, "
          f"max |grad diff| {worst_grad:.2e} -> {'OK' if ok else 'MISMATCH'}", flush=True)
    return ok


def run(args) -> int:
    world = launcher_world_size()
    nproc = args.nproc_per_node if world is None else world
    check_positive(nproc=nproc)
    ParallelDims.of(World(nproc, f"--nproc-per-node {nproc}") if world is None else
                    World.processes(world, " torchrun started"), args.tp)
    cfg = _config()
    try:
        cfg.check_tensor_parallel(args.tp)
    except ValueError as err:
        raise UserError(f"--tensor-model-parallel-size {args.tp}: {err}") from None
    if world is None:
        print(f"tnlg demo: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
              f"(per rank {cfg.heads_per_rank(args.tp)}), on {nproc} gloo processes at TP={args.tp}\n", flush=True)
        status = relaunch("demo", add_arguments, args, nproc)
        if status is not None:
            return status
    import torch.distributed as dist
    ps = join(args.tp, device="cpu")
    report = _rank_report(ps, cfg)
    results = [report]
    if ps.world_size > 1:
        results = [None] * ps.world_size
        dist.all_gather_object(results, report)
    ok = [_compare(results, cfg) if ps.rank == 0 else None]
    if ps.world_size > 1:
        dist.broadcast_object_list(ok, src=0)
    sys.stdout.flush()
    return 0 if ok[0] else 1
