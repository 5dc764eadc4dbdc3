"""What a fine-tuning run starts from (``--finetune``): a checkpoint's weights and nothing else of its run.

A bf16 ZeRO-1 run over two ranks saves its fp32 master weights, Adam moments, step count and RNG states; a
fine-tuning run loading it must hold exactly those master weights (not the bf16 copies), zero moments, step 0,
at iteration 0 with nothing consumed; and a ``--save`` that already holds the fine-tuning run's own checkpoint
resumes that whole (moments included).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny import tiny_options
from .pool import run_distributed


def _pretrain(ps, o):
    from tnlg.training import train
    return train(o)["losses"]


def _start(ps, o, ckpt_iter_dir):
    """The pieces this rank's engine holds after the checkpointer's start, against the checkpoint's states."""
    from tnlg.checkpoint.files import read_meta
    from tnlg.checkpoint.loading import read_states
    from tnlg.model import GPT
    from tnlg.training.checkpointing import stop_on_signals
    from tnlg.training.loop import Trainer
    t = Trainer(o)
    with stop_on_signals() as stop:
        t._build(stop)
        where = t.checkpointer.resume()
        t.checkpointer.release()
    meta = read_meta(ckpt_iter_dir)
    _, states = read_states(ckpt_iter_dir, meta, GPT.describe(t.config, 1), 0)
    out = dict(where=where, steps=t.engine.num_steps, master_equal=True, moments_zero=True, stored_moments=0.0)
    for pc in t.engine.owned_pieces():
        if pc["length"] == 0:
            continue
        lo, hi = pc["lo"], pc["lo"] + pc["length"]
        want = states[pc["name"]]["master"].reshape(-1)[lo:hi]
        out["master_equal"] &= torch.equal(pc["master"], want)
        out["moments_zero"] &= not pc["exp_avg"].any().item() and not pc["exp_avg_sq"].any().item()
        out["stored_moments"] += states[pc["name"]]["exp_avg"].abs().sum().item()
    return out


@pytest.mark.slow
def test_fine_tuning_starts_from_the_master_weights_only_and_resumes_its_own_checkpoint_whole(tmp_path):
    from tnlg.checkpoint.files import resolve as resolve_iter
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import options as finetune_options
    pre = tmp_path / "pre"
    run_distributed(_pretrain, 2, 1, tiny_options(2, bf16=True, train_iters=2, save=str(pre)), timeout_s=180)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=f"Tell me {i}.", completion=f" It is {i}.")) + "\n"
                            for i in range(8)))

    def options(save):
        args = build_parser(only="finetune").parse_args(
            ["finetune", "--load", str(pre), "--sft-data-path", str(rows), "--train-iters", "1", "--bf16",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--save", str(save), "--eval-interval", "0",
             "--no-plot"])
        return finetune_options(args, world_size=2)

    got = run_distributed(_start, 2, 1, options(tmp_path / "ft"), resolve_iter(str(pre)), timeout_s=180)
    for r in got:
        assert r["where"] == (0, 0) and r["steps"] == 0, r
        assert r["master_equal"] and r["moments_zero"], r
    assert sum(r["stored_moments"] for r in got) > 0  # (the checkpoint had moments to leave behind)
    # the fine-tuning run's own checkpoint, in its --save, is resumed whole
    run_distributed(_pretrain, 2, 1, options(tmp_path / "ft"), timeout_s=180)
    again = run_distributed(_start, 2, 1, options(tmp_path / "ft"), resolve_iter(str(tmp_path / "ft")),
                            timeout_s=180)
    for r in again:
        assert r["where"] == (1, 4) and r["steps"] == 1 and r["master_equal"] and not r["moments_zero"], r
