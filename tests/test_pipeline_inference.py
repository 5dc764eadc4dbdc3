"""Evaluation and generation through a pipeline: the same logits, tokens and figures as without one.

References are independent of the pipeline code: tnlg's plain GPT in one process (no process
group) with the same weights, and `transformers`' GPT-2 (its logits). The
pipeline ranks load a Hugging Face folder or a tnlg checkpoint written at PP 1 by parameter name.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tnlg.cli import main
from tnlg.eval import dataset_loss, lambada_accuracy, wikitext_perplexity
from tnlg.generation import generate_ids
from tnlg.interop.hf import from_hf
from tnlg.model.stage import StageModel
from tnlg.parallel.pipeline import chunk_layers
from tnlg.model.inference import forward_logits
from tnlg.parallel.sharding import load_full_state_dict
from tnlg.parallel.vocab import gather_logits
from tnlg.runtime.spawn import run_tnlg
from .pool import run_distributed

from tests.test_generate import EOD, PROMPTS, SAMPLING, VOCAB
from tests.test_generate import _hf_model as _generate_hf_model

SEQ, LAYERS, NEW = 32, 4, 10
LAYOUTS = [(2, 1), (2, 2), (4, 1)]  # (PP, TP) on 4 processes: DP 2, 1, 1

pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_model(seed=0, vocab=VOCAB, seq=SEQ):
    """A random `transformers` GPT-2 of LAYERS layers with non-trivial LayerNorms and biases."""
    return _generate_hf_model(vocab=vocab, seq=seq, seed=seed, n_layer=LAYERS)


@torch.no_grad()
def _inputs(hf):
    g = torch.Generator().manual_seed(5)
    stream = torch.randint(0, VOCAB - 1, (150,), generator=g).tolist()
    contexts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (4, 9, 3, 12, 7, 5)]
    # LAMBADA-style pairs, every other target the model's own argmax (so the count is neither 0 nor all)
    pairs = [(c, [int(hf(torch.tensor([c])).logits[0, -1].argmax()) if i % 2 == 0 else int(c[0])])
             for i, c in enumerate(contexts)]
    seqs = torch.randint(0, VOCAB - 1, (6, SEQ + 1), generator=g)
    masks = (torch.rand(6, SEQ, generator=g) > 0.3).float()  # uneven token counts: the loss is token-weighted
    samples = [dict(tokens=s[:-1], labels=s[1:], loss_mask=m) for s, m in zip(seqs, masks)]
    return dict(tokens=torch.tensor(PROMPTS[1] * 2), stream=stream, pairs=pairs, samples=samples)


def _figures(model, inputs) -> dict:
    """Everything measured on one model: the logits of one batch (full vocabulary; ``None`` off the last
    stage), greedy ids with and without the cache, seeded samples and the three evaluations."""
    ps = model.ps
    logits = forward_logits(model, inputs["tokens"].view(2, -1))
    return dict(
        logits=None if logits is None else gather_logits(logits, ps, VOCAB),
        greedy=generate_ids(model, PROMPTS, NEW, greedy=True, eod_id=EOD),
        alone=[generate_ids(model, [p], NEW, greedy=True, eod_id=EOD)[0] for p in PROMPTS],
        no_cache=generate_ids(model, PROMPTS, NEW, greedy=True, eod_id=EOD, use_cache=False),
        sampled=[generate_ids(model, PROMPTS, NEW, seed=3, eod_id=EOD, **kw) for kw in SAMPLING],
        wikitext=wikitext_perplexity(model, inputs["stream"], 40, stride=8, micro_batch_size=3)["total_loss"],
        lambada=lambada_accuracy(model, inputs["pairs"], micro_batch_size=4)["correct"],
        loss=dataset_loss(model, inputs["samples"], micro_batch_size=2)["loss"])


def _pipeline_body(_ps, folder, inputs, full):
    from tnlg.parallel.state import init_parallel

    out = {}
    for pp, tp in LAYOUTS:
        ps = init_parallel(tp, pipeline_parallel_size=pp)
        model = from_hf(folder, ps)  # this stage's layers, by the GPT's names
        out[pp, tp] = dict(_figures(model, inputs), stage=ps.pp_rank, names=sorted(n for n, _ in
                                                                                    model.named_parameters()))
        if pp == 2:  # the training's interleaved model: two chunks per rank, chunk c on rank c % 2
            chunks = [r for c, r in enumerate(chunk_layers(LAYERS, 2, virtual=2)) if c % 2 == ps.pp_rank]
            inter = StageModel(model.config, ps, chunks)
            load_full_state_dict(inter, {n: full[n] for n, _ in inter.named_parameters()}, ps)
            logits = forward_logits(inter, inputs["tokens"].view(2, -1))
            out[pp, tp]["interleaved"] = None if logits is None else gather_logits(logits, ps, VOCAB)
            out[pp, tp]["interleaved_greedy"] = generate_ids(inter, PROMPTS, NEW, greedy=True, eod_id=EOD)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tnlg.parallel.sharding import full_state_dict

    hf = _hf_model()
    folder = tmp_path_factory.mktemp("hf_pp")
    hf.save_pretrained(folder)
    plain = from_hf(str(folder))  # PP 1, one process
    inputs = _inputs(hf)
    with torch.no_grad():
        hf_logits = hf(inputs["tokens"].view(2, -1)).logits
    return dict(folder=str(folder), hf=hf, hf_logits=hf_logits, inputs=inputs, plain=_figures(plain, inputs),
                full=full_state_dict(plain, plain.ps), names=sorted(n for n, _ in plain.named_parameters()))


def _check_same_as_plain(got: dict, ref: dict, where) -> None:
    for key in ("greedy", "alone", "no_cache", "sampled", "lambada"):
        assert got[key] == ref["plain"][key], (where, key)
    for key in ("wikitext", "loss"):
        assert math.isclose(got[key], ref["plain"][key], rel_tol=1e-5), (where, key, got[key], ref["plain"][key])


def test_pipeline_stages_give_the_logits_tokens_and_figures_of_the_plain_model(reference):
    plain = reference["plain"]
    torch.testing.assert_close(plain["logits"], reference["hf_logits"], rtol=1e-4, atol=1e-4)  # the reference
    assert plain["greedy"] == plain["alone"] and any(len(set(r)) > 2 for r in plain["greedy"])
    assert 3 <= plain["lambada"] < len(reference["inputs"]["pairs"])
    results = run_distributed(_pipeline_body, 4, 1, reference["folder"], reference["inputs"], reference["full"],
                              timeout_s=240)
    for (pp, tp) in LAYOUTS:
        names = set()
        for rank, per_layout in enumerate(results):
            got = per_layout[pp, tp]
            names.update(got["names"])
            _check_same_as_plain(got, reference, (pp, tp, rank))
            last = got["stage"] == pp - 1
            for key in ("logits", "interleaved") if pp == 2 else ("logits",):
                if last:  # the logits of the last stage, full vocabulary gathered over TP
                    torch.testing.assert_close(got[key], plain["logits"], rtol=1e-5, atol=1e-5, msg=(pp, tp, key))
                else:
                    assert got[key] is None
            if pp == 2:
                assert got["interleaved_greedy"] == plain["greedy"]
        assert names == set(reference["names"]), (pp, tp)  # the stages hold the whole model


# ------------------------------------------------------------------- the commands
@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory):
    """A Hugging Face folder with the built-in SentencePiece model's 4096 ids (tokenizer: --tokenizer-model)."""
    folder = tmp_path_factory.mktemp("hf_pp_cli")
    _hf_model(seed=2, vocab=4096, seq=64).save_pretrained(folder)
    return str(folder)


