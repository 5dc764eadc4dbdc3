"""A LoRA fine-tuning run stopped and resumed equals the uninterrupted run bit for bit, and a resume on another base
(other weights, another shape), with other adapter settings, or as the other kind of run is refused in one
paragraph before anything is loaded.

The run: ``tnlg finetune`` of a small Llama (grouped-query attention) with rank-4 adapters on ``q_proj``,
``v_proj`` and ``down_proj``, adapter and hidden dropout on (so the RNG states matter), warm-up and decay of the LR
(the schedule's position matters) and a global batch of 2 of 8 rows (the data position matters). Stopped by
``--exit-interval 2`` after iterations 2 and 4 and resumed each time with the same options, its losses and its
final adapters (``SAVE/adapter``) are the uninterrupted run's exactly.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from .pool import run_distributed
from .sft_reference import ROWS, finetune_options, hf_model

ITERS = 5


def _train(ps, o):
    from tnlg.training import train
    s = train(o)
    return s["losses"], s.get("exited")


def _adapters(save) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(save, "adapter", "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from tnlg.data.tokenizer import builtin_tokenizer_path
    tmp = tmp_path_factory.mktemp("lora-resume")
    hf_model("llama").save_pretrained(tmp / "hf")
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    common = ["--load", str(tmp / "hf"), "--tokenizer-model", builtin_tokenizer_path(), "--sft-data-path", str(rows),
              "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-target-modules", "q_proj",
              "v_proj", "down_proj", "--hidden-dropout", "0.1", "--train-iters", str(ITERS), "--lr", "5e-3",
              "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--eval-interval", "0", "--no-plot",
              "--micro-batch-size", "1", "--global-batch-size", "2", "--log-interval", "100"]
    return tmp, common


@pytest.mark.parametrize("layout", [["--tp", "2", "--sequence-parallel"], ["--zero-stage", "1", "--bf16"]],
                         ids=["tp2-sp", "dp2-zero1-bf16"])
def test_a_stopped_and_resumed_adapter_run_equals_the_uninterrupted_one(made, layout):
    tmp, common = made
    tag = "-".join(layout)
    whole, stopped = (finetune_options([common + layout + ["--save", str(tmp / f"{name}{tag}")] + extra], 2)[0]
                      for name, extra in (("whole", []), ("stopped", ["--exit-interval", "2"])))
    reference, _ = run_distributed(_train, 2, 1, whole, timeout_s=300)[0]
    pieces = []
    for stop in (2, 4, None):
        losses, exited = run_distributed(_train, 2, 1, stopped, timeout_s=300)[0]
        assert (exited and exited["iteration"]) == stop, exited
        pieces += losses
    assert len(reference) == ITERS and pieces == reference
    a, b = _adapters(tmp / f"whole{tag}"), _adapters(tmp / f"stopped{tag}")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint holds the adapters alone, the base named by its path and fingerprint
    from tnlg import checkpoint as ck
    manifest = ck.Manifest.read(ck.resolve(str(tmp / f"stopped{tag}")))
    assert all(".lora_" in n for n in manifest.params) and manifest.adapters["rank"] == 4
    assert manifest.adapters["base"]["path"].startswith(os.path.realpath(tmp / f"stopped{tag}" / "base"))
    assert manifest.iteration == ITERS and manifest.has_optimizer


def _refused(o) -> str:
    from tnlg.errors import UserError
    from tnlg.training.checkpointing import check_resume
    with pytest.raises(UserError) as exc:
        check_resume(o)
    return str(exc.value)


def test_a_resume_on_another_base_or_with_other_adapters_is_refused_in_one_paragraph(made):
    from tnlg.interop.hf_checkpoint import hf_to_checkpoint
    from tnlg.data.tokenizer import builtin_tokenizer_path
    tmp, common = made
    save = tmp / "refusals"
    (o,) = finetune_options([common + ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", str(save)]], 1)
    run_distributed(_train, 1, 1, o, timeout_s=300)
    # other weights of the same shape, as another base checkpoint
    hf_model("llama", seed=1).save_pretrained(tmp / "hf-other")
    other = copy.deepcopy(o)
    other.checkpoint.load = hf_to_checkpoint(str(tmp / "hf-other"), str(tmp / "other"),
                                             tokenizer_model=builtin_tokenizer_path())
    err = _refused(other)
    assert "holds adapters (iteration 1) trained on the frozen base" in err and ": another model." in err, err
    assert str(save / "base") in err and "Nothing was loaded or written." in err and "\n" not in err, err
    # another shape
    import transformers
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))
    wide.save_pretrained(tmp / "hf-wide")
    other.checkpoint.load = hf_to_checkpoint(str(tmp / "hf-wide"), str(tmp / "wide"),
                                             tokenizer_model=builtin_tokenizer_path())
    other.model.hidden_size = 64
    err = _refused(other)
    assert "of another shape (hidden_size 32 in the checkpoint vs 64 now" in err, err
    # the same base folder, its files changed since
    weights = next(p for p in (save / "base").rglob("model_*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    err = _refused(o)
    assert "the same folder, whose files changed since (other weights)" in err, err
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # other adapter settings, and the other kind of run
    rank = copy.deepcopy(o)
    rank.adapters.lora_rank = 8
    assert "rank 4 in the checkpoint vs 8 now" in _refused(rank)
    dense = copy.deepcopy(o)
    dense.adapters.lora_rank, dense.adapters.lora_alpha, dense.adapters.lora_dropout = None, 8.0, 0.0
    dense.adapters.lora_target_modules = None
    assert "is of a LoRA run (rank-4 adapters on down_proj, q_proj, v_proj" in _refused(dense)
    # the checkpoint is no model to generate from: its adapters are, on their base
    from tnlg.errors import UserError
    from tnlg.generation.loading import load_for_inference
    with pytest.raises(UserError, match="is the checkpoint of a LoRA run: it holds rank-4 adapters"):
        load_for_inference(str(save))


def test_tnlg_finetune_resumes_its_adapter_run_with_the_command_it_prints(made, tmp_path, capsys, monkeypatch):
    """The launching process checks the base and the adapters of the checkpoint it resumes, and goes on."""
    import shlex

    from tnlg.cli import main
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "cache"))
    _, common = made
    argv = ["finetune", *common, "--train-iters", "2", "--lr-warmup-iters", "0", "--exit-interval", "1",
            "--nproc-per-node", "1", "--peak-tflops", "1", "--sample-prompt", "", "--save", str(tmp_path / "ft")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tnlg finetune: stopped after iteration 1 of 2 (--exit-interval 1)" in out, out
    resume = out.split("Resume with: ", 1)[1].splitlines()[0]
    assert main(shlex.split(resume)[1:]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at iteration 1" in out, out
    assert "saved checkpoint at iteration 2" in out and "saved the adapters at iteration 2" in out, out
