"""--use-checkpoint-args: a resumed run takes what the run is from the options its checkpoint recorded.

The options resolved against a hand-written checkpoint (a meta.json with recorded options) show the
precedence: defaults < the checkpoint < flags, each override of a recorded value reported; a real
resume on 2 gloo processes with nothing but --save, --use-checkpoint-args and a longer --train-iters
continues exactly as a run that was never stopped.
"""

from __future__ import annotations

import json
import os

import pytest

from tnlg.cli import build_parser, main
from tnlg.errors import UserError
from tnlg.options.recorded import describe
from tnlg.runtime.spawn import run_tnlg
from tnlg.commands.pretrain_args import resolve


def _resolved(argv, world=2):
    return resolve(build_parser(only="pretrain").parse_args(["pretrain", *argv]), world_size=world)


def _checkpoint(root, **options):
    """A checkpoint root whose latest iteration records ``options`` (written here, by hand)."""
    d = root / "iter_0000010"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"format": "tnlg.checkpoint/2", "iteration": 10, "options": options}))
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return d


@pytest.fixture
def recorded(tmp_path, corpus):
    """A run on the built-in corpus's files with a non-default shape, schedule, layout and intervals."""
    prefix, tok = corpus
    return dict(num_layers=3, hidden_size=48, num_attention_heads=6, seq_length=32, micro_batch_size=2,
                global_batch_size=8, train_iters=40, lr=3e-4, min_lr=3e-5, lr_decay_style="cosine",
                lr_warmup_iters=4, adam_beta2=0.95, tensor_model_parallel_size=2, zero_stage=0,
                data_path=[prefix], tokenizer_model=tok, split="90,9,1", seed=7, bf16=True, log_interval=5,
                eval_interval=20, save_interval=10, builtin_job=False, nproc_per_node=8, device="cpu",
                save="/elsewhere", peak_tflops=3.0)


@pytest.fixture
def corpus():
    from tnlg.data.corpus import default_dataset
    return default_dataset()


def test_the_recorded_options_apply_and_flags_override_them(tmp_path, recorded):
    """Model, data, tokenizer, layout, schedule, precision and intervals come from the checkpoint; a flag
    given wins and is reported with the recorded value; where this launch writes and runs is its own."""
    iter_dir = _checkpoint(tmp_path / "ckpt", **recorded)
    o = _resolved(["--save", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--train-iters", "80", "--lr",
                   "3e-4"])
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "global_batch_size", "min_lr", "lr_decay_style", "lr_warmup_iters", "adam_beta2",
                 "tensor_model_parallel_size", "zero_stage", "data_path", "tokenizer_model", "split", "seed",
                 "bf16", "log_interval", "eval_interval", "save_interval"):
        assert o.flat()[name] == recorded[name], name
    assert o.schedule.train_iters == 80 and o.schedule.lr == 3e-4
    assert o.checkpoint.save == str(tmp_path / "ckpt") and o.parallel.nproc_per_node is None \
        and o.precision.device is None
    assert o.logging.peak_tflops is None and not o.builtin_job
    assert describe(o.checkpoint_args) == [
        f"note: --use-checkpoint-args: {len(o.checkpoint_args['taken'])} options (model, data, tokenizer, layout, "
        f"schedule, precision, intervals) from {iter_dir}",
        "note: --train-iters 80 given, overriding the checkpoint's --train-iters 40"]  # --lr 3e-4 is no override


def test_load_names_the_checkpoint_and_exclusive_flags_replace_the_record(tmp_path, recorded):
    """--load (a root or an iteration folder) is read before --save; --fp16 or --recompute-granularity given
    replace the record's bf16 / recompute flags instead of contradicting them."""
    iter_dir = _checkpoint(tmp_path / "ckpt", **recorded, recompute_activations=True, recompute_granularity="full")
    o = _resolved(["--load", str(iter_dir), "--save", str(tmp_path / "new"), "--use-checkpoint-args",
                   "--recompute-granularity", "selective", "--data-path", recorded["data_path"][0]])
    assert o.checkpoint_args["path"] == str(iter_dir) and o.model.hidden_size == 48
    assert o.precision.recompute_granularity == "selective" and not o.precision.recompute_activations
    assert o.checkpoint_args["overrides"] == []  # the same --data-path as recorded


def test_the_builtin_jobs_checkpoint_finds_its_corpus_again(tmp_path):
    """A built-in job's checkpoint records the corpus's cache path; the resumed run uses the built-in
    corpus of this machine and the built-in job's defaults, and the recorded schedule."""
    _checkpoint(tmp_path / "run", builtin_job=True, data_path=["/old/cache/corpus"], tokenizer_model="/old/tok",
                train_iters=300, lr=2e-3, hidden_size=64, num_attention_heads=4)
    o = _resolved(["--save", str(tmp_path / "run"), "--use-checkpoint-args", "--train-iters", "400"], world=4)
    assert o.builtin_job and o.data.data_path is None and o.data.tokenizer_model is None
    assert (o.model.hidden_size, o.schedule.lr, o.schedule.train_iters,
            o.logging.sample_prompt) == (64, 2e-3, 400, "ROMEO:")
    assert o.schedule.lr_warmup_iters == 40  # the built-in job's tenth of the schedule, of the new length


