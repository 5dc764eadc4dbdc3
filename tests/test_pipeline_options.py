"""Bad pipeline options: one clear paragraph naming the value and what is valid, from the option checks,
before any process starts (``resolve`` is what ``tnlg pretrain`` runs before launching)."""

from __future__ import annotations

import argparse

import pytest

from tnlg.errors import UserError
from tnlg.train_args import add_arguments, resolve

# a run --pp accepts (it may validate and sample too: the first test)
RUNNABLE = ["--eval-interval", "0", "--sample-prompt", "", "--tp", "1"]


def _resolve(argv: list, world: int = 4):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(RUNNABLE + argv), world_size=world)


def test_a_runnable_pipeline_layout_resolves():
    o = _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8"])
    assert (o.pipeline_model_parallel_size, o.pipeline_schedule) == (2, "1f1b")
    o = _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "10",
                  "--sample-prompt", "ROMEO:"])  # validation and the sample
    assert (o.eval_interval, o.sample_prompt) == (10, "ROMEO:")
    o = _resolve(["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2",
                  "--global-batch-size", "16", "--micro-batch-size", "2"])
    assert o.pipeline_schedule == "interleaved"  # a virtual-stage size selects it, as Megatron's
    for argv in (["--zero-stage", "3"], ["--bf16"]):  # FSDP2's ZeRO 2/3 and 16 bits run with a pipeline
        _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8"] + argv)
    o = _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--compile"])
    assert o.compile and o.pipeline_model_parallel_size == 2  # compiled stage blocks


@pytest.mark.parametrize("argv,world,match", [
    (["--pp", "3"], 4, r"--pipeline-model-parallel-size 3 does not divide the 4 processes / TP 1 = 4; valid "
                       r"pipeline sizes at --tp 1 on 4 processes: \[1, 2, 4\]"),
    (["--pp", "4", "--num-layers", "2"], 4, r"--pipeline-model-parallel-size 4 is more stages than the model's 2 "
                                            r"layers; .* valid sizes are 1 to 2"),
    (["--pp", "4", "--global-batch-size", "2", "--micro-batch-size", "1"], 4,
     r"2 micro batch\(es\) per step .* fewer than the 4 pipeline stages; .* --global-batch-size 4 or more"),
    (["--pp", "2", "--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2"], 4,
     r"--num-layers-per-virtual-pipeline-stage 2 does not divide the 3 layers per stage .* valid: \[1, 3\]"),
    (["--pp", "2", "--decoder-first-pipeline-num-layers", "4"], 4, r"every pipeline stage needs at least one"),
    (["--pipeline-schedule", "gpipe"], 4, r"--pipeline-schedule gpipe needs --pipeline-model-parallel-size > 1"),
])
def test_bad_pipeline_options_are_one_paragraph_naming_the_value_and_what_is_valid(argv, world, match):
    with pytest.raises(UserError, match=match):
        _resolve(argv, world)


def test_deepspeed_with_a_pipeline_is_refused_naming_deepspeeds_own_pipeline_engine():
    # (without DeepSpeed installed, resolve stops earlier on the missing package: check the pipeline rule itself)
    from tnlg.options.pipeline import check_pipeline
    o = _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8"])
    o.zero_impl = "deepspeed"
    with pytest.raises(UserError, match=r"--zero-impl deepspeed \(DeepSpeed pipelines with its own engine, .* "
                                        r"--zero-impl tnlg\) is not supported with --pipeline-model-parallel-size"):
        check_pipeline(o, 4)
