"""Context parallelism on CPU: step time and activation memory per rank at CP 1, 2 and 4 for one long sequence.

Each CP size runs in its own gloo group (``tnlg.runtime.spawn``) on the same cores in all: CP 1 one process
with ``--cores`` threads, CP ``C`` ``C`` processes with ``cores / C`` threads each (at least one: CP 4 on 2 cores
oversubscribes, and says so). A step is the GPT's forward and backward of one sequence (fp32, no dropout;
the optimizer is left out: it does not change with CP). The activations per rank are the bytes of the
distinct storages autograd keeps for backward at the end of the forward (``saved_tensors_hooks``: every
tensor saved by an operator or by the ring's autograd function; parameters left out), next to the planner's
``context_activation_bytes`` for the same shape (fp32, no recomputation, the fused core; less its
one-layer ring buffers, which are transient). ``--rounds`` fresh groups per CP size, the sizes interleaved
(CP 1, 2, 4, CP 1, 2, 4, ...) so that a shared machine's load falls on all alike; each runs one warm-up step and
``--iters`` timed ones (a step's time: its slowest rank). OpenMP waits as under the ``tnlg`` command
(:func:`tnlg.runtime.threads.set_wait_policy`). Reported: the median and the fastest step over all
rounds, their ratios to CP 1, the CPU and the load average before and after. Prints a table and writes JSON
(``--json``).

    python scripts/bench_cp.py --seq 4096 --rounds 3 --json bench_cp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tnlg.runtime.threads import set_wait_policy  # noqa: E402

set_wait_policy()  # OpenMP's wait as the tnlg command sets it (before torch loads; the workers inherit it)

import torch  # noqa: E402

from tnlg.config import GPTConfig  # noqa: E402
from tnlg.runtime.spawn import run_distributed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import cpu_name  # noqa: E402


def _saved_bytes(model, tokens, labels) -> tuple[torch.Tensor, int]:
    """The loss and the bytes of distinct storages saved for backward by its forward (parameters, which
    linear layers save for their input gradient, are model states, not activations: left out)."""
    seen: dict = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in params:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=labels)
    return loss, sum(seen.values())


def _worker(_ps, cfg_fields: dict, cp: int, iters: int) -> dict:
    from tnlg.model import GPT
    from tnlg.parallel.context import context_parallel_batch
    from tnlg.parallel.state import init_parallel
    ps = init_parallel(1, context_parallel_size=cp)
    cfg = GPTConfig(**cfg_fields)
    model = GPT(cfg, ps)
    gen = torch.Generator().manual_seed(0)
    sample = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length + 1), generator=gen)
    batch = context_parallel_batch({"tokens": sample[:, :-1], "labels": sample[:, 1:]}, ps)
    times, saved, loss = [], 0, None
    for i in range(iters + 1):
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
        t0 = time.perf_counter()
        loss, saved = _saved_bytes(model, batch["tokens"], batch["labels"])
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return {"rank": ps.rank, "times": times, "saved_bytes": saved, "loss": float(loss.detach())}


def _planned(cfg: GPTConfig, cp: int) -> tuple[int, int]:
    """The planner's activations kept for backward (its total less the one-layer ring buffers, which live
    only while a layer's ring runs and so are not among the tensors saved at the end of the forward),
    and those ring buffers."""
    from tnlg.plan.context import context_activation_bytes
    acts = context_activation_bytes(cfg, 1, cp, 1, False, "fp32")
    return acts["total"] - acts["ring_working"], acts["ring_working"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, a fresh group per CP size each")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    fields = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                  vocab_size=a.vocab)
    cfg = GPTConfig(**fields)
    cps = [int(c) for c in a.cps.split(",")]
    load_before = os.getloadavg()
    runs: dict = {cp: [] for cp in cps}
    for r in range(a.rounds):
        for cp in cps:
            threads = max(1, a.cores // cp)
            per_rank = run_distributed(_worker, cp, 1, fields, cp, a.iters, timeout_s=900, threads=threads)
            runs[cp].append(per_rank)
            steps = [max(t) for t in zip(*(x["times"] for x in per_rank))]  # a step lasts as long as its slowest rank
            print(f"round {r + 1}: CP {cp}: " + " ".join(f"{t:.3f}" for t in steps) + " s", flush=True)
    rows = []
    for cp in cps:
        threads = max(1, a.cores // cp)
        steps = [max(t) for per_rank in runs[cp] for t in zip(*(x["times"] for x in per_rank))]
        per_rank = runs[cp][0]
        rows.append({"cp": cp, "processes": cp, "threads_per_process": threads,
                     "oversubscribed": cp * threads > a.cores,
                     "step_s": statistics.median(steps), "fastest_step_s": min(steps), "step_times_s": steps,
                     "saved_bytes_per_rank": max(x["saved_bytes"] for x in per_rank),
                     "planned_bytes_per_rank": _planned(cfg, cp)[0], "planned_ring_buffers": _planned(cfg, cp)[1],
                     "loss": per_rank[0]["loss"]})
    load_after = os.getloadavg()
    base = rows[0]
    print(f"GPT {a.layers} layers x {a.hidden} hidden, {a.heads} heads, one sequence of {a.seq} tokens, fp32, "
          f"forward + backward; {a.cores} cores; torch {torch.__version__}")
    print(f"CPU {cpu_name()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {a.rounds} "
          f"interleaved round(s) of {a.iters} timed steps; step s: median / fastest")
    print(f"{'CP':>3} {'procs x thr':>11} {'step s':>15} {'x CP1':>11} {'act MB/rank':>12} {'x CP1':>6} "
          f"{'planned MB':>11} {'meas/plan':>9} {'loss':>9}")
    for r in rows:
        r["step_ratio"] = r["step_s"] / base["step_s"]
        r["fastest_step_ratio"] = r["fastest_step_s"] / base["fastest_step_s"]
        r["memory_ratio"] = r["saved_bytes_per_rank"] / base["saved_bytes_per_rank"]
        r["measured_over_planned"] = r["saved_bytes_per_rank"] / r["planned_bytes_per_rank"]
        print(f"{r['cp']:>3} {r['processes']:>5} x {r['threads_per_process']:<3}{'*' if r['oversubscribed'] else ' ':1}"
              f" {r['step_s']:>7.3f} {r['fastest_step_s']:>7.3f} {r['step_ratio']:>5.2f} {r['fastest_step_ratio']:>5.2f}"
              f" {r['saved_bytes_per_rank'] / 1e6:>12.1f} "
              f"{r['memory_ratio']:>6.2f} {r['planned_bytes_per_rank'] / 1e6:>11.1f} "
              f"{r['measured_over_planned']:>9.2f} {r['loss']:>9.5f}")
    if any(r["oversubscribed"] for r in rows):
        print("* more processes than cores: that row's step time is not comparable")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": fields, "cores": a.cores, "torch": torch.__version__, "cpu": cpu_name(),
                       "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "rounds": a.rounds,
                       "iters": a.iters, "load_average_before": load_before, "load_average_after": load_after,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
