"""Exit stress: run a short ``tnlg pretrain`` job N times and count the runs that did not exit 0.

What it guards: about one run in 14 of a successful ``tnlg pretrain`` ended with
``terminate called without an active exception`` and ``worker rank 3 failed with
exit code -6``. The cause: the workers left their gloo process groups alive at
interpreter exit, and gloo's worker threads then tore down objects holding Python
references while the interpreter was being finalised (pytorch/pytorch#190489, the
abandoned fix #179291). ``tnlg.cli`` now destroys the process groups when the
command returns, and a launched worker then leaves with ``os._exit`` (see
docs/training_log.md for the runs). This script shows the rate: every run is the same short job (the
built-in model and corpus, 4 local processes, TP 2 x DP 2, ZeRO 1, a few
iterations, a checkpoint), run one after another.

    python scripts/exit_stress.py --runs 50                 # this checkout
    python scripts/exit_stress.py --runs 20 --repo /tmp/old  # another checkout, e.g. before the fix
    python scripts/exit_stress.py --runs 50 --pytest "tests/test_checkpoint_formats.py::test_format1_checkpoint_loads"

``--pytest NODEID`` runs that test instead of the job: the test harness (``tnlg.runtime.spawn``) spawns
its workers with torch.multiprocessing, which leave through ``sys.exit``; one CI run aborted there
(``process 0 terminated with signal SIGABRT`` after the test's work was done) until the harness
left through ``tnlg.runtime.process_exit.leave`` too.

Prints one line per run and a summary; writes JSON (``--out``). Exit status 1 if any
run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

JOB = ["--train-iters", "4", "--log-interval", "2", "--eval-interval", "0", "--no-plot", "--sample-tokens", "0"]
SIGNS = ("terminate called", "exit code -6", "SIGABRT", "Traceback", "failed")


def run_once(python: str, repo: str, save: str, extra: list[str], timeout: float, pytest: str | None = None) -> dict:
    # PYTHONFAULTHANDLER: an abort prints every Python thread's stack (where the process was when it died)
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONFAULTHANDLER="1")
    t = time.perf_counter()
    try:
        command = ([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", pytest, *extra] if pytest else
                   [python, "-m", "tnlg", "pretrain", *JOB, "--save", save, *extra])
        proc = subprocess.run(command, cwd=repo, env=env,
                              capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = "timeout"
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    return dict(exit=code, seconds=round(time.perf_counter() - t, 1), signs=[s for s in SIGNS if s in out],
                tail=out.strip().splitlines()[-40:] if code != 0 else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--runs", type=int, default=50, help="how many runs (default 50)")
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="checkout whose tnlg runs (default: this one)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it counts as hung")
    ap.add_argument("--out", default="runs/exit_stress.json")
    ap.add_argument("--pytest", metavar="NODEID", help="run this test instead of the tnlg pretrain job")
    ap.add_argument("extra", nargs="*", help="more tnlg pretrain (or pytest) flags (after --)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    results = []
    with tempfile.TemporaryDirectory(prefix="tnlg_exit_stress_") as tmp:
        for i in range(args.runs):
            r = run_once(args.python, os.path.abspath(args.repo), os.path.join(tmp, f"run{i}"), args.extra,
                         args.timeout, args.pytest)
            results.append(r)
            bad = r["exit"] != 0
            print(f"run {i + 1:3d}/{args.runs}: exit {r['exit']} in {r['seconds']:.1f} s"
                  + (f"  FAILED {r['signs']}: {' | '.join(r['tail'][-3:])}" if bad else ""), flush=True)
    failed = [r for r in results if r["exit"] != 0]
    aborts = [r for r in results if "terminate called" in r["signs"] or "exit code -6" in r["signs"]]
    summary = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), repo=args.repo,
                   runs=len(results), nonzero_exits=len(failed), aborts_at_exit=len(aborts),
                   job=(["pytest", args.pytest] if args.pytest else ["tnlg", "pretrain", *JOB]) + args.extra, load_average_after=os.getloadavg(),
                   median_seconds=sorted(r["seconds"] for r in results)[len(results) // 2], results=results)
    print(f"{len(failed)} of {len(results)} runs exited non-zero ({len(aborts)} aborted at exit: 'terminate "
          f"called' / exit code -6); median {summary['median_seconds']:.1f} s per run")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
