"""``tnlg eval --task lm-eval`` against lm-eval's own ``hf`` backend on the same Hugging Face folder: the
log-likelihoods of the same requests within 1e-4 (and the same greedy flags), the rolling log-likelihood of
documents, greedy generations equal; whole local tasks (a multiple-choice, a generation and a perplexity task
over JSON Lines made from the repo's corpus, offline) give the same accuracies, exact match and perplexities
at TP 1 and TP 2 x PP 2."""

from __future__ import annotations

import json

import pytest

from tests.hf_reference import random_gpt2
from tnlg.cli import main

pytestmark = pytest.mark.needs_package("lm_eval")

MC = """task: tnlg_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN = """task: tnlg_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{completion}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
ROLLING = """task: tnlg_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/docs.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def _lines(n: int) -> list[str]:
    from tnlg.data.corpus import corpus_documents
    out = []
    for _, text in corpus_documents():
        out += [line.strip() for line in text.splitlines() if len(line.split()) >= 6]
        if len(out) >= n:
            break
    return out[:n]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A GPT-2 folder (random weights, a byte-level BPE trained on the corpus, 128 positions) and a folder
    of three task YAMLs over JSON Lines cut from the corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("harness")
    lines = _lines(60)
    folder = root / "model"
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    t.model.save(str(folder))
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    eod = vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    hf = random_gpt2(len(vocab), 128, 7, n_embd=32, n_head=4, n_layer=2, bos_token_id=eod, eos_token_id=eod)
    hf.save_pretrained(folder)
    data = root / "tasks"
    data.mkdir()
    with open(data / "mc.jsonl", "w") as f:
        for i in range(12):
            words = lines[i].split()
            k = len(words) // 2
            wrong = [" ".join(lines[(i + j) % len(lines)].split()[k:]) for j in (7, 13, 29)]
            f.write(json.dumps({"question": " ".join(words[:k]), "choices": [" ".join(words[k:])] + wrong,
                                "answer": 0}) + "\n")
    with open(data / "gen.jsonl", "w") as f:
        for line in lines[20:30]:
            words = line.split()
            f.write(json.dumps({"prompt": " ".join(words[:4]), "completion": " " + " ".join(words[4:6])}) + "\n")
    with open(data / "docs.jsonl", "w") as f:
        for i in range(30, 36):
            f.write(json.dumps({"text": " ".join(lines[i:i + 8])}) + "\n")  # longer than 128 tokens: windows
    for name, text in (("mc", MC), ("gen", GEN), ("ppl", ROLLING)):
        (data / f"{name}.yaml").write_text(text.format(data=data))
    return folder, hf, data


@pytest.fixture(scope="module")
def models(setup):
    from lm_eval.models.huggingface import HFLM

    from tnlg.data.tokenizer import load_tokenizer
    from tnlg.eval.harness import TnlgLM
    from tnlg.interop.hf import from_hf
    folder = setup[0]
    ours = TnlgLM(from_hf(str(folder)).eval(), load_tokenizer(str(folder)), batch_size=4)
    theirs = HFLM(pretrained=str(folder), dtype="float32", batch_size=1, device="cpu")
    return ours, theirs


def _instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_the_same_requests_score_as_lm_evals_hf_backend(models, setup):
    ours, theirs = models
    lines = _lines(12)
    pairs = [(line[:len(line) // 2], line[len(line) // 2:]) for line in lines]  # cut mid-word, after spaces
    pairs += [("", lines[0]), (lines[1] + " ", "and")]
    ours_ll, theirs_ll = ours.loglikelihood(_instances("loglikelihood", pairs)), \
        theirs.loglikelihood(_instances("loglikelihood", pairs))
    assert [g for _, g in ours_ll] == [g for _, g in theirs_ll]
    assert [s for s, _ in ours_ll] == pytest.approx([s for s, _ in theirs_ll], abs=1e-4)
    docs = [(" ".join(lines[i:i + 6]),) for i in range(3)]
    assert ours.loglikelihood_rolling(_instances("loglikelihood_rolling", docs)) == pytest.approx(
        theirs.loglikelihood_rolling(_instances("loglikelihood_rolling", docs)), abs=1e-4)
    gen = [(line[:20], {"until": ["."], "max_gen_toks": 8, "do_sample": False}) for line in lines[:5]]
    assert ours.generate_until(_instances("generate_until", gen)) == \
        theirs.generate_until(_instances("generate_until", gen))


def _hf_results(setup) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    folder, _, data = setup
    out = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32"},
                                  tasks=["tnlg_mc", "tnlg_gen", "tnlg_ppl"], batch_size=1, device="cpu",
                                  task_manager=TaskManager(include_path=str(data)), log_samples=False,
                                  bootstrap_iters=0)
    return out["results"]


def _check(ours: dict, theirs: dict) -> None:
    for task, metrics in theirs.items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not key.endswith("_stderr,none") and key != "alias":
                if "perplexity" in key or "bits" in key:
                    assert ours[task][key] == pytest.approx(value, rel=1e-5), (task, key)
                else:
                    assert ours[task][key] == value, (task, key)


@pytest.fixture(scope="module")
def hf_results(setup):
    return _hf_results(setup)


def _argv(setup, out):
    folder, _, data = setup
    return ["eval", "--task", "lm-eval", "--checkpoint", str(folder), "--tasks", "tnlg_mc", "tnlg_gen", "tnlg_ppl",
            "--include-path", str(data), "--micro-batch-size", "4", "--output-path", str(out)]


def test_local_tasks_give_the_hf_backends_results(setup, hf_results, tmp_path, capsys):
    assert main(_argv(setup, tmp_path / "r.json")) == 0
    printed = capsys.readouterr().out
    assert "tnlg_mc" in printed and "acc" in printed and "|" in printed  # lm-eval's own table
    ours = json.loads((tmp_path / "r.json").read_text())["results"]
    _check(ours, hf_results)
    assert hf_results["tnlg_mc"]["acc,none"] >= 0 and "exact_match,none" in ours["tnlg_gen"]


@pytest.mark.slow
def test_local_tasks_at_tp2_x_pp2(setup, hf_results, tmp_path, capfd):
    """Both splits in one run (four processes): the heads and the layers over ranks at once."""
    assert main(_argv(setup, tmp_path / "r.json") + ["--nproc-per-node", "4", "--tp", "2", "--pp", "2"]) == 0
    capfd.readouterr()
    _check(json.loads((tmp_path / "r.json").read_text())["results"], hf_results)


def test_lm_eval_refusals(setup, capsys):
    folder, _, data = setup
    base = ["eval", "--task", "lm-eval", "--checkpoint", str(folder)]
    assert main(base) == 2
    assert "needs --tasks" in capsys.readouterr().err
    assert main(base + ["--tasks", "no_such_task", "--include-path", str(data)]) == 2
    assert "knows no task 'no_such_task'" in capsys.readouterr().err
    assert main(base + ["--tasks", "tnlg_mc", "--include-path", str(data / "mc.yaml")]) == 2
    assert "not a folder" in capsys.readouterr().err
