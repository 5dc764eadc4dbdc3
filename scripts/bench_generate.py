"""Generation benchmark: tokens/s of greedy decoding, tnlg (TP 1 and 2, with and without the
KV cache) against `transformers` generate on the same weights.

Two measurements, side by side in one run, on a random-weight GPT-2-shaped model
(GPT-2 vocabulary; the shape is set with flags, default 6 layers x 384 hidden so a
2-core machine finishes in a few minutes):

1. **Throughput**: greedy generation of ``--new-tokens`` (128) tokens after a
   ``--prompt-len`` (256) token prompt, batch 1, no early stop; new tokens per second
   of wall time, prefill included. tnlg at TP 1 (all threads in one process) and at
   TP 2 (two gloo processes, ``threads / 2`` threads each), with and without the
   KV cache; `transformers` ``generate`` with and without its cache at TP 1.
2. **Cost per new token at a long prefix** (``--prefix`` 512 tokens): the time of
   ``n`` extra tokens, ``(t(1 + n) - t(1)) / n``, so the prefill cancels; with the
   cache one new token is one single-position forward, without it one forward over
   the whole prefix. Target: at least 5x lower with the cache.

Every figure is the best of ``--repeats`` runs after a warm-up (``--repeats-no-cache``
for the slow runs without a cache), the runs of tnlg TP 1 and `transformers` interleaved
so that a busy spell of the machine hits both alike; the load average is recorded. Prints a table and
writes JSON (``--out``).

    python scripts/bench_generate.py [--layers 6 --hidden 384 --heads 6] [--tp 1 2] [--out runs/bench_generate.json]
    python scripts/bench_generate.py --device cuda --tp 1 --layers 12 --hidden 768 --heads 12   # one GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _bench
import torch

from tnlg.config import GPTConfig
from tnlg.generation import generate_ids
from tnlg.interop.hf import to_hf
from tnlg.model import GPT
from tnlg.parallel.state import ParallelState


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tnlg_generator(model):
    """``gen(prompt ids, n, cache) -> n new ids`` with tnlg (every TP rank calls it)."""
    def gen(prompt, n, cache):
        return generate_ids(model, [prompt], n, greedy=True, use_cache=cache)[0]
    return gen


def hf_generator(hf, device):
    """The same with `transformers` generate (greedy, exactly n new tokens)."""
    def gen(prompt, n, cache):
        p = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, use_cache=cache, pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()
    return gen


def measure(generators: dict, o, vocab: int, device) -> dict:
    """Best-of timings of every generator, trials interleaved across generators so that a
    busy spell of the machine hits them alike; returns the figures per generator."""
    prompt, long_prompt = _prompt(o.prompt_len, vocab, 0), _prompt(o.prefix, vocab, 1)
    jobs = {}  # (name, figure, cache) -> (call, repeats)
    for name, gen in generators.items():
        for cache in (True, False):
            reps = o.repeats if cache else o.repeats_no_cache
            jobs[name, "throughput", cache] = (lambda g=gen, c=cache: g(prompt, o.new_tokens, c), reps)
            jobs[name, "prefix_1", cache] = (lambda g=gen, c=cache: g(long_prompt, 1, c), o.repeats)
            jobs[name, "prefix_n", cache] = (lambda g=gen, c=cache: g(long_prompt, 1 + o.extra, c), reps)
    first = {name: gen(prompt, 16, True) for name, gen in generators.items()}  # warm-up, and the tokens
    for gen in generators.values():
        gen(long_prompt, 2, False)
    best = {}
    for trial in range(max(o.repeats, o.repeats_no_cache)):
        for key, (call, reps) in jobs.items():
            if trial >= reps:
                continue
            _sync(device)
            t = time.perf_counter()
            call()
            _sync(device)
            best[key] = min(best.get(key, float("inf")), time.perf_counter() - t)
    out = {}
    for name in generators:
        r = {"first_tokens": first[name]}
        for cache, tag in ((True, "cache"), (False, "no_cache")):
            r[f"tokens_per_s_{tag}"] = o.new_tokens / best[name, "throughput", cache]
            extra = best[name, "prefix_n", cache] - best[name, "prefix_1", cache]
            r[f"ms_per_token_at_prefix_{tag}"] = 1000 * max(extra, 0.0) / o.extra
        out[name] = r
    return out


def _build(cfg: GPTConfig, ps, device):
    """The seeded init is TP-invariant: every TP size gets slices of the same full weights."""
    return GPT(cfg, ps, device=device).eval()


def _tp_body(ps, cfg, o):
    torch.set_num_threads(max(1, o.threads // ps.tp_size))
    model = _build(cfg, ps, "cpu")
    return measure({f"tnlg TP={ps.tp_size}": tnlg_generator(model)}, o, cfg.vocab_size, "cpu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _bench.add_shape_arguments(p, layers=6, hidden=384, heads=6, seq=1024, seq_flag="--seq-length")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefix", type=int, default=512, help="prefix length for the per-token cost")
    p.add_argument("--extra", type=int, default=16, help="extra tokens timed at the long prefix")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure with the cache (best of)")
    p.add_argument("--repeats-no-cache", type=int, default=1, help="timed runs per figure without the cache")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (TP 1 only: one GPU)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--out", default="runs/bench_generate.json")
    o = p.parse_args()
    if o.prompt_len + o.new_tokens > o.seq_length or o.prefix + 1 + o.extra > o.seq_length:
        p.error("prompt + new tokens and prefix + extra tokens must fit --seq-length")
    cfg = GPTConfig(num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads,
                    seq_length=o.seq_length, vocab_size=o.vocab)
    torch.set_num_threads(o.threads)
    load_start = os.getloadavg()[0]
    rows = {}
    model = _build(cfg, ParallelState.single(o.device), o.device)
    here = {"tnlg TP=1": tnlg_generator(model)} if 1 in o.tp else {}
    if not o.no_hf:
        here["transformers"] = hf_generator(to_hf(model).to(o.device).eval(), o.device)
    t0 = time.time()
    rows.update(measure(here, o, cfg.vocab_size, o.device))
    print(f"  {', '.join(here)}: {time.time() - t0:.0f} s", file=sys.stderr)
    for tp in (t for t in o.tp if t > 1):
        if o.device != "cpu":
            print(f"skipping TP={tp}: this script runs TP > 1 on CPU gloo processes only", file=sys.stderr)
            continue
        from tnlg.runtime.spawn import run_distributed
        t0 = time.time()
        rows.update(run_distributed(_tp_body, tp, tp, cfg, o, timeout_s=1800)[0])
        print(f"  tnlg TP={tp}: {time.time() - t0:.0f} s", file=sys.stderr)
    rows = {k: rows[k] for k in sorted(rows, key=lambda k: (k == "transformers", k))}

    params = sum(p.numel() for p in model.parameters())
    meta = _bench.machine_info(device=o.device, threads=o.threads,
                               gpu=torch.cuda.get_device_name() if o.device.startswith("cuda") else None,
                               model=dict(layers=o.layers, hidden=o.hidden, heads=o.heads, vocab=o.vocab,
                                          params=params),
                               prompt_len=o.prompt_len, new_tokens=o.new_tokens, prefix=o.prefix, extra=o.extra,
                               repeats=o.repeats, load_average_start=load_start, load_average_end=os.getloadavg()[0])
    print(f"\ngreedy generation, batch 1, {o.layers} layers x {o.hidden} hidden, vocab {o.vocab} "
          f"({params / 1e6:.1f}M params), {o.device}, {o.threads} threads, torch {torch.__version__}")
    print(f"{'':18s} {'tok/s cache':>12s} {'tok/s no cache':>15s} {'ms/token @' + str(o.prefix) + ' cache':>20s} "
          f"{'no cache':>9s} {'speed-up':>9s}")
    for name, r in rows.items():
        speedup = r["ms_per_token_at_prefix_no_cache"] / max(r["ms_per_token_at_prefix_cache"], 1e-9)
        r["cache_speedup_at_prefix"] = speedup
        print(f"{name:18s} {r['tokens_per_s_cache']:12.1f} {r['tokens_per_s_no_cache']:15.1f} "
              f"{r['ms_per_token_at_prefix_cache']:20.2f} {r['ms_per_token_at_prefix_no_cache']:9.2f} "
              f"{speedup:8.1f}x")
    firsts = {name: r.pop("first_tokens", None) for name, r in rows.items()}
    if "transformers" in firsts:
        for name, toks in firsts.items():
            same = next((i for i, (a, b) in enumerate(zip(toks, firsts["transformers"])) if a != b), len(toks))
            rows[name]["same_first_tokens_as_transformers"] = same
        print(f"greedy tokens equal to transformers' (first 16): "
              f"{ {n: r['same_first_tokens_as_transformers'] for n, r in rows.items()} }")
    if "transformers" in rows and "tnlg TP=1" in rows:
        ratio = rows["tnlg TP=1"]["tokens_per_s_cache"] / rows["transformers"]["tokens_per_s_cache"]
        print(f"tnlg TP=1 / transformers (cache): {ratio:.2f}x")
    _bench.write_json(o.out, dict(meta=meta, results=rows), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
