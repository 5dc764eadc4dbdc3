"""DeepSpeed's ZeRO next to ours: the table of ``scripts/bench_zero.py`` with a DeepSpeed column.

Same gpt2-small-shaped GPT, layouts and columns as ``bench_zero.py``; per
layout it builds our stage 0, our stage 1 and DeepSpeed's ZeRO-1 (``--zero-impl
deepspeed``, our TP/DP groups handed to DeepSpeed through an ``mpu``) on the same
weights and times them *interleaved* (one iteration each, in turn), so load from
other processes hits all three alike; DeepSpeed's stages 2 and 3 (``--ds-stages``)
run one after the other. Memory is what each engine holds (``memory_report()``)
next to the fp32 formulas of ``bench_zero.py``; DeepSpeed keeps an fp32 master
copy of its partition even for fp32 parameters, so its optimizer bytes are
``12 Psi / dp`` against the formula's ``8 Psi / dp``.

Usage::

    python scripts/bench_zero_deepspeed.py                 # (tp,dp) = (2,2) and (1,2)
    python scripts/bench_zero_deepspeed.py --layers 4 --steps 3 --ds-stages 1,2,3
"""

from __future__ import annotations

import argparse
import os
import sys

import bench_zero
import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_zero.add_arguments(ap, "bench_zero_deepspeed.json")
    ap.add_argument("--ds-stages", default="1", help="DeepSpeed ZeRO stages to run (1: timed with ours)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        print('DeepSpeed is not installed: nothing to compare (pip install -e ".[deepspeed]").')
        return 1
    ds_stages = [int(s) for s in args.ds_stages.split(",")]
    groups = [[("tnlg", 0), ("tnlg", 1)] + [("deepspeed", s) for s in ds_stages if s == 1]]
    groups += [[("deepspeed", s)] for s in ds_stages if s != 1]
    return bench_zero.run_layouts(args, groups, {"deepspeed": deepspeed.__version__},
                                  note=f", DeepSpeed {deepspeed.__version__}")


if __name__ == "__main__":
    sys.exit(main())
