"""Random-number-generator states of one rank, as tensors and plain numbers (``weights_only``-safe).

Saved per rank: Python's ``random``, NumPy's global generator, torch's CPU
generator, every CUDA device's generator when CUDA is in use, and the model's
per-TP-rank dropout generator (:class:`tnlg.parallel.random.TPRandom`).

Restoring (see :func:`restore`): with the same (TP, DP) layout each rank gets
its own states back, so a resumed run draws exactly the numbers the
uninterrupted one would have. With another layout, the shared streams come from
rank (dp 0, tp 0) (they are identical on every rank by construction: every rank
seeds them alike and consumes them alike), the per-TP-rank dropout streams are
taken from the saved TP ranks when the TP size is unchanged, and otherwise are
reseeded deterministically from ``(seed + iteration, tp_rank)``. With pipeline stages the shared
streams are alike only within a stage (each stage's dropout draws its own): they come from the
saved stage of the same pipeline rank when it held the same layers, else from the first stage's
(``tnlg.checkpoint.loading._rng_plan``).
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["capture", "restore"]


def capture(tp_random=None) -> dict:
    """This process's RNG states (plus ``tp_random``'s) as a dict of tensors, numbers and strings."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = dict(python=dict(version=int(version), state=torch.tensor(internal, dtype=torch.int64),
                           gauss=gauss),
               numpy=dict(kind=str(kind), keys=torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                          pos=int(pos), has_gauss=int(has_gauss), cached=float(cached)),
               torch=torch.get_rng_state(), cuda=None, tp=None, tp_device=None)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    if tp_random is not None:
        out["tp"] = tp_random.state.clone()
        out["tp_device"] = tp_random.device.type
    return out


def restore(states: dict, tp_random=None, shared: bool = True) -> bool:
    """Set this process's generators from :func:`capture`'s dict: the shared streams (Python,
    NumPy, torch CPU and CUDA) when ``shared``, and the dropout stream of ``tp_random`` when
    given and saved on the same device type. Returns whether the dropout stream was set.
    """
    if shared:
        _restore_shared(states)
    if tp_random is not None and states.get("tp") is not None and states.get("tp_device") == tp_random.device.type:
        tp_random.state = states["tp"].clone()
        return True
    return False


def _restore_shared(states: dict) -> None:
    py = states["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npst = states["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached"]))
    torch.set_rng_state(states["torch"])
    if states.get("cuda") and torch.cuda.is_available():
        for i, s in enumerate(states["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
