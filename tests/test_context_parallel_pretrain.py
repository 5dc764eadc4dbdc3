"""``tnlg pretrain --context-parallel-size``: the tiny run's losses equal CP 1's (also at CP 2 x PP 2), its checkpoints do not
depend on CP (a CP 2 run resumed at CP 1 and at TP 1 x CP 4 continues CP 1's trajectory), validation
gives CP 1's loss, and the layouts CP cannot run are one paragraph before any process starts."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_options
from tnlg.errors import UserError
from tnlg.runtime.spawn import run_distributed

RUN = dict(train_iters=6, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, hidden_dropout=0.0, attention_dropout=0.0, eval_interval=3,
           eval_iters=1, split="80,20,0", reset_position_ids=True, reset_attention_mask=True)


def _train_body(_ps, o):
    from tnlg.training import train
    out = train(o)
    return out["losses"], out["last_valid_loss"]


def _run(world, tmp=None, **extra):
    o = tiny_options(world, **dict(RUN, **extra))
    if tmp is None:
        o.checkpoint.save = None
    return run_distributed(_train_body, world, 1, o, timeout_s=240)[0]


@pytest.mark.slow
def test_cp_runs_and_resumes_on_cp_1s_trajectory(tmp_path):
    """Dropout 0 (its streams differ per CP layout), documents inside samples (reset positions and masks)."""
    ref, ref_valid = _run(1, hidden_dropout=0.0)
    cp2, cp2_valid = _run(2, context_parallel_size=2, hidden_dropout=0.0)
    torch.testing.assert_close(torch.tensor(cp2), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    assert ref_valid is not None and cp2_valid == pytest.approx(ref_valid, rel=1e-5)
    piped, piped_valid = _run(4, context_parallel_size=2, pipeline_model_parallel_size=2, hidden_dropout=0.0)
    torch.testing.assert_close(torch.tensor(piped), torch.tensor(ref), rtol=1e-5, atol=1e-5)  # CP 2 x PP 2
    assert piped_valid == pytest.approx(ref_valid, rel=1e-5)
    save = str(tmp_path / "cp2")
    first, _ = _run(2, tmp=True, context_parallel_size=2, hidden_dropout=0.0, train_iters=3, save=save,
                    save_interval=3)
    assert first == pytest.approx(ref[:3], rel=1e-5)
    for world, cp in ((1, 1), (4, 4)):
        target = str(tmp_path / f"cp{cp}")
        rest, _ = _run(world, tmp=True, context_parallel_size=cp, hidden_dropout=0.0, load=save, save=target)
        torch.testing.assert_close(torch.tensor(rest), torch.tensor(ref[3:]), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, c=cp: f"resumed at CP {c}: {m}")
    by_cp = run_distributed(_eval_body, 4, 1, save, timeout_s=240)[0]
    assert by_cp[2] == pytest.approx(by_cp[1], rel=1e-6) and by_cp[4] == pytest.approx(by_cp[1], rel=1e-6)
    assert by_cp[(2, 2)] == pytest.approx(by_cp[1], rel=1e-6)  # CP 2 x PP 2


def _eval_body(_ps, ckpt):
    """``tnlg eval --task loss`` of the checkpoint at CP 1 (DP 4), CP 2 (x DP 2), CP 4 and CP 2 x PP 2, with documents."""
    import argparse

    from tests.tiny import tiny_settings
    from tnlg.commands.eval import _precheck, add_arguments, evaluate
    from tnlg.parallel.state import init_parallel
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = {}
    for cp, pp in ((1, 1), (2, 1), (4, 1), (2, 2)):
        ps = init_parallel(1, context_parallel_size=cp, pipeline_parallel_size=pp)
        args = parser.parse_args(["--task", "loss", "--checkpoint", ckpt, "--input", tiny_settings()["data_path"][0],
                                  "--cp", str(cp), "--pp", str(pp), "--eval-samples", "8", "--micro-batch-size", "2",
                                  "--reset-position-ids", "--reset-attention-mask"])
        _precheck(args)
        out[cp if pp == 1 else (cp, pp)] = evaluate(args, ps)["loss"]
    return out


@pytest.mark.parametrize("extra,match", [
    (dict(context_parallel_size=3), r"2 x CP must divide --seq-length 16"),
    (dict(context_parallel_size=2, attention_dropout=0.1), r"does not run with --attention-dropout 0.1"),
], ids=["length", "attention-dropout"])
def test_what_cp_cannot_run_is_one_paragraph(extra, match):
    with pytest.raises(UserError, match=match):
        tiny_options(4, **dict(RUN, **extra)).check(4)


def test_a_cp_that_does_not_divide_the_world_is_refused():
    with pytest.raises(UserError, match=r"--context-parallel-size 4 x --pipeline-model-parallel-size 1 does not "
                                        r"divide the 6 processes"):
        tiny_options(6, **dict(RUN, context_parallel_size=4, tensor_model_parallel_size=1)).check(6)
