"""What rank 0 reports: a log line every ``--log-interval`` iterations (and at the run's first), one JSON
object per iteration and per validation in the metrics file, the same scalars to TensorBoard and W&B
when asked (:mod:`.loggers`), and the loss curve next to the metrics file at the end.

Per iteration the record holds the loss, learning rate, gradient norm, time, tokens/s,
model TFLOP/s per rank, MFU (model FLOPs / peak) and HFU (executed FLOPs, the
recomputed forward included / peak), and this rank's peak memory; the first record of a
resumed run also says where it resumed (``resumed_from``). The log line averages the loss
and the rates over the iterations since the last line, and ends with the time since the
run started and the time left at that pace.

rank 0 writes the metrics file unbuffered, one whole record per call, so a write that fails (a full
disk) fails in :meth:`Metrics.record` and leaves at most a torn last line, which readers skip; that
failure, like one of the loss plot, of TensorBoard's events or of the log lines on a full disk, ends
the run with one paragraph naming the file (:func:`.loggers.write_failed`).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import IO, Optional

from ..io import atomic_output, stdout_name
from ..options import LoggingOptions
from ..parallel.state import ParallelState
from .loggers import TRAIN_SCALARS, VALID_SCALARS, write_failed
from .throughput import peak_memory_bytes

__all__ = ["Metrics", "open_metrics", "loss_curves", "read_curves", "plot_loss"]


class Metrics:
    """The log lines and the metrics file of one run (rank 0 writes; every rank may call).

    ``log`` holds the intervals and ``--no-plot``, ``train_iters`` is the run's length; ``flops`` and
    ``hw_flops`` are one iteration's model and executed FLOPs, ``peak`` the per-rank peak TFLOP/s;
    ``path`` the metrics file (``None``: none), trimmed to ``resumed_at``; ``loggers`` the TensorBoard /
    W&B backends (rank 0's: :func:`.loggers.build_loggers`), ``title`` the loss plot's.
    """

    def __init__(self, log: LoggingOptions, ps: ParallelState, *, train_iters: int, flops: float,
                 hw_flops: float, peak: float, tokens_per_iter: int, path: Optional[str], resumed_at: int,
                 loggers: list, title: Optional[str]):
        self.logging, self.ps, self.path, self.train_iters, self.title = log, ps, path, train_iters, title
        self.flops, self.hw_flops, self.peak, self.tokens_per_iter = flops, hw_flops, peak, tokens_per_iter
        self.file: Optional[IO] = None
        self.resumed_at = resumed_at
        if ps.rank == 0 and path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self.file = open_metrics(path, resumed_at)
            except OSError as exc:
                raise self._failed(exc, f"before training (at iteration {resumed_at})") from None
        self.loggers = loggers
        self.started = time.perf_counter()
        self._window = (self.started, 0.0, 0)  # start, summed loss, iterations

    def _failed(self, exc: OSError, when: str, path: Optional[str] = None, what: str = "the metrics file"):
        return write_failed(exc, path or self.path or "", what, when, "--metrics-file")

    def log(self, *msg) -> None:
        if self.ps.rank == 0:
            try:
                print(*msg, flush=True)
            except OSError as exc:  # stdout is a file on a full disk
                raise write_failed(exc, stdout_name(), "the log (standard output)", "while logging",
                                   "standard output") from None

    def record(self, rec: dict, split: str, scalars: tuple = ()) -> None:
        """One record to the metrics file; its ``scalars`` to each backend as ``split/key``."""
        if self.file is not None:
            data = (json.dumps(rec) + "\n").encode()
            try:
                while data:  # an unbuffered file may take part of a write
                    data = data[self.file.write(data):]
            except OSError as exc:
                raise self._failed(exc, f"after iteration {rec['iteration']}") from None
        values = {f"{split}/{k}": rec[k] for k in scalars if rec.get(k) is not None}
        for logger in self.loggers if values else ():
            logger.log(values, step=rec["iteration"])

    def _tflops(self, flops: float, seconds: float) -> float:
        """Per-rank TFLOP/s of ``flops`` done in ``seconds``."""
        return flops / seconds / self.ps.world_size / 1e12

    def iteration(self, iteration: int, consumed: int, loss: float, lr: float, info: dict, seconds: float) -> None:
        """Record one iteration; print the log line when it is due (every ``--log-interval``, the run's first
        and its last)."""
        tflops = self._tflops(self.flops, seconds)
        rec = dict(iteration=iteration, consumed_samples=consumed, loss=loss, lr=lr, grad_norm=info["grad_norm"],
                   skipped=info["skipped"], ms_per_iter=seconds * 1e3, tokens_per_s=self.tokens_per_iter / seconds,
                   tflops=tflops, mfu=tflops / self.peak, hfu=self._tflops(self.hw_flops, seconds) / self.peak,
                   peak_tflops=self.peak, peak_memory_bytes=peak_memory_bytes(self.ps.device))
        if info.get("loss_scale") is not None:
            rec["loss_scale"] = info["loss_scale"]
        if info.get("counted_tokens") is not None:  # (--calculate-per-token-loss: the loss's denominator)
            rec["counted_tokens"] = info["counted_tokens"]
        aux = info.get("aux") or {}  # a mixture of experts' losses (in ``loss`` already), apart
        rec.update(aux)
        first = iteration == self.resumed_at + 1
        if first and self.resumed_at > 0:
            rec["resumed_from"] = self.resumed_at
        self.record(rec, "train", TRAIN_SCALARS if iteration % self.logging.tensorboard_log_interval == 0 else ())
        start, summed, n = self._window
        summed, n = summed + loss, n + 1
        self._window = (start, summed, n)
        if iteration % self.logging.log_interval and iteration != self.train_iters and not first:
            return
        now = time.perf_counter()
        span = now - start
        mfu = self._tflops(self.flops * n, span) / self.peak
        hfu = self._tflops(self.hw_flops * n, span) / self.peak
        self.log(f"iter {iteration:6d}/{self.train_iters} | samples {consumed:8d} | lr {lr:.3e} | "
                 f"loss {'' if n == 1 else f'(mean of {n}) '}{summed / n:.4f}"
                 + "".join(f" ({name} {value:.4f}, this iter)" for name, value in aux.items())
                 + f" | grad norm {'' if n == 1 else '(this iter) '}{info['grad_norm']:.3f} | "
                 f"{span / n * 1e3:7.1f} ms/iter | {self.tokens_per_iter * n / span:8.0f} tok/s | "
                 f"{self._tflops(self.flops * n, span):.3f} model TFLOP/s/rank | MFU {mfu:.1%}"
                 + (f" HFU {hfu:.1%}" if self.hw_flops != self.flops else "")
                 + f" of {self.peak:.3f} | mem {rec['peak_memory_bytes'] / 2**20:.0f} MiB | elapsed "
                 + f"{_clock(now - self.started)} | ETA {_clock(span / n * (self.train_iters - iteration))}"
                 + (" | skipped (overflow)" if info["skipped"] else ""))
        self._window = (time.perf_counter(), 0.0, 0)

    def validation(self, iteration: int, loss: Optional[float]) -> Optional[float]:
        """Print and record one validation loss (the one place a validation loss is formatted)."""
        if loss is None:
            return None
        ppl = math.exp(min(20, loss))
        when = "before training" if iteration == 0 else f"at iteration {iteration}"
        self.log(f"validation {when}: loss {loss:.4f} | ppl {ppl:.2f}")
        self.record(dict(split="valid", iteration=iteration, loss=loss, ppl=ppl), "valid", VALID_SCALARS)
        return loss

    def close(self) -> None:
        """Close the backends and the metrics file, and draw the loss curve next to it (``--no-plot``: no
        curve)."""
        for logger in self.loggers:
            logger.close()
        self.loggers = []
        if self.file is None:
            return
        self.file.close()
        self.file = None
        if self.logging.plot and self.path is not None:  # (the file is the path's)
            try:
                plot_loss(self.path, title=self.title)
            except OSError as exc:
                raise self._failed(exc, "at its end, after the metrics file was complete",
                                   os.path.splitext(self.path)[0] + "_loss.png", "the loss curve") from None


def _clock(seconds: float) -> str:
    """``H:MM:SS`` (days as hours)."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def open_metrics(path: str, resumed_at: int) -> IO:
    """The metrics file, opened for appending bytes, unbuffered. A run from scratch starts it afresh; a
    resumed run first drops the records past the iteration it resumed from (an interrupted run's last
    iterations are trained again), so every iteration appears once and in order. The old file is replaced
    atomically."""
    if resumed_at <= 0 or not os.path.exists(path):
        return open(path, "wb", buffering=0)
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
    return open(path, "ab", buffering=0)


def loss_curves(metrics_path: str) -> tuple[list, list]:
    """``(iteration, loss)`` points of training and validation, in iteration order, one per iteration
    (a repeated iteration keeps its last record): no line of the plot runs backwards."""
    curves = read_curves(metrics_path)
    return curves["train"], curves["valid"]


def read_curves(metrics_path: str) -> dict:
    """What the plot draws, from a metrics file: ``(iteration, value)`` points of the training loss
    (``train``), the validation loss (``valid``) and the learning rate (``lr``), each in iteration order
    with one point per iteration (a repeated iteration keeps its last record), and the iterations that
    runs resumed from (``resumed``)."""
    points: dict = {"train": {}, "valid": {}, "lr": {}}
    resumed = set()
    with open(metrics_path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # a torn last line of a killed run
                continue
            if r.get("loss") is not None:
                points["valid" if r.get("split") == "valid" else "train"][r["iteration"]] = r["loss"]
            if r.get("lr") is not None:
                points["lr"][r["iteration"]] = r["lr"]
            if r.get("resumed_from"):
                resumed.add(r["resumed_from"])
    return {**{k: sorted(v.items()) for k, v in points.items()}, "resumed": sorted(resumed)}


def plot_loss(metrics_path: str, title: Optional[str] = None) -> None:
    """The loss curves (training and validation) above the learning rate, with a dashed line where a run
    resumed, titled ``title`` (default: the name of the metrics file's folder, the run's), next to the
    metrics file (``X.jsonl`` -> ``X_loss.png``), written atomically."""
    from ..data.paths import matplotlib_in_cache_dir
    matplotlib_in_cache_dir()  # its font cache under tnlg's cache folder, not ~/.cache/matplotlib
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = read_curves(metrics_path)
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1))
    if curves["train"]:
        ax.plot(*zip(*curves["train"]), label="train", lw=1)
    if curves["valid"]:
        ax.plot(*zip(*curves["valid"]), "o-", label="validation")
    if curves["lr"]:
        ax_lr.plot(*zip(*curves["lr"]), color="tab:green", lw=1)
    for i, it in enumerate(curves["resumed"]):
        for a in (ax, ax_lr):
            a.axvline(it, color="grey", ls="--", lw=0.8, label="resumed" if a is ax and i == 0 else None)
    ax.set_title(title or os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))
    ax.set_ylabel("loss (nats/token)")
    ax_lr.set_xlabel("iteration")
    ax_lr.set_ylabel("learning rate")
    for a in (ax, ax_lr):
        a.grid(alpha=0.3)
    ax.legend()
    out = os.path.splitext(metrics_path)[0] + "_loss.png"
    with atomic_output(out, "wb") as f:
        fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"loss curve: {out}", flush=True)
