"""Training resumes a converted Megatron checkpoint at its learning-rate schedule's position.

A Megatron checkpoint at iteration N (written by tnlg's exporter from a small model shaped for the
built-in corpus; no optimizer state, so no scheduler state either) is imported without the optimizer
and trained on by ``tnlg pretrain --load``: Adam starts fresh moments, but the LR of the first
resumed step is the schedule's value at N (Megatron's formula, computed here), not warmup's first
value; the checkpoint tnlg saves then records the schedule's position apart from Adam's step count,
so the next resume continues it too. No megatron-core needed.
"""

import json
import math

from tests.tiny import resolve_flags, tiny_flags
from tnlg.checkpoint.files import FORMAT, read_meta
from tnlg.checkpoint.reshard import slice_full, targets_for
from tnlg.checkpoint.saving import write_offline
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint
from tnlg.model import GPT
from tnlg.parallel.sharding import full_state_dict
from tnlg.parallel.state import ParallelState
from .megatron_pool import run_distributed

N, WARMUP, DECAY, MAX_LR, MIN_LR = 6, 2, 10, 3e-3, 3e-4


def _argv(tmp, iters, load=None, save=None):
    """The tiny run's flags on Megatron's cosine schedule; with ``load``, resumed from it into ``save``."""
    return tiny_flags(global_batch_size=2, train_iters=iters, lr=MAX_LR, min_lr=MIN_LR, lr_warmup_iters=WARMUP,
                      lr_decay_iters=DECAY, lr_decay_style="cosine", metrics_file=str(tmp / f"metrics_{iters}.jsonl"),
                      load=load, save=save if load else None)


def _options(argv):
    return resolve_flags(argv, 1)


def _train(ps, o):
    from tnlg.training import train
    return train(o)["losses"]


def _cosine_lr(n):
    """Megatron's cosine schedule after ``n`` optimizer steps (past warmup, before the decay's end)."""
    ratio = (n - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (MAX_LR - MIN_LR)


def _logged_lr(metrics_file):
    with open(metrics_file) as f:
        return {r["iteration"]: r["lr"] for r in map(json.loads, f) if r.get("split") != "valid"}


def _megatron_checkpoint(tmp, o):
    """A Megatron-LM torch_dist checkpoint at iteration N of the run's model shape."""
    from tnlg.data.tokenizer import load_tokenizer
    from tnlg.options import model_config
    cfg = model_config(o, load_tokenizer(o.data.tokenizer_model).vocab_size)
    full = full_state_dict(GPT(cfg), ParallelState.single())
    meta = dict(format=FORMAT, iteration=N, consumed_samples=2 * N, config=cfg.to_dict(), options={}, data=None,
                tokenizer=None, layout=dict(param_dtype="float32"), optimizer=dict(present=False), schedule=None)
    targets = targets_for(GPT.describe(cfg, 1), 0)
    ckpt = write_offline(str(tmp / "tnlg"), meta, 1, lambda r, names: (
        {n: slice_full(full[n], targets[n]) for n in names}, None), layout=GPT.describe(cfg, 1))
    checkpoint_to_megatron(ckpt, str(tmp / "megatron"))
    return str(tmp / "megatron")


def test_resume_after_import_continues_the_lr_schedule_at_the_checkpoints_iteration(tmp_path):
    o = _options(_argv(tmp_path, N + 1))
    imported = megatron_to_checkpoint(_megatron_checkpoint(tmp_path, o), str(tmp_path / "imported"))
    meta = read_meta(imported)
    assert (meta["iteration"], meta["schedule"]["num_steps"], meta["optimizer"]["present"]) == (N, N, False)

    first = _options(_argv(tmp_path, N + 1, imported, tmp_path / "run"))
    run_distributed(_train, 1, 1, first, timeout_s=300)
    lr = _logged_lr(first.logging.metrics_file)
    assert list(lr) == [N + 1]
    assert math.isclose(lr[N + 1], _cosine_lr(N), rel_tol=1e-9), (lr, _cosine_lr(N))
    assert lr[N + 1] > MIN_LR  # not warmup's first value (0)
    saved = read_meta(str(tmp_path / "run" / f"iter_{N + 1:07d}"))
    assert saved["optimizer"]["num_steps"] == 1  # fresh moments: Adam's first step
    assert saved["schedule"]["num_steps"] == N + 1

    second = _options(_argv(tmp_path, N + 2, tmp_path / "run", tmp_path / "run"))
    run_distributed(_train, 1, 1, second, timeout_s=300)
    assert math.isclose(_logged_lr(second.logging.metrics_file)[N + 2], _cosine_lr(N + 1), rel_tol=1e-9)
