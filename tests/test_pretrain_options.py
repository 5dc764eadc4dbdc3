"""How ``tnlg pretrain`` resolves its options: one typed dataclass field per option (parser, config keys and
resume checks read from the fields, each component validates itself); defaults, Megatron-LM's for a user's
run and tuned ones for the built-in job; precedence of preset, config file and flags; what --help says of
them; the device and the process count a run picks."""

from __future__ import annotations

import argparse
import pickle

import pytest
import torch

from tests.tiny import resolve_flags
from tnlg.cli import main
from tnlg.errors import UserError
from tnlg.options import OPTION_NAMES, ModelOptions, Options, ScheduleOptions
from tnlg.commands.pretrain_args import DEFAULTS, add_arguments, resolve


def _parser():
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


@pytest.fixture(scope="module")
def corpus():
    from tnlg.data.corpus import default_dataset
    return default_dataset()


def test_every_option_is_one_field_with_one_flag():
    dests = {a.dest for a in _parser()._actions if a.option_strings} - {"help"}
    assert set(DEFAULTS) == set(OPTION_NAMES) | {"preset", "config"}
    assert dests == set(DEFAULTS) - {"bucket_size_mb"}  # the bucket size: a config-file key only
    assert len(OPTION_NAMES) == len(set(OPTION_NAMES))  # no option in two components


def test_components_validate_themselves():
    with pytest.raises(UserError, match="--num-layers must be a positive integer, got 0"):
        ModelOptions(num_layers=0)
    with pytest.raises(UserError, match="--train-iters is required"):
        ScheduleOptions()
    with pytest.raises(UserError, match="--min-lr must be between 0 and --lr"):
        ScheduleOptions(train_iters=10, lr=1e-3, min_lr=1e-2)


def test_options_read_by_component_flatten_by_name_and_survive_pickling():
    o = resolve(_parser().parse_args(["--lr", "0.001", "--tp", "1"]), world_size=2)
    assert isinstance(o, Options) and o.schedule.lr == o.flat()["lr"] == 0.001 and o.builtin_job
    o.checkpoint.save = "somewhere"  # the command sets the built-in job's folder after resolving
    assert o.flat()["save"] == "somewhere"
    back = pickle.loads(pickle.dumps(o))  # options travel to spawned workers
    assert back.flat() == o.flat()
    with pytest.raises(AttributeError):
        o.lr = 1.0  # an option by its bare name is refused: o.schedule holds it