def _json(capfd, argv) -> dict:
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert out.count("\n") == 1, out
    return json.loads(out)


@pytest.mark.slow
def test_eval_and_generate_commands_at_pp2_match_pp1_from_a_folder_and_a_pp1_tnlg_checkpoint(cli_folder, tmp_path,
                                                                                             capfd):
    convert = pytest.importorskip("tnlg.interop.hf_checkpoint")
    ckpt = tmp_path / "ckpt"
    convert.hf_to_checkpoint(cli_folder, str(ckpt), tokenizer_model="builtin")
    text = tmp_path / "notes.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 2)
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["To be, or not to be, that is the question",
                                                                         "Of man's first disobedience, and the fruit",
                                                                         "Sing, goddess, the anger of Achilles"]))
    evaluate = ["eval", "--task", "text", "--input", str(text), "--overlapping-eval", "8", "--json"]
    strict = ["eval", "--task", "lambada", "--strict", "--input", str(lambada), "--json"]
    generate = ["generate", "--prompt", "To be", "--prompt", "Of man", "--top-k", "8", "--seed", "5",
                "--max-new-tokens", "5", "--json"]
    for source in (["--checkpoint", cli_folder, "--tokenizer-model", "builtin"], ["--checkpoint", str(ckpt)]):
        ev1, ev2 = (_json(capfd, evaluate + source + pp) for pp in ([], ["--pp", "2", "--nproc-per-node", "2"]))
        assert ev2["pipeline_model_parallel_size"] == 2 and ev1["pipeline_model_parallel_size"] == 1
        assert math.isclose(ev2["val_loss"], ev1["val_loss"], rel_tol=1e-5), (source, ev1, ev2)
        la1, la2 = (_json(capfd, strict + source + pp) for pp in ([], ["--pp", "2", "--nproc-per-node", "2"]))
        assert (la2["correct"], la2["num_examples"]) == (la1["correct"], 3), (source, la1, la2)
        gen1, gen2 = (_json(capfd, generate + source + pp) for pp in ([], ["--pp", "2", "--nproc-per-node", "4"]))
        assert gen2["data_parallel_size"] == 2 and gen2["results"] == gen1["results"], source  # PP 2 x DP 2


