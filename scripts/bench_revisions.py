#!/usr/bin/env python
"""A benchmark of two checkouts of tnlg side by side in one run: this tree ("new") and ``--base`` (another
checkout, e.g. ``git worktree add /tmp/base <commit>``), interleaved round by round so that load from other
processes hits both alike; prints the median step of every row of each and their ratio, writes JSON.

It drives the benchmarks that write rows of times: ``bench_tp`` (its ``rows``: ``impl``/``dtype`` with
``ms_all``, the timed steps) and ``bench_peers`` (its ``raw``: per configuration the tnlg framework's
``times``). Each round runs the benchmark once per checkout, as its own process with ``PYTHONPATH`` set to
that checkout (the benchmark script is the checkout's own), base first on odd rounds, new first on even.

    python scripts/bench_revisions.py --base /tmp/base --bench tp --rounds 3 -- --impls tnlg-tp1,tnlg-tp2,tnlg-tp2-sp
    python scripts/bench_revisions.py --base /tmp/base --bench peers --rounds 3 -- --frameworks tnlg --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import _bench

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = {"tp": ("scripts/bench_tp.py", "--json-out"), "peers": ("scripts/bench_peers.py", "--json")}


def _times(bench: str, report: dict) -> dict[str, list[float]]:
    """Every row's timed steps (ms) by a row name."""
    if bench == "tp":
        return {f"{r['impl']}/{r['dtype']}": list(r["ms_all"]) for r in report["rows"]}
    out: dict[str, list[float]] = {}
    for key, by_fw in report["raw"].items():
        if "tnlg" in by_fw:
            out[f"tnlg/{key}"] = [t * 1e3 for o in by_fw["tnlg"] for t in o["times"]]
    return out


def run_once(checkout: str, bench: str, extra: list[str], workdir: str) -> dict[str, list[float]]:
    script, flag = BENCHES[bench]
    out = os.path.join(workdir, f"{os.path.basename(checkout.rstrip('/'))}-{bench}.json")
    env = dict(os.environ, PYTHONPATH=checkout)
    subprocess.run([sys.executable, os.path.join(checkout, script), *extra, flag, out], env=env, check=True,
                   cwd=workdir, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return _times(bench, json.load(f))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other checkout (a folder holding tnlg/ and scripts/)")
    p.add_argument("--bench", choices=tuple(BENCHES), default="tp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="runs/bench_revisions.json")
    p.add_argument("extra", nargs="*", help="the benchmark's own arguments (after --)")
    a = p.parse_args()
    checkouts = {"base": os.path.abspath(a.base), "new": HERE}
    steps: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    with tempfile.TemporaryDirectory() as work:
        for k in range(a.rounds):
            order = ("base", "new") if k % 2 == 0 else ("new", "base")
            for which in order:
                for row, ts in run_once(checkouts[which], a.bench, a.extra, work).items():
                    steps[which].setdefault(row, []).extend(ts)
            print(f"round {k + 1}/{a.rounds} done", flush=True)
    rows = []
    print(f"{'row':28s} {'base ms':>9s} {'new ms':>9s} {'new/base':>9s}")
    for row in steps["new"]:
        if row not in steps["base"]:
            continue
        b, n = statistics.median(steps["base"][row]), statistics.median(steps["new"][row])
        rows.append(dict(row=row, base_ms=b, new_ms=n, ratio=n / b, base_all=steps["base"][row],
                         new_all=steps["new"][row]))
        print(f"{row:28s} {b:9.1f} {n:9.1f} {n / b:9.3f}")
    _bench.write_json(a.json, dict(_bench.machine_info(), bench=a.bench, base=checkouts["base"], rounds=a.rounds,
                                   extra=a.extra, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