def test_config_file_keys_are_the_fields(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('bucket-size-mb = 5.0\nhidden_size = 64\n')
    o = resolve(argparse.Namespace(config=str(f)), world_size=4)
    assert o.parallel.bucket_size_mb == 5.0 and o.model.hidden_size == 64
    f.write_text("hidden = 64\n")
    with pytest.raises(UserError, match=r"unknown key 'hidden'; did you mean hidden_size\? Valid keys: .*ffn_hidden"):
        resolve(argparse.Namespace(config=str(f)), world_size=4)


def test_resume_check_reads_the_data_defining_fields():
    from tnlg.options import MUST_MATCH
    assert set(MUST_MATCH) == {"split", "seed", "eod_mask_loss", "reset_position_ids", "reset_attention_mask",
                               "sft_data_path", "sft_valid_data_path", "packing", "sft_loss_on_prompt",
                               "seq_length"}  # (the samples' length; the model's positions are architecture)


def test_config_file_and_flag_precedence(tmp_path):
    """Preset < config file < flags; a recipe (tnlg-17b) brings its schedule and batch."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('num-layers = 3\nlr = 0.01\npreset = "gpt2-small"\ntrain-iters = 10\n')
    o = resolve(argparse.Namespace(config=str(cfg), lr=0.02), world_size=4)
    assert (o.model.num_layers, o.schedule.lr, o.model.hidden_size) == (3, 0.02, 768)   # preset < file < flags
    o = resolve(argparse.Namespace(preset="tnlg-17b", fp16=False, bf16=True), world_size=256)
    assert (o.schedule.lr, o.schedule.lr_warmup_iters, o.schedule.lr_decay_iters, o.schedule.global_batch_size,
            o.model.num_attention_heads) == \
        (1.5e-4, 3200, 500_000, 512, 28)
    if not torch.cuda.is_available():  # the recipe's fp16 is refused before any work on a CPU
        with pytest.raises(UserError, match="--fp16 needs a GPU"):
            resolve(argparse.Namespace(preset="tnlg-17b"), world_size=256)


def test_user_run_gets_megatron_defaults_not_the_builtin_jobs(corpus):
    """A run on the user's data gets Megatron-LM's defaults, not the built-in job's tuned ones: ``--data-path D
    --tokenizer-model M --train-iters 2`` used to stop on "--lr-warmup-iters (30) must be smaller than
    --lr-decay-iters (2)", a flag the user never set."""
    o = resolve_flags(["--data-path", corpus[0], "--tokenizer-model", corpus[1], "--train-iters", "2"], 4)
    assert (o.schedule.lr_warmup_iters, o.schedule.lr_decay_iters, o.schedule.min_lr,
            o.schedule.lr_decay_style) == (0, None, 0.0, "linear")
    assert (o.model.hidden_dropout, o.model.attention_dropout, o.schedule.adam_beta2) == (0.1, 0.1, 0.999)
    assert (o.parallel.tensor_model_parallel_size, o.schedule.micro_batch_size,
            o.schedule.global_batch_size) == (1, 8, 32)  # micro x DP
    assert (o.logging.sample_prompt, o.logging.eval_interval, o.logging.eval_iters,
            o.logging.log_interval) == ("", 1000, 100, 100)
    assert o.builtin_job is False
    # a user's --lr below the built-in job's --min-lr, a global batch without a micro batch: both fine
    o = resolve_flags(["--data-path", corpus[0], "--tokenizer-model", corpus[1], "--train-iters", "2",
                   "--lr", "1e-4", "--global-batch-size", "4"], 4)
    assert (o.schedule.min_lr, o.schedule.micro_batch_size, o.schedule.global_batch_size) == (0.0, 1, 4)
    # a preset run is a user's run too
    o = resolve_flags(["--preset", "tiny", "--train-iters", "5"], 2)
    assert (o.schedule.lr_warmup_iters, o.model.hidden_dropout, o.parallel.tensor_model_parallel_size) == (0, 0.1, 1)


def test_train_iters_is_required_outside_the_builtin_job(corpus):
    """The built-in job's 300 iterations are not a default for a user's data."""
    with pytest.raises(UserError, match="--train-iters is required"):
        resolve_flags(["--data-path", corpus[0], "--tokenizer-model", corpus[1]], 4)


def test_builtin_job_defaults_unchanged_and_scaled_by_the_users_flags():
    """The built-in job keeps its tuned values; those that depend on a flag the user sets follow it instead
    of contradicting it."""
    o = resolve_flags([], 4)
    assert o.builtin_job is True
    assert (o.schedule.train_iters, o.schedule.lr, o.schedule.min_lr, o.schedule.lr_warmup_iters,
            o.schedule.lr_decay_style, o.schedule.adam_beta2) == \
        (300, 2e-3, 2e-4, 30, "cosine", 0.95)
    assert (o.parallel.tensor_model_parallel_size, o.schedule.micro_batch_size,
            o.schedule.global_batch_size) == (2, 8, 16)
    assert (o.model.hidden_dropout, o.logging.eval_interval, o.logging.eval_iters,
            o.logging.sample_prompt) == (0.0, 100, 4, "ROMEO:")
    o = resolve_flags(["--train-iters", "2"], 4)  # was: warmup 30 >= decay 2
    assert (o.schedule.lr_warmup_iters, o.schedule.lr_decay_iters) == (0, None)
    o = resolve_flags(["--lr", "1e-4"], 4)  # was: --min-lr 2e-4 above --lr
    assert o.schedule.min_lr == pytest.approx(1e-5)
    o = resolve_flags(["--nproc-per-node", "1"], 1)  # was: TP 2 does not divide 1 process
    assert (o.parallel.tensor_model_parallel_size, o.schedule.global_batch_size,
            o.schedule.micro_batch_size) == (1, 16, 8)
    o = resolve_flags(["--nproc-per-node", "8"], 8)  # was: 16 not divisible by micro 8 x DP 4
    assert (o.parallel.tensor_model_parallel_size, o.schedule.global_batch_size,
            o.schedule.micro_batch_size) == (2, 16, 4)
    o = resolve_flags(["--train-iters", "1000", "--lr-decay-iters", "500"], 4)
    assert o.schedule.lr_warmup_iters == 50


def test_help_says_which_defaults_belong_to_the_builtin_job(capsys):
    """--help documents the built-in job's own defaults beside Megatron-LM's."""
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "apply to it only" in out and "Megatron-LM's defaults" in out
    assert "(default 0.0006; built-in job 0.002)" in out
    assert "(default 0; built-in job a tenth of the schedule, 30)" in out
    assert "(default none: required; built-in job 300)" in out


def test_help_states_mfu_formula(capsys):
    """--help states the model-FLOPs formula behind the logged MFU."""
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = capsys.readouterr().out
    assert "MFU" in out and "72 B s l h^2" in out


def test_one_process_uses_the_gpu_when_present(monkeypatch):
    """One process (no launcher, or torchrun with one process) picks CUDA when it is present (availability
    faked); --device cpu overrides; without a GPU it stays on the CPU."""
    from tnlg.parallel.state import init_parallel, pick_device
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: set_to.append(i))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device(None).type == "cuda" and pick_device("cpu").type == "cpu"
    assert init_parallel(1).device == torch.device("cuda", 0) and set_to == [0]
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert init_parallel(1).device == torch.device("cuda", 0)
    assert init_parallel(1, device="cpu").device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert init_parallel(1).device == torch.device("cpu")


