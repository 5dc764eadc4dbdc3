"""What rank 0 reports: a log line every ``--log-interval`` iterations, one JSON object per iteration
and per validation in the metrics file, and the loss curve next to it at the end.

Per iteration the record holds the loss, learning rate, gradient norm, time, tokens/s,
model TFLOP/s per rank, MFU (model FLOPs / peak) and HFU (executed FLOPs, the
recomputed forward included / peak), and this rank's peak memory. The log line
averages the loss and the rates over the iterations since the last line.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import IO, Optional

from ..io import atomic_output
from ..options import Options
from ..parallel.state import ParallelState
from .throughput import peak_memory_bytes

__all__ = ["Metrics", "open_metrics", "loss_curves", "plot_loss"]


class Metrics:
    """The log lines and the metrics file of one run (rank 0 writes; every rank may call).

    ``flops`` and ``hw_flops`` are one iteration's model and executed FLOPs, ``peak`` the per-rank
    peak TFLOP/s; ``path`` the metrics file (``None``: none), trimmed to ``resumed_at``.
    """

    def __init__(self, o: Options, ps: ParallelState, *, flops: float, hw_flops: float, peak: float,
                 tokens_per_iter: int, path: Optional[str], resumed_at: int):
        self.o, self.ps, self.path = o, ps, path
        self.flops, self.hw_flops, self.peak, self.tokens_per_iter = flops, hw_flops, peak, tokens_per_iter
        self.file: Optional[IO] = None
        if ps.rank == 0 and path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open_metrics(path, resumed_at)
        self._window = (time.perf_counter(), 0.0, 0)  # start, summed loss, iterations

    def log(self, *msg) -> None:
        if self.ps.rank == 0:
            print(*msg, flush=True)

    def record(self, rec: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def _tflops(self, flops: float, seconds: float) -> float:
        """Per-rank TFLOP/s of ``flops`` done in ``seconds``."""
        return flops / seconds / self.ps.world_size / 1e12

    def iteration(self, iteration: int, consumed: int, loss: float, lr: float, info: dict, seconds: float) -> None:
        """Record one iteration; print the log line when it is due (every ``--log-interval``, and the last)."""
        tflops = self._tflops(self.flops, seconds)
        rec = dict(iteration=iteration, consumed_samples=consumed, loss=loss, lr=lr, grad_norm=info["grad_norm"],
                   skipped=info["skipped"], ms_per_iter=seconds * 1e3, tokens_per_s=self.tokens_per_iter / seconds,
                   tflops=tflops, mfu=tflops / self.peak, hfu=self._tflops(self.hw_flops, seconds) / self.peak,
                   peak_tflops=self.peak, peak_memory_bytes=peak_memory_bytes(self.ps.device))
        if info.get("loss_scale") is not None:
            rec["loss_scale"] = info["loss_scale"]
        self.record(rec)
        start, summed, n = self._window
        summed, n = summed + loss, n + 1
        self._window = (start, summed, n)
        if iteration % self.o.log_interval and iteration != self.o.train_iters:
            return
        span = time.perf_counter() - start
        mfu = self._tflops(self.flops * n, span) / self.peak
        hfu = self._tflops(self.hw_flops * n, span) / self.peak
        self.log(f"iter {iteration:6d}/{self.o.train_iters} | samples {consumed:8d} | lr {lr:.3e} | "
                 f"loss {summed / n:.4f} | grad norm {info['grad_norm']:.3f} | "
                 f"{span / n * 1e3:7.1f} ms/iter | {self.tokens_per_iter * n / span:8.0f} tok/s | "
                 f"{self._tflops(self.flops * n, span):.3f} model TFLOP/s/rank | MFU {mfu:.1%}"
                 + (f" HFU {hfu:.1%}" if self.hw_flops != self.flops else "")
                 + f" of {self.peak:.3f} | mem {rec['peak_memory_bytes'] / 2**20:.0f} MiB"
                 + (" | skipped (overflow)" if info["skipped"] else ""))
        self._window = (time.perf_counter(), 0.0, 0)

    def validation(self, iteration: int, loss: Optional[float]) -> Optional[float]:
        """Print and record one validation loss (the one place a validation loss is formatted)."""
        if loss is None:
            return None
        ppl = math.exp(min(20, loss))
        when = "before training" if iteration == 0 else f"at iteration {iteration}"
        self.log(f"validation {when}: loss {loss:.4f} | ppl {ppl:.2f}")
        self.record(dict(split="valid", iteration=iteration, loss=loss, ppl=ppl))
        return loss

    def close(self) -> None:
        """Close the metrics file and draw the loss curve next to it (``--no-plot``: no curve)."""
        if self.file is None:
            return
        self.file.close()
        self.file = None
        if self.o.plot:
            plot_loss(self.path)


def open_metrics(path: str, resumed_at: int) -> IO:
    """The metrics file, opened for appending. A run from scratch starts it afresh; a resumed run first
    drops the records past the iteration it resumed from (an interrupted run's last iterations are
    trained again), so every iteration appears once and in order. The old file is replaced atomically."""
    if resumed_at <= 0 or not os.path.exists(path):
        return open(path, "w")
    dropped = 0
    with open(path) as src, atomic_output(path) as dst:
        for line in src:
            try:
                keep = int(json.loads(line)["iteration"]) <= resumed_at
            except (ValueError, KeyError, TypeError):  # a torn last line of a killed run
                keep = False
            if keep:
                dst.write(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        print(f"{path}: dropped {dropped} record(s) past iteration {resumed_at}, the iteration this run "
              f"resumes from (they are trained again).", flush=True)
    return open(path, "a")


def loss_curves(metrics_path: str) -> tuple[list, list]:
    """``(iteration, loss)`` points of training and validation, in iteration order, one per iteration
    (a repeated iteration keeps its last record): no line of the plot runs backwards."""
    points: dict = {"train": {}, "valid": {}}
    with open(metrics_path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # a torn last line of a killed run
                continue
            if r.get("loss") is not None:
                points["valid" if r.get("split") == "valid" else "train"][r["iteration"]] = r["loss"]
    return sorted(points["train"].items()), sorted(points["valid"].items())


def plot_loss(metrics_path: str) -> None:
    """Loss curve (training and validation) next to the metrics file, written atomically."""
    from ..data.paths import matplotlib_in_cache_dir
    matplotlib_in_cache_dir()  # its font cache under tnlg's cache folder, not ~/.cache/matplotlib
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train, valid = loss_curves(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = os.path.splitext(metrics_path)[0] + "_loss.png"
    with atomic_output(out, "wb") as f:
        fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"loss curve: {out}", flush=True)