def test_a_pipeline_layout_that_cannot_run_is_one_paragraph_before_any_process_starts(cli_folder, capfd):
    common = ["--checkpoint", cli_folder, "--tokenizer-model", "builtin", "--prompt", "To be"]
    for argv, needle in [(["--pp", "3", "--nproc-per-node", "4"],
                          "--pipeline-model-parallel-size 3 does not divide the 4 processes: every pipeline must "
                          "be complete (the world is TP x CP x DP x PP). Valid pipeline-parallel sizes at TP 1 on 4 "
                          "processes: [1, 2, 4]"),
                         (["--pp", "8"], f"--pipeline-model-parallel-size 8 is more stages than the model's "
                                         f"{LAYERS} layers; every stage needs at least one layer: valid sizes are 1 "
                                         f"to {LAYERS}"),
                         (["--pp", "0"], "--pipeline-model-parallel-size must be a positive integer, got 0")]:
        assert main(["generate", *common, *argv]) == 2
        err = capfd.readouterr().err
        assert needle in err and "Traceback" not in err, err


# ------------------------------------------------------------------- validation and the sample of a run
_LOG_LINE = r"loss (?:\(mean of \d+\) )?(\S+) \| grad norm (?:\(this iter\) )?(\S+)"


def _run(tmp_path, name, argv) -> tuple[list, str, list]:
    metrics = tmp_path / f"{name}.jsonl"
    out = run_tnlg(["pretrain", "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "2", "--log-interval",
                    "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--sample-tokens", "12",
                    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "4",
                    "--global-batch-size", "16", "--peak-tflops", "1", "--no-plot",
                    "--metrics-file", str(metrics), *argv], tmp_path)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    valid = [(r["iteration"], r["loss"]) for r in rows if r.get("split") == "valid"]
    sample = re.search(r"sample:\n(.*?)\s*(?:tnlg pretrain: finished|\Z)", out, re.S)  # (the last lines)
    assert sample and sample.group(1).strip(), out[-2000:]
    return valid, sample.group(1), re.findall(_LOG_LINE, out)


@pytest.mark.slow
def test_the_losses_validation_and_final_sample_of_a_pipeline_run_are_those_of_the_run_without_one(tmp_path):
    """``tnlg pretrain`` at PP 2 (x TP 2, and x DP 2) logs the losses and grad norms, validates and samples as the
    run without a pipeline (TP 2 x DP 2) does."""
    valid1, sample1, logs1 = _run(tmp_path, "pp1", ["--nproc-per-node", "4", "--tp", "2"])  # TP 2 x DP 2
    assert [i for i, _ in valid1] == [0, 2, 3] and len(logs1) == 3
    for name, layout in (("pp2tp2", ["--pp", "2", "--tp", "2"]), ("pp2dp2", ["--pp", "2", "--tp", "1"])):
        valid, sample, logs = _run(tmp_path, name, ["--nproc-per-node", "4", *layout])
        assert logs == logs1, (name, logs, logs1)  # each iteration's loss and grad norm as printed
        assert [i for i, _ in valid] == [i for i, _ in valid1], name
        for (_, a), (_, b) in zip(valid, valid1):
            assert math.isclose(a, b, rel_tol=1e-5), (name, valid, valid1)
        assert sample == sample1, name  # the same seeded draws from the same weights