def test_default_process_count_is_one_per_gpu(monkeypatch):
    """Without a launcher or --nproc-per-node, a machine with one GPU trains in one process on it (not 4
    processes on one device); on CPUs the default stays 4."""
    from tnlg.commands.pretrain import default_nproc
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_nproc() == 1 and default_nproc("cpu") == 4
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert default_nproc() == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_nproc() == 4


def test_help_and_readme_say_which_presets_run_the_builtin_job(capsys):
    """--preset llama-tiny without --data-path runs the built-in job (its tuned values), another preset does not;
    --help and the README say exactly that (they used to say "neither --data-path nor --preset")."""
    import pathlib
    assert resolve_flags(["--preset", "llama-tiny"], 4).builtin_job is True
    assert resolve_flags(["--preset", "tiny", "--train-iters", "5"], 4).builtin_job is False
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Without --data-path (and without --preset, or with the CPU-sized --preset llama-tiny): the built-in" in out
    assert "neither --data-path nor --preset" not in out
    readme = " ".join((pathlib.Path(__file__).parent.parent / "README.md").read_text().split())
    assert "neither `--data-path` nor `--preset`" not in readme
    assert "without `--data-path` and with no `--preset` or the CPU-sized `--preset llama-tiny`" in readme


def test_help_says_how_the_sample_at_the_end_is_drawn(capsys):
    """The end-of-run sample's top-k and temperature (the values the loop uses) are in --help."""
    from tnlg.options.components import SAMPLE_TEMPERATURE, SAMPLE_TOP_K
    from tnlg.training import loop
    assert (loop.SAMPLE_TOP_K, loop.SAMPLE_TEMPERATURE) == (SAMPLE_TOP_K, SAMPLE_TEMPERATURE) == (40, 0.8)
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "drawn with top-k 40, temperature 0.8 and the run's --seed" in out
