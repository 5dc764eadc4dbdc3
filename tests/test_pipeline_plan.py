"""``tnlg plan --pp``: per-stage parameters against the stage modules tnlg builds, the bubble and the
micro batches in flight of 1F1B by hand."""

from __future__ import annotations

import argparse

import pytest
import torch

from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.parallel.pipeline import StageModel, chunk_layers
from tnlg.parallel.state import ParallelState
from tnlg.plan.command import add_arguments, run
from tnlg.plan.counts import parameter_counts
from tnlg.plan.pipeline import bubble_fraction, pipeline_plan


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1_divided_by_the_virtual_stages():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 22)
    assert bubble_fraction(1, 8) == 0.0


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 3), (4, 4)])
def test_stage_parameters_are_those_of_the_stage_modules_and_add_up_to_the_model(tp, pp):
    cfg = GPTConfig(num_layers=7, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=300)
    plan = pipeline_plan(cfg, tp, pp, dp=2, zero_stage=1, precision="fp16", micro_batch=1, micro_batches=8)
    chunks = chunk_layers(7, pp)
    for i, stage in enumerate(plan["stages"]):
        ps = ParallelState(tp_rank=0, tp_size=tp, pp_rank=i, pp_size=pp, device=torch.device("meta"), virtual=True)
        built = StageModel(cfg, ps, [chunks[i]], device="meta")
        assert stage["params"] == sum(p.numel() for p in built.parameters())
        assert stage["in_flight"] == pp - i  # 1F1B: stage i holds P - i micro batches (m = 8 >= P)
    whole = parameter_counts(cfg, tp)["per_rank"][0]["params"]
    wte = cfg.padded_vocab_size(tp) // tp * cfg.hidden_size  # the last stage's copy of the tied embedding
    assert sum(s["params"] for s in plan["stages"]) == whole + wte


def _plan(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args(argv))


def test_plan_with_pp_prints_a_row_per_stage_and_refuses_what_it_does_not_cover(capsys):
    assert _plan(["--preset", "gpt2-small", "--pp", "4", "--dp", "2", "--global-batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "bubble 27.3% of each step" in out  # (4 - 1) / (8 + 4 - 1)
    assert out.count(" GiB (") == 4
    with pytest.raises(UserError, match="does not take --world-size"):
        _plan(["--preset", "gpt2-small", "--pp", "4", "--world-size", "8"])
    with pytest.raises(UserError, match="1 micro batch.* fewer than the 4 pipeline stages"):
        _plan(["--preset", "gpt2-small", "--pp", "4", "--dp", "2", "--global-batch-size", "2"])
