"""Bad pipeline options: one clear paragraph naming the value and what is valid, from the option checks,
before any process starts (``resolve`` is what ``tnlg pretrain`` runs before launching)."""

from __future__ import annotations

import argparse

import pytest

from tnlg.errors import UserError
from tnlg.commands.pretrain_args import add_arguments, resolve

# a run --pp accepts (it may validate and sample too: the first test)
RUNNABLE = ["--eval-interval", "0", "--sample-prompt", "", "--tp", "1"]


def _resolve(argv: list, world: int = 4):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(RUNNABLE + argv), world_size=world)


def test_a_runnable_pipeline_layout_resolves():
    o = _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8"])
    assert (o.parallel.pipeline_model_parallel_size, o.parallel.pipeline_schedule) == (2, "1f1b")
    o = _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "10",
                  "--sample-prompt", "ROMEO:"])  # validation and the sample
    assert (o.logging.eval_interval, o.logging.sample_prompt) == (10, "ROMEO:")
    o = _resolve(["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2",
                  "--global-batch-size", "16", "--micro-batch-size", "2"])
    assert o.parallel.pipeline_schedule == "interleaved"  # a virtual-stage size selects it, as Megatron's
    for argv in (["--zero-stage", "3"], ["--bf16"]):  # FSDP2's ZeRO 2/3 and 16 bits run with a pipeline
        _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8"] + argv)
    o = _resolve(["--pp", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--compile"])
    assert o.precision.compile and o.parallel.pipeline_model_parallel_size == 2  # compiled stage blocks


@pytest.mark.parametrize("argv,world,match", [
    (["--pp", "3"], 4, r"--pipeline-model-parallel-size 3 does not divide the 4 processes: .* Valid "
                       r"pipeline-parallel sizes at TP 1 on 4 processes: \[1, 2, 4\]"),
    (["--pp", "4", "--num-layers", "2"], 4, r"--pipeline-model-parallel-size 4 is more stages than the model's 2 "
                                            r"layers; .* valid sizes are 1 to 2"),
    (["--pp", "4", "--global-batch-size", "2", "--micro-batch-size", "1"], 4,
     r"2 micro batch\(es\) per step .* fewer than the 4 pipeline stages; .* --global-batch-size 4 or more"),
    (["--pp", "2", "--global-batch-size", "16"], 4,  # the README's fine-tuning recipe at --pp 2: DP 2, micro 8
     r"1 micro batch\(es\) per step .* Give --global-batch-size 32 or more, or keep the global batch 16 with "
     r"--micro-batch-size 4 \(2 micro batches per step and DP rank\)\.$"),
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
    o.parallel.zero_impl = "deepspeed"
    with pytest.raises(UserError, match=r"--zero-impl deepspeed \(DeepSpeed pipelines with its own engine, .* "
                                        r"--zero-impl tnlg\) is not supported with --pipeline-model-parallel-size"):
        check_pipeline(o)


# ------------------------------------------------------------ --use-checkpoint-args with a pipeline's record
def _recorded_pipeline(tmp_path, argv: list) -> str:
    """A checkpoint root whose meta.json records the options of a pipeline run resolved from ``argv`` (the
    record a saving run writes: tnlg.checkpoint's own ``options_record``)."""
    import json
    from tnlg.checkpoint.compat import options_record
    from tnlg.data.corpus import default_dataset
    prefix, tok = default_dataset()
    o = _resolve(["--data-path", prefix, "--tokenizer-model", tok, "--train-iters", "20", "--tp", "2",
                  "--micro-batch-size", "2", "--global-batch-size", "16"] + argv, world=8)
    root = tmp_path / "ckpt"
    (root / "iter_0000010").mkdir(parents=True)
    (root / "iter_0000010" / "meta.json").write_text(json.dumps(dict(format="tnlg.checkpoint/2", iteration=10,
                                                                    options=options_record(o))))
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return str(root)


def _resumed(root: str, argv: list, world: int):
    from tnlg.cli import build_parser
    return resolve(build_parser(only="pretrain").parse_args(["pretrain", "--save", root, "--use-checkpoint-args",
                                                             *argv]), world_size=world)


PIPELINE = ("pipeline_model_parallel_size", "pipeline_schedule", "num_layers_per_virtual_pipeline_stage",
            "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "tensor_model_parallel_size")


@pytest.mark.parametrize("argv,expected", [
    (["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"], (2, "interleaved", 2, None,
                                                                                         None, 2)),
    (["--pp", "2", "--num-layers", "5", "--pipeline-schedule", "gpipe", "--decoder-first-pipeline-num-layers", "1"],
     (2, "gpipe", None, 1, None, 2)),
    (["--pp", "2", "--num-layers", "5", "--decoder-last-pipeline-num-layers", "2"], (2, "1f1b", None, None, 2, 2)),
])
def test_use_checkpoint_args_takes_the_pipeline_layout_from_the_record_as_it_takes_tp(tmp_path, argv, expected):
    root = _recorded_pipeline(tmp_path, argv)
    o = _resumed(root, [], 8)
    assert tuple(o.flat()[n] for n in PIPELINE) == expected
    assert set(PIPELINE) <= set(o.checkpoint_args["taken"]) and o.checkpoint_args["overrides"] == []


def test_use_checkpoint_args_pipeline_flags_given_replace_the_records_as_tp_given_does(tmp_path):
    root = _recorded_pipeline(tmp_path, ["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage",
                                         "2", "--sequence-parallel"])
    o = _resumed(root, ["--pp", "4", "--tp", "1"], 8)  # the record's interleaving kept: 8 layers / 4 / 2 chunks
    assert (o.parallel.pipeline_model_parallel_size, o.parallel.tensor_model_parallel_size,
            o.parallel.pipeline_schedule,
            o.parallel.num_layers_per_virtual_pipeline_stage) == (4, 1, "interleaved", 2)
    assert sorted(f for f, _, _ in o.checkpoint_args["overrides"]) == ["--pipeline-model-parallel-size",
                                                                     "--tensor-model-parallel-size"]
    # --pp 1: no pipeline, so none of the record's pipeline schedule and split (they would be refused at PP 1)
    o = _resumed(root, ["--pp", "1"], 8)
    assert (o.parallel.pipeline_model_parallel_size, o.parallel.pipeline_schedule,
            o.parallel.num_layers_per_virtual_pipeline_stage,
            o.parallel.tensor_model_parallel_size, o.parallel.sequence_parallel) == (1, "1f1b", None, 2, True)
    # a schedule or split given replaces the record's schedule and split together (a recorded virtual-stage
    # size would otherwise turn --pipeline-schedule 1f1b back into interleaving)
    o = _resumed(root, ["--pipeline-schedule", "1f1b"], 8)
    assert (o.parallel.pipeline_model_parallel_size, o.parallel.pipeline_schedule,
            o.parallel.num_layers_per_virtual_pipeline_stage) == (
        2, "1f1b", None)
    o = _resumed(root, ["--num-layers-per-virtual-pipeline-stage", "1"], 8)
    assert (o.parallel.pipeline_schedule, o.parallel.num_layers_per_virtual_pipeline_stage) == ("interleaved", 1)
    # a recorded first-stage size does not refuse the interleaved schedule given (it has equal chunks)
    split = _recorded_pipeline(tmp_path / "split", ["--pp", "2", "--num-layers", "4",
                                                    "--decoder-first-pipeline-num-layers", "1"])
    o = _resumed(split, ["--num-layers-per-virtual-pipeline-stage", "1"], 8)
    assert (o.parallel.pipeline_schedule, o.parallel.num_layers_per_virtual_pipeline_stage,
            o.parallel.decoder_first_pipeline_num_layers) == (
        "interleaved", 1, None)
    interleaved = _recorded_pipeline(tmp_path / "interleaved", ["--pp", "2", "--num-layers", "4",
                                                                "--num-layers-per-virtual-pipeline-stage", "1"])
    o = _resumed(interleaved, ["--decoder-last-pipeline-num-layers", "1"], 8)  # and a split given drops interleaving
    assert (o.parallel.pipeline_schedule, o.parallel.num_layers_per_virtual_pipeline_stage,
            o.parallel.decoder_last_pipeline_num_layers) == (
        "1f1b", None, 1)
    # the recorded values are checked with the given ones, as without the record
    with pytest.raises(UserError, match=r"--num-layers-per-virtual-pipeline-stage 2 does not divide the 2.66667 "
                                        r"layers per stage \(8 layers / --pp 3\)"):
        _resumed(root, ["--pp", "3"], 8)
