"""What ``--load`` may not silently become: random weights.

A fine-tuning run's options are built from its arguments (:func:`tnlg.commands.finetune.options`), which stay as
parsed: no namespace is changed in place, so none can be taken for one already prepared (that once kept a
Hugging Face folder as ``--load`` without ``--finetune`` and trained from random weights with exit 0). And a
folder that holds no tnlg checkpoint was read as an empty root ("start from scratch") even where it is a Hugging
Face folder, or where the run takes only its starting weights from it.
"""

from __future__ import annotations

import json
import os

import pytest

from tnlg.cli import main


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny tnlg checkpoint (with the built-in tokenizer recorded by the run's flag), a row file and a
    Hugging Face folder."""
    from tests.fresh_checkpoint import fresh_checkpoint
    from tnlg.config import GPTConfig
    tmp = tmp_path_factory.mktemp("ftload")
    cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=32, vocab_size=4096)
    fresh_checkpoint(str(tmp / "ckpt"), cfg)
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=f"Q{i}", completion=f" A{i}")) + "\n" for i in range(4)))
    hf = tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_layer=1, n_embd=16, n_head=2)))
    return tmp


def test_the_options_are_built_from_the_arguments_which_stay_as_parsed(base):
    """The same arguments give the same fine-tuning options every time (--finetune, the checkpoint's shape), and
    the namespace is left as the parser made it."""
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import options
    from tnlg.data.tokenizer import builtin_tokenizer_path
    args = build_parser(only="finetune").parse_args(
        ["finetune", "--load", str(base / "ckpt"), "--sft-data-path", str(base / "rows.jsonl"), "--train-iters", "3",
         "--tokenizer-model", builtin_tokenizer_path(), "--save", str(base / "run")])
    parsed = dict(vars(args))
    first, second = options(args), options(args)
    assert vars(args) == parsed
    assert first.checkpoint.finetune and first.model.hidden_size == 16 and first.checkpoint.load == str(base / "ckpt")
    assert first.flat() == second.flat()


def test_pretrain_refuses_a_hugging_face_folder_as_load(base, capsys, tmp_path):
    status = main(["pretrain", "--nproc-per-node", "1", "--load", str(base / "hf"), "--train-iters", "1",
                   "--save", str(tmp_path / "s"), "--no-plot"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert f"--load {str(base / 'hf')!r} is a Hugging Face model folder" in err and "tnlg finetune --load" in err
    assert not (tmp_path / "s").exists()


def test_a_fine_tuning_run_whose_load_holds_no_checkpoint_is_refused(base, tmp_path):
    """The options of a fine-tuning run (weights only from --load) whose --load folder is empty: refused by the
    launcher's checks and by the load itself, never a start from scratch."""
    from tests.tiny import tiny_options
    from tnlg.errors import UserError
    from tnlg.parallel.state import ParallelState
    from tnlg.training.checkpointing import check_resume
    empty = tmp_path / "empty"
    empty.mkdir()
    o = tiny_options(1, load=str(empty), finetune=True, save=str(tmp_path / "s"), train_iters=1)
    with pytest.raises(UserError, match="holds no checkpoint .* would train from random weights"):
        check_resume(o)
    from tnlg.checkpoint import load
    with pytest.raises(UserError, match="would train from random weights"):
        load(str(empty), model=None, engine=None, ps=ParallelState.single(), config=None, weights_only=True)


@pytest.mark.parametrize("tracker", [True, False], ids=["with-tracker", "without-tracker"])
@pytest.mark.parametrize("files", [("mp_rank_00", "model_optim_rng.pt"), (".metadata",)], ids=["legacy", "torch_dist"])
def test_pretrain_names_a_megatron_checkpoint_given_as_load(tmp_path, capsys, tracker, files):
    root = tmp_path / "megatron"
    megatron_file = root / "iter_0000005" / os.path.join(*files)
    megatron_file.parent.mkdir(parents=True)
    megatron_file.write_bytes(b"x")
    if tracker:
        (root / "latest_checkpointed_iteration.txt").write_text("5")
    status = main(["pretrain", "--nproc-per-node", "1", "--load", str(root), "--train-iters", "1", "--no-plot",
                   "--save", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert status == 2 and f"--load {str(root)!r} is a Megatron-LM checkpoint" in err, err
    assert "tnlg convert --from megatron" in err and not (tmp_path / "s").exists()
