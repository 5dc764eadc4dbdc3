"""Fine-tuning's validation loss is the whole validation set's, once, per token, as TRL's evaluation reads it.

The reference: transformers' GPT-2 with the same weights scores each row alone (labels -100 on the prompt's
tokens), and the figure is the sum of every counted token's loss over the number of counted tokens of the whole
set. tnlg's validation (packed and unpacked, micro batches that do not divide the set) and ``tnlg eval --task
loss`` on the same rows file give that figure.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [("The king said:", " Long live the queen of all the land."), ("Q: what is two and two?", " Four."),
        ("Translate: good night", " Gute Nacht, mein Freund, gute Nacht."), ("Name a colour.", " Red."),
        ("Who wrote Hamlet?", " William Shakespeare, in about sixteen hundred."), ("Say yes.", " Yes."),
        ("Count to five:", " one two three four five")]
SEQ = 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An HF GPT-2 folder, the builtin tokenizer, a rows file, and transformers' per-token loss of the rows."""
    transformers = pytest.importorskip("transformers")
    from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer
    tmp = tmp_path_factory.mktemp("valid")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=SEQ, vocab_size=4096,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp / "hf")
    tok_path = builtin_tokenizer_path()
    tok = load_tokenizer(tok_path)
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, completion in ROWS:
            p, c = tok.encode_batch([prompt])[0], tok.encode_batch([completion])[0]
            ids, labels = p + c + [tok.eod_id], [-100] * len(p) + c + [tok.eod_id]
            logits = hf(torch.tensor([ids])).logits[0, :-1].double()
            target = torch.tensor(labels[1:])
            total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
            count += int((target != -100).sum())
    return SimpleNamespace(hf=str(tmp / "hf"), tok_path=tok_path, tok=tok, rows=str(rows), loss=total / count,
                           count=count)


@pytest.mark.parametrize("packing", [True, False])
def test_validation_scores_every_row_once_per_token(setup, packing):
    from tnlg.data.sft import build_sft_datasets
    from tnlg.generation.loading import load_model
    from tnlg.options import LoggingOptions
    from tnlg.parallel.state import ParallelState
    from tnlg.training.validation import evaluate
    ps = ParallelState.single()
    model, _ = load_model(setup.hf, ps, setup.tok_path)
    _, valid, report = build_sft_datasets(setup.rows, setup.rows, setup.tok, SEQ, train_samples=0, valid_samples=0,
                                          seed=3, packing=packing)
    assert report.valid.sequences == len(valid) and (len(valid) < len(ROWS)) == packing
    log = LoggingOptions(eval_iters=None)  # unset: the whole set once
    sch = SimpleNamespace(micro_batch_size=2, global_batch_size=4)  # micro batches that do not divide the set
    got = evaluate(model, valid, log, sch, ps, None)
    assert got == pytest.approx(setup.loss, rel=0, abs=1e-6)


def test_fine_tuning_validates_the_whole_set_unless_told(setup, tmp_path):
    from tnlg.cli import build_parser
    from tnlg.commands.finetune import Start
    argv = ["finetune", "--load", setup.hf, "--tokenizer-model", setup.tok_path, "--sft-data-path", setup.rows,
            "--sft-valid-data-path", setup.rows, "--train-iters", "2", "--global-batch-size", "2", "--save",
            str(tmp_path / "s")]
    parser = build_parser(only="finetune")
    assert Start.of(parser.parse_args(argv)).options(1).logging.eval_iters is None
    assert Start.of(parser.parse_args(argv + ["--eval-iters", "3"])).options(1).logging.eval_iters == 3
    assert not (tmp_path / "s").exists()


def test_eval_task_loss_reads_fine_tuning_rows(setup, capsys):
    from tnlg.cli import main
    assert main(["eval", "--task", "loss", "--checkpoint", setup.hf, "--tokenizer-model", setup.tok_path,
                 "--input", setup.rows, "--seq-length", str(SEQ), "--micro-batch-size", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_tokens"] == setup.count and out["rows"] == len(ROWS)
    assert out["loss"] == pytest.approx(setup.loss, rel=0, abs=1e-6)
