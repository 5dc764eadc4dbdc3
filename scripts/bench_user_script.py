#!/usr/bin/env python
"""A user's script of the README's shape against the ``tnlg`` command: the same model's training step, idle and
under load.

The README's Python snippets import tnlg first (``import tnlg, torch``): tnlg then sets the OpenMP wait policy
the command sets (``GOMP_SPINCOUNT=1000``, :mod:`tnlg.runtime.threads`) before torch loads libgomp, and
``tnlg.init_parallel`` gives the process the intra-op threads and the CPU heap a command's worker gets
(:mod:`tnlg.parallel.process_settings`). A script that imports torch first gets libgomp's default spin-wait,
which tnlg can no longer change (it warns). Three ways to
train the same GPT (one process, 2 threads, forward + loss + backward + AdamW; fp32 or ``--precision bf16``):

* ``script (tnlg first)``: ``import tnlg, torch``, ``tnlg.GPT`` and ``torch.optim.AdamW``, as the README writes;
* ``script (torch first)``: the same script with ``import torch, tnlg`` (what the README used to show);
* ``tnlg pretrain``: the command on the built-in corpus with the same shape (``--nproc-per-node 1 --tp 1``,
  its ZeRO engine at DP 1; ``--precision bf16``: its ``--bf16``, while the scripts use bf16 autocast), its
  logged ms/iter.

Each run is a fresh process with ``GOMP_SPINCOUNT`` and ``OMP_WAIT_POLICY`` removed from its environment;
the variants interleave within each round. ``--competing-load N`` adds N busy-loop processes
(``python -c "while 1: pass"``) for the loaded half. Prints a table (median and fastest step, and each one's
ratio to the command's) and writes every step's time to JSON with the CPU (``lscpu``'s model name), the
load average and the date.

    python scripts/bench_user_script.py --competing-load 2      # idle, then with 2 busy loops
    python scripts/bench_user_script.py --tiny                  # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import _bench

VARIANTS = ("script (tnlg first)", "script (torch first)", "tnlg pretrain")
SCRIPT = """\
{imports}
import json, time
torch.set_num_threads(2)
cfg = tnlg.GPTConfig(num_layers={layers}, hidden_size={hidden}, num_attention_heads={heads}, seq_length={seq},
                     vocab_size={vocab}, hidden_dropout=0.0, attention_dropout=0.0)
