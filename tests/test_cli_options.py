"""Typed options (issue 13 item 2): one dataclass field per option; parser, config keys and resume checks
read from the fields; each component validates itself."""

from __future__ import annotations

import argparse
import pickle

import pytest

from tnlg.errors import UserError
from tnlg.options import OPTION_NAMES, ModelOptions, Options, ScheduleOptions
from tnlg.commands.pretrain_args import DEFAULTS, add_arguments, resolve


def _parser():
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


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


def test_options_read_flat_and_by_component_and_survive_pickling():
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
    from tnlg.checkpoint.compat import DATA_OPTIONS
    assert set(DATA_OPTIONS) == {"split", "seed", "eod_mask_loss", "reset_position_ids", "reset_attention_mask"}
