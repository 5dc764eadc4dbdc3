"""The tiny training run the tests share: a 2-layer GPT 32 wide with 4 heads over 16 positions, trained on the
built-in corpus with micro batches of 2, a global batch of 4, a log line every iteration, no validation, no
sample, no plot and a nominal 1 TFLOP/s peak.

:func:`tiny_settings` gives it as option values by name, :func:`tiny_options` as resolved options (for a spawned training body), :func:`tiny_flags` as the
flags of ``tnlg pretrain``; both take overrides by option name (``global_batch_size=8``), where ``None``
leaves an option out (``data_path=None``: the built-in job; ``sample_prompt=None``: the run's default).
"""

from __future__ import annotations

import argparse

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
            global_batch_size=4, log_interval=1, eval_interval=0, sample_prompt="", plot=False, peak_tflops=1.0)


def tiny_settings(**overrides) -> dict:
    """The tiny set with the built-in corpus as data, then ``overrides``; options set to None left out."""
    from tnlg.data.corpus import default_dataset
    prefix, tokenizer = default_dataset()
    settings = dict(TINY, data_path=[prefix], tokenizer_model=tokenizer)
    settings.update(overrides)
    return {name: value for name, value in settings.items() if value is not None}


def tiny_options(world_size: int, **overrides):
    """The tiny run's :class:`tnlg.options.Options` for ``world_size`` processes (resolved as ``tnlg
    pretrain`` resolves its flags, so every rule of the command applies)."""
    from tnlg.commands.pretrain_args import resolve
    return resolve(argparse.Namespace(**tiny_settings(**overrides)), world_size=world_size)


def tiny_flags(**overrides) -> list[str]:
    """The tiny run as ``tnlg pretrain`` flags: each option under its first flag name, a switch given only
    where it differs from its default (``plot=False``: ``--no-plot``), a list as several values."""
    from tnlg.commands.pretrain_args import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    flags = []
    for name, value in tiny_settings(**overrides).items():
        action = actions[name]
        if action.nargs == 0:  # a switch (store_true / store_false)
            flags += [action.option_strings[0]] if value == action.const else []
        else:
            flags += [action.option_strings[0], *map(str, value if isinstance(value, list) else [value])]
    return flags


def resolve_flags(argv: list[str], world_size: int):
    """``tnlg pretrain``'s options for the flags ``argv`` on ``world_size`` processes, parsed and resolved as
    the command does."""
    from tnlg.cli import build_parser
    from tnlg.commands.pretrain_args import resolve
    return resolve(build_parser(only="pretrain").parse_args(["pretrain", *argv]), world_size=world_size)