@pytest.mark.parametrize("argv,held", [([], "neither --load nor --save is given"),
                                       (["--save", "empty"], "--save 'empty' holds no checkpoint")])
def test_without_a_checkpoint_to_read_it_is_one_clear_error(capsys, monkeypatch, tmp_path, argv, held):
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "--nproc-per-node", "1", "--use-checkpoint-args", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tnlg pretrain: error: --use-checkpoint-args takes the model") and held in err, err
    assert "\n" not in err and os.listdir(tmp_path) == []  # nothing written


def test_a_load_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="--load '.*empty' holds no checkpoint"):
        _resolved(["--load", str(tmp_path / "empty"), "--use-checkpoint-args"])


def _pretrain(argv, cwd):
    return run_tnlg(["pretrain", *argv], cwd)


def _losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r.get("split") != "valid"]


@pytest.mark.slow
def test_resume_with_only_the_save_folder_continues_exactly(tmp_path, corpus):
    """TP 2 on 2 gloo processes, 4 iterations of an 8-iteration schedule; the resume gives only --save,
    --use-checkpoint-args and --train-iters 8 (no data, tokenizer, shape or schedule): it says what it
    took and what was overridden, and its 8 losses are those of a run that was never stopped, bit for
    bit."""
    prefix, tok = corpus
    flags = ["--nproc-per-node", "2", "--tp", "2", "--data-path", prefix, "--tokenizer-model", tok,
             "--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "16",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--lr-decay-iters", "8",
             "--lr-decay-style", "cosine", "--seed", "5", "--log-interval", "1", "--eval-interval", "4",
             "--eval-iters", "1", "--peak-tflops", "1", "--no-plot"]
    _pretrain([*flags, "--train-iters", "4", "--save", "run"], tmp_path)
    out = _pretrain(["--nproc-per-node", "2", "--save", "run", "--use-checkpoint-args", "--train-iters", "8",
                     "--peak-tflops", "1", "--no-plot"], tmp_path)
    assert "note: --use-checkpoint-args: " in out and f"from {os.path.join('run', 'iter_0000004')}" in out
    assert "note: --train-iters 8 given, overriding the checkpoint's --train-iters 4" in out
    assert "resumed from run/iter_0000004 at iteration 4 (" in out, out[-3000:]
    _pretrain([*flags, "--train-iters", "8", "--save", "reference"], tmp_path)
    assert _losses(tmp_path / "run" / "metrics.jsonl") == _losses(tmp_path / "reference" / "metrics.jsonl")


def test_a_converted_checkpoint_gives_its_model_and_tokenizer(tmp_path, corpus):
    """A checkpoint ``tnlg convert`` wrote (from Megatron-LM, with the built-in tokenizer) records no run
    options: --use-checkpoint-args takes its model shape from its architecture record and its tokenizer
    from its tokenizer record, and the resume checks accept the run (they compare that architecture);
    only the data is given."""
    from tests.fresh_checkpoint import fresh_checkpoint
    from tnlg.config import GPTConfig
    from tnlg.data.tokenizer import load_tokenizer
    from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint
    from tnlg.training.checkpointing import check_resume
    prefix, tok = corpus
    tokenizer = load_tokenizer(tok)
    cfg = GPTConfig(num_layers=3, hidden_size=48, num_attention_heads=6, seq_length=32,
                    vocab_size=tokenizer.vocab_size, swiglu=True, normalization="RMSNorm",
                    position_embedding_type="rope", add_bias_linear=False, untie_embeddings_and_output_weights=True)
    src = fresh_checkpoint(str(tmp_path / "trained"), cfg, iteration=5)
    checkpoint_to_megatron(src, str(tmp_path / "megatron"), fmt="torch_dist", tp=1)
    converted = megatron_to_checkpoint(str(tmp_path / "megatron"), str(tmp_path / "converted"), tokenizer=tokenizer)
    o = _resolved(["--load", converted, "--use-checkpoint-args", "--data-path", prefix, "--train-iters", "8"],
                  world=1)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "swiglu", "normalization",
                 "position_embedding_type", "add_bias_linear", "untie_embeddings_and_output_weights"):
        assert o.flat()[name] == getattr(cfg, name), name
    assert o.data.tokenizer_model == "builtin" and len(o.checkpoint_args["taken"]) > 10
    check_resume(o)  # the architecture and tokenizer match: not refused


def test_an_override_of_an_unset_option_reads_as_typed():
    """An option the checkpoint left unset (``None``: its default applies) reads "(not set)" in the override
    note, not ``--lr-decay-iters None`` (which no command line could give)."""
    from tnlg.options.recorded import describe
    lines = describe({"taken": ["lr_decay_iters"], "path": "ckpt/iter_0000004",
                      "overrides": [("--lr-decay-iters", None, 500), ("--data-path", ["a", "b"], None)]})
    assert lines[1] == "note: --lr-decay-iters 500 given, overriding the checkpoint's --lr-decay-iters (not set)"
    assert lines[2] == "note: --data-path (not set) given, overriding the checkpoint's --data-path a b"
    assert "None" not in " ".join(lines)
