"""``tnlg finetune`` against a plain ``transformers`` reference, at every layout.

The reference fine-tunes the same Hugging Face model (GPT-2, and a Llama with rope and GQA) with plain torch: each
step the whole global batch, labels ``-100`` on the prompts' tokens, the loss the per-token mean over every
counted token of the global batch, ``torch.optim.AdamW`` with decay on matrices only. tnlg loads the same folder
(``tnlg finetune --load HF_DIR``: converted once, weights only), packs or pads the same rows, and trains at TP 1,
TP 2 + SP, CP 2, PP 2 and TP 2 x DP 2 with ZeRO 1. The completions differ in length, so a mean of micro-batch
means would give other losses (checked: that run differs from the reference).
"""

from __future__ import annotations

import json

import pytest

from .pool import run_distributed
from .sft_reference import ROWS, SEQ, finetune_options as _options, folder_losses, hf_model as _hf_model
from .sft_reference import samples as _samples, train as _train

ITERS, LR = 5, 2e-3


LAYOUTS = {1: [("tp1", [])], 2: [("tp2-sp", ["--tp", "2", "--sequence-parallel"]), ("cp2", ["--cp", "2"]),
                                 ("pp2", ["--pp", "2"])],
           4: [("tp2-dp2-zero1", ["--tp", "2", "--zero-stage", "1"])]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per model kind: the reference losses and tnlg's per layout (packed and not)."""
    from tnlg.data.tokenizer import builtin_tokenizer_path
    from tnlg.data.tokenizer import load_tokenizer
    tmp = tmp_path_factory.mktemp("finetune")
    tok_path = builtin_tokenizer_path()
    tok = load_tokenizer(tok_path)
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    samples = _samples(tok)
    out = {}
    for kind in ("gpt2", "llama"):
        hf_dir = tmp / f"hf-{kind}"
        _hf_model(kind).save_pretrained(hf_dir)
        ref = folder_losses(str(hf_dir), samples, ITERS, LR)  # plain transformers + torch's AdamW
        common = ["--load", str(hf_dir), "--tokenizer-model", tok_path, "--sft-data-path", str(rows),
                  "--train-iters", str(ITERS), "--lr", str(LR), "--lr-decay-style", "constant", "--clip-grad", "0",
                  "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0", "--no-plot",
                  "--micro-batch-size", "1", "--log-interval", "100"]
        got = {}
        for world, layouts in LAYOUTS.items():
            argvs, names = [], []
            for name, flags in layouts:
                for packed in (True, False) if world <= 2 else (False,):
                    tag = f"{name}-{'packed' if packed else 'padded'}"
                    gbs = len(ROWS) if not packed else _packed_sequences(tok_path, rows)
                    argvs.append(common + flags + ["--global-batch-size", str(gbs), "--save", str(tmp / kind / tag)]
                                 + ([] if packed else ["--no-packing"]))
                    names.append(tag)
            if world == 1:  # the mean of micro-batch means: must not match the reference
                argvs.append(common + ["--global-batch-size", str(len(ROWS)), "--no-packing", "--save",
                                       str(tmp / kind / "micro-means"), "--no-calculate-per-token-loss"])
                names.append("micro-means")
            opts = _options(argvs, world)
            losses = run_distributed(_train, world, 1, opts, timeout_s=300)[0]
            got.update(zip(names, losses))
        out[kind] = (ref, got)
    return out


def _packed_sequences(tok_path, rows) -> int:
    """How many packed sequences the rows make (a global batch of that many sees every sample once)."""
    from tnlg.data.sft import build_sft_datasets
    from tnlg.data.tokenizer import load_tokenizer
    _, _, report = build_sft_datasets(str(rows), None, load_tokenizer(tok_path), SEQ, train_samples=1,
                                      valid_samples=0, seed=1234, packing=True)
    return report.sequences


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fine_tuning_losses_equal_the_transformers_reference_at_every_layout(runs, kind):
    ref, got = runs[kind]
    assert len(got) >= 6
    for name, losses in got.items():
        if name == "micro-means":
            continue
        assert losses == pytest.approx(ref, abs=1e-5), (kind, name, losses, ref)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_mean_of_micro_batch_means_would_differ(runs, kind):
    """The completions' lengths differ: without the per-token loss the first step's loss is another number."""
    ref, got = runs[kind]
    assert abs(got["micro-means"][0] - ref[0]) > 1e-3, (got["micro-means"][0], ref[0])
