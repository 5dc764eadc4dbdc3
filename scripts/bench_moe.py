"""A mixture-of-experts training step at EP 1 and EP 2 beside a dense model of the same active parameters, on 2
gloo processes (DP 2, one thread each): tokens/s per rank and the share of the step spent in the all-to-all
(the dispatch and combine collectives, timed where they run). Prints a table and writes JSON (docs/moe.md).

    python scripts/bench_moe.py [--layers 2 --hidden 256 --experts 8 --topk 2 --expert-ffn 512 --seq 256]

The dense model's MLP is ``top-k x expert width`` wide (SwiGLU), so a token runs through as many MLP
parameters as in the MoE (the router's ``E h`` aside). Steps: AdamW through tnlg's engine (ZeRO 1; at EP 2 one
flat backend per gradient kind), warm-up steps first, the median of the timed ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _bench  # noqa: F401  (the repository on sys.path)
from _bench import add_shape_arguments, machine_info, run, write_json

from tnlg.runtime.spawn import run_distributed


def _worker(ps, shape: dict, ep: int, moe: bool, warmup: int, iters: int, batch: int):
    import torch

    import tnlg.parallel.experts as comm
    from tnlg.config import LLAMA, GPTConfig
    from tnlg.model import GPT
    from tnlg.optim.engine import build_engine
    from tnlg.parallel.state import init_expert_parallel
    ps = init_expert_parallel(ps, ep)
    s = shape["seq"]
    fields = dict(num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                  seq_length=s, vocab_size=1024, **LLAMA)
    if moe:
        cfg = GPTConfig(**fields, num_experts=shape["experts"], moe_router_topk=shape["topk"],
                        moe_ffn_hidden_size=shape["expert_ffn"], moe_aux_loss_coeff=0.01)
    else:
        cfg = GPTConfig(**fields, ffn_hidden_size=shape["topk"] * shape["expert_ffn"])
    engine = build_engine(GPT(cfg, ps), ps.for_gradients(), zero_stage=1, lr=1e-4)
    a2a = [0.0]
    original = comm.all_to_all

    def timed(*args, **kw):  # (the forward collectives; their backward runs inside autograd, timed alike below)
        t = time.perf_counter()
        out = original(*args, **kw)
        a2a[0] += time.perf_counter() - t
        return out
    comm.all_to_all = timed
    backward = comm._AllToAll.backward

    def timed_backward(ctx, grad):
        t = time.perf_counter()
        out = backward(ctx, grad)
        a2a[0] += time.perf_counter() - t
        return out
    comm._AllToAll.backward = staticmethod(timed_backward)
    g = torch.Generator().manual_seed(ps.dp_rank)
    times, shares = [], []
    for i in range(warmup + iters):
        tok = torch.randint(0, 1024, (batch, s + 1), generator=g)
        a2a[0] = 0.0
        t = time.perf_counter()
        engine.zero_grad()
        loss = engine.model(tok[:, :-1], labels=tok[:, 1:])
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt)
            shares.append(a2a[0] / dt)
    step = statistics.median(times)
    return dict(step_s=step, tokens_per_s=batch * s / step, a2a_share=statistics.median(shares),
                params=sum(p.numel() for p in engine.model.parameters()), active=cfg.active_parameters())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p, layers=2, hidden=256, heads=4, seq=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="runs/bench_moe.json")
    a = p.parse_args()
    shape = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, experts=a.experts, topk=a.topk,
                 expert_ffn=a.expert_ffn)
    rows = {}
    for name, ep, moe in (("dense (same active MLP)", 1, False), ("MoE EP 1", 1, True), ("MoE EP 2", 2, True)):
        per_rank = run_distributed(_worker, 2, 1, shape, ep, moe, a.warmup, a.iters, a.batch, timeout_s=900)
        rows[name] = dict(step_s=max(r["step_s"] for r in per_rank),
                          tokens_per_s=min(r["tokens_per_s"] for r in per_rank),
                          a2a_share=max(r["a2a_share"] for r in per_rank), params_rank0=per_rank[0]["params"],
                          active=per_rank[0]["active"])
    print(f"{'run':26s} {'step ms':>9s} {'tok/s/rank':>11s} {'all-to-all':>11s} {'params/rank':>12s} {'active':>10s}")
    for name, r in rows.items():
        print(f"{name:26s} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:11.0f} {r['a2a_share']:10.1%} "
              f"{r['params_rank0']:12,d} {r['active']:10,d}")
    write_json(a.out, dict(machine=machine_info(args=vars(a)), rows=rows))
    return 0


if __name__ == "__main__":
    run(main)