ps = tnlg.init_parallel()
model = tnlg.GPT(cfg, ps)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
sample = torch.randint(0, {vocab}, ({batch}, {seq} + 1), generator=torch.Generator().manual_seed(0))
times = []
for step in range({warmup} + {steps}):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled={bf16}):
        loss = model(sample[:, :-1], labels=sample[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(json.dumps(dict(times=times[{warmup}:], loss=float(loss))))
"""
ITER_LINE = re.compile(r"^iter\s+(\d+)/\d+ \|.*\|\s+([0-9.]+) ms/iter")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([_bench.ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_script(a, tnlg_first: bool) -> list[float]:
    imports = "import tnlg, torch" if tnlg_first else "import torch, tnlg"
    code = SCRIPT.format(imports=imports, layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, vocab=a.vocab,
                         batch=a.micro_batch, warmup=a.warmup, steps=a.steps, bf16=a.precision == "bf16")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                          timeout=a.timeout)
    if done.returncode:
        raise RuntimeError(f"the user script failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["times"]


def run_command(a) -> list[float]:
    with tempfile.TemporaryDirectory() as save:
        argv = ["pretrain", "--nproc-per-node", "1", "--tp", "1", "--num-layers", str(a.layers),
                "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
                "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.micro_batch),
                "--train-iters", str(a.warmup + a.steps), "--log-interval", "1", "--eval-iters", "0",
                "--sample-prompt", "", "--save", save, "--save-interval", "100000", "--no-plot"]
        if a.precision == "bf16":
            argv.append("--bf16")
        done = subprocess.run([sys.executable, "-m", "tnlg", *argv], env=_env(), capture_output=True, text=True,
                              timeout=a.timeout)
    if done.returncode:
        raise RuntimeError(f"tnlg pretrain failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    steps = [(int(m.group(1)), float(m.group(2)) / 1e3) for m in map(ITER_LINE.match, done.stdout.splitlines()) if m]
    return [t for it, t in steps if it > a.warmup]


def measure(a, load: int) -> dict:
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(load)]
    raw: dict = {v: [] for v in VARIANTS}
    loadavg = []
    try:
        for r in range(a.rounds):
            for variant in VARIANTS:
                loadavg.append(float(open("/proc/loadavg").read().split()[0]))
                times = (run_command(a) if variant == "tnlg pretrain"
                         else run_script(a, tnlg_first=variant == VARIANTS[0]))
                raw[variant].append(times)
                print(f"load {load}, round {r + 1}: {variant}: " + " ".join(f"{t * 1e3:.0f}" for t in times) + " ms",
                      flush=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return dict(competing_load=load, load_average=[min(loadavg), max(loadavg)], raw=raw)


def summarise(result: dict) -> dict:
    rows = {}
    for variant, runs in result["raw"].items():
        times = [t for run in runs for t in run]
        rows[variant] = dict(median_ms=statistics.median(times) * 1e3, fastest_ms=min(times) * 1e3)
    ref = rows["tnlg pretrain"]
    for row in rows.values():
        row["vs_command"] = dict(median=row["median_ms"] / ref["median_ms"], fastest=row["fastest_ms"] / ref["fastest_ms"])
    return rows


def print_table(results: list[dict], a) -> None:
    print(f"\n{_bench.cpu_name()}, {os.cpu_count()} CPUs; {a.layers} layers, hidden {a.hidden}, {a.heads} heads, "
          f"seq {a.seq}, vocab {a.vocab}, micro batch {a.micro_batch}, {a.precision}; ms per step (median / fastest)")
    print(f"{'condition':<32} {'variant':<22} {'median':>8} {'fastest':>8} {'/ command':>16}")
    for res in results:
        lo, hi = res["load_average"]
        cond = f"{res['competing_load']} busy loops (load {lo:.1f}-{hi:.1f})"
        for variant, row in res["summary"].items():
            ratio = f"{row['vs_command']['median']:.2f} / {row['vs_command']['fastest']:.2f}"
            print(f"{cond:<32} {variant:<22} {row['median_ms']:8.0f} {row['fastest_ms']:8.0f} {ratio:>16}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _bench.add_shape_arguments(p, layers=2, hidden=512, heads=8, seq=256)
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary (default 4096: the built-in corpus's)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds, fresh processes (default 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (default 5)")
    p.add_argument("--competing-load", type=int, default=2, metavar="N",
                   help="busy-loop processes for the loaded measurement (default 2; 0: idle only)")
    p.add_argument("--no-idle", action="store_true", help="measure under load only")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--tiny", action="store_true", help="a smoke test: 1 layer, hidden 64, seq 32, 1 round, 2 steps")
    p.add_argument("--json", default="bench_user_script.json")
    a = p.parse_args(argv)
    if a.tiny:
        a.layers, a.hidden, a.heads, a.seq, a.rounds, a.warmup, a.steps = 1, 64, 4, 32, 1, 1, 2
    for name in ("rounds", "warmup", "steps", "layers", "hidden", "heads", "seq", "vocab", "micro_batch"):
        if getattr(a, name) < 1:
            raise _bench.UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}.")
    if a.competing_load < 0:
        raise _bench.UserError(f"--competing-load must be 0 or more processes, got {a.competing_load}.")
    return a


def main() -> int:
    a = parse()
    loads = ([] if a.no_idle else [0]) + ([a.competing_load] if a.competing_load else [])
    results = []
    for load in loads:
        res = measure(a, load)
        res["summary"] = summarise(res)
        results.append(res)
    print_table(results, a)
    _bench.write_json(a.json, dict(machine=_bench.machine_info(args=vars(a)), results=results))
    return 0


if __name__ == "__main__":
    _bench.run(main)
