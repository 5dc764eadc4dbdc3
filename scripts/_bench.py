"""What every benchmark script shares: the repository on ``sys.path``, machine info, model-shape
options and JSON output.

A script in ``scripts/`` imports this module first (``import _bench``: Python puts the script's
own folder on ``sys.path``), which makes ``import tnlg`` work from a checkout without installing.
Results go to JSON through :func:`write_json` (atomic: a reader never sees half a file) with
:func:`machine_info` recorded beside them, so a number can be traced to the machine, the library
versions and the date it came from. Every benchmark prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# the OpenMP wait settings as the user started the benchmark: `import tnlg` (next line) sets GOMP_SPINCOUNT when
# neither is set, and a benchmark that runs a peer "as it ships" gives it these instead (user_wait_environment)
USER_WAIT_ENV = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

from tnlg.errors import UserError  # noqa: E402
from tnlg.io import atomic_write  # noqa: E402

__all__ = ["ROOT", "USER_WAIT_ENV", "user_wait_environment", "package_version", "cpu_name", "cpu_flags", "machine_info", "write_json", "add_shape_arguments",
           "run", "alternating_times"]


def package_version(package: str) -> Optional[str]:
    """The installed version of ``package``, ``None`` when it is not installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> dict[str, bool]:
    """Whether the CPU has the bf16 matrix instructions that make ``--bf16`` fast on a CPU."""
    text = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return {"avx512_bf16": "avx512_bf16" in text, "amx": "amx_bf16" in text}


def machine_info(**extra: Any) -> dict:
    """Date, Python, torch, the CUDA device (if one is visible), CPU model, cores and bf16 flags,
    updated with ``extra`` (e.g. the script's arguments or other package versions)."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    info = dict(date=datetime.date.today().isoformat(), python=platform.python_version(), torch=torch.__version__,
                cpu=cpu_name(), cpus=os.cpu_count(), gpu=gpu, **cpu_flags())
    info.update(extra)
    return info


def write_json(path: str, record: dict, indent: int = 2, quiet: bool = False) -> None:
    """Write ``record`` to ``path`` atomically (creating its folder); print where unless ``quiet``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(record, indent=indent, default=str))
    if not quiet:
        print(f"wrote {path}")


def add_shape_arguments(p: argparse.ArgumentParser, *, layers: int, hidden: int, heads: int, seq: int,
                        seq_flag: str = "--seq") -> None:
    """The model-shape options every benchmark takes, with this benchmark's defaults."""
    p.add_argument("--layers", type=int, default=layers, help=f"transformer layers (default {layers})")
    p.add_argument("--hidden", type=int, default=hidden, help=f"hidden size (default {hidden})")
    p.add_argument("--heads", type=int, default=heads, help=f"attention heads (default {heads})")
    p.add_argument(seq_flag, type=int, default=seq, help=f"sequence length (default {seq})")


def alternating_times(steps: dict[str, Callable[[int], Any]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each step of ``steps`` (name -> ``step(round)``), the steps alternating within each of ``warmup +
    rounds`` rounds (so a slow moment of the machine hits every kind alike); the warm-up rounds not kept."""
    import time
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(warmup + rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(r)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def user_wait_environment() -> None:
    """Put this process's OpenMP wait variables back as the user started it (processes started after this call
    inherit them): what tnlg's import set is taken out."""
    for name, value in USER_WAIT_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def run(main: Callable[[], int]) -> None:
    """``sys.exit(main())``; a :class:`~tnlg.errors.UserError` (a bad option) is one line on stderr
    and exit status 2, without a traceback."""
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def check_groups(args, default: int) -> None:
    """``--groups`` (key/value groups): only with ``--arch llama`` (``default`` where not given), a positive
    divisor of ``--heads``. Sets ``args.groups``."""
    if args.arch != "llama":
        if args.groups is not None:
            raise UserError(f"--groups {args.groups} is for --arch llama (grouped-query attention); "
                            f"--arch {args.arch} has full multi-head attention.")
        return
    if args.groups is None:
        args.groups = default
    if args.groups < 1 or args.heads % args.groups:
        raise UserError(f"--groups {args.groups} must be a positive divisor of --heads {args.heads} "
                        f"(e.g. --groups {default}).")
