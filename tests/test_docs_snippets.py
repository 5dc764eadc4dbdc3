"""The Python snippets of the README, docs/eval.md and docs/hf.md run as written: each is read from the page and executed,
in the situation its comments name (two processes for ``init_parallel(tensor_parallel_size=2)``, a fresh
interpreter with nothing but ``import tnlg`` for ``tnlg.interop.hf``). (The ``tnlg.load`` snippet is checked
against transformers' logits in tests/test_generate.py, docs/hf.md's decoding in tests/test_hf_export.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_reference import bytes_to_unicode, random_gpt2
from tnlg.runtime.spawn import checkout_env, run_distributed

ROOT = Path(__file__).resolve().parent.parent


def snippet(page: str, marker: str) -> str:
    """The ```python block of ``page`` that contains ``marker``, dedented."""
    text = (ROOT / page).read_text()
    block = next(s for s in re.findall(r"```python\n(.*?)```", text, re.S) if marker in s)
    return "\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines())


def _model_snippet(ps, code: str) -> dict:
    """Worker: the README's model snippet with ``tokens`` / ``labels`` of one sample, as its comment says."""
    sample = torch.randint(0, 50257, (1, 9), generator=torch.Generator().manual_seed(0))
    scope = {"tokens": sample[:, :-1], "labels": sample[:, 1:]}
    exec(compile(code, "README", "exec"), scope)
    return {"tp": scope["ps"].tp_size, "loss": float(scope["loss"]), "logits": list(scope["logits"].shape),
            "sum": float(scope["logits"].double().sum())}


@pytest.mark.slow  # two processes build GPT-2 small (124M parameters): about 15 s idle
def test_readmes_model_snippet_runs_under_two_processes_and_its_plain_process_comment_holds():
    """``init_parallel(tensor_parallel_size=2)`` on two processes (what torchrun gives it) builds GPT-2 small
    at TP 2: the full-vocabulary logits on both ranks; in a plain process that call is refused, and the
    comment's ``tnlg.init_parallel()`` gives TP 1 (it said "a plain process gets TP=1" of the TP 2 call)."""
    code = snippet("README.md", "tnlg.init_parallel(tensor_parallel_size=2)")
    assert code.startswith("import tnlg, torch")  # tnlg first: torch's OpenMP threads get the command's setting
    out = run_distributed(_model_snippet, 2, 2, code, timeout_s=600)
    assert [o["tp"] for o in out] == [2, 2] and out[0]["logits"] == out[1]["logits"] == [1, 8, 50257]
    assert out[0]["loss"] == out[1]["loss"] and 9 < out[0]["loss"] < 12  # ln 50257 = 10.8 at init
    assert out[0]["sum"] == out[1]["sum"]
    import tnlg
    with pytest.raises(ValueError, match="does not divide the world size 1"):
        tnlg.init_parallel(tensor_parallel_size=2)
    comment = re.search(r"a plain process: (tnlg\.init_parallel\(\)) \(TP=1\)", code).group(1)
    assert eval(comment, {"tnlg": tnlg}).tp_size == 1


def _write_byte_bpe(folder: Path) -> None:
    """A tiny GPT-2 byte-level BPE (256 byte symbols, two merges, <|endoftext|>) as vocab.json + merges.txt."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = [("Ġ", "t"), ("h", "e")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def test_eval_docs_generation_snippet_runs_as_written_after_a_plain_import(tmp_path):
    """docs/eval.md's snippet (``import tnlg`` only, then ``tnlg.interop.hf.from_hf("gpt2/")``, ``tnlg.generate``,
    ``tnlg.generate_ids``) in a fresh interpreter, in a folder holding a ``gpt2/`` Hugging Face folder: it ran
    into AttributeError, ``tnlg.interop`` not having imported ``hf``."""
    pytest.importorskip("transformers")
    code = snippet("docs/eval.md", "tnlg.interop.hf.from_hf")
    assert code.startswith("import tnlg\n") and "import tnlg.interop" not in code
    folder = tmp_path / "gpt2"
    random_gpt2(7600, 64).save_pretrained(folder)  # ids up to 7586 in the snippet
    _write_byte_bpe(folder)
    # each statement as the interactive interpreter runs it: an expression's value is printed
    runner = ("import ast, sys\nscope = {}\nfor node in ast.parse(sys.argv[1]).body:\n"
              "    exec(compile(ast.Interactive([node]), 'docs/eval.md', 'single'), scope)\n")
    done = subprocess.run([sys.executable, "-c", runner, code], cwd=tmp_path, env=checkout_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.strip().splitlines()
    # the sampled texts, then the same greedy ids twice (SamplingOptions with generate_tokens, and the keywords)
    assert len(printed) == 3 and printed[0].startswith("[") and printed[1].startswith("[[")
    assert printed[1] == printed[2]


def test_hf_docs_export_snippet_runs_as_written(tmp_path, monkeypatch):
    """docs/hf.md's two ``tnlg.interop.hf.to_hf`` lines (each an alternative: with the built-in tokenizer, and
    weights and config only), each run in a folder of its own after a plain ``import tnlg``: the folders are
    what transformers loads."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import tnlg
    code = snippet("docs/hf.md", "tnlg.interop.hf.to_hf(model")
    model = tnlg.GPT(tnlg.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                                    vocab_size=4096), tnlg.init_parallel())
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) == 2
    for i, line in enumerate(lines):
        (tmp_path / str(i)).mkdir()
        monkeypatch.chdir(tmp_path / str(i))
        exec(compile(line, "docs/hf.md", "exec"), {"tnlg": tnlg, "model": model})
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(i) / "gpt-out")
        assert hf.config.vocab_size == 4096
        assert (tmp_path / str(i) / "gpt-out" / "tokenizer.json").exists() == (i == 0)


def test_the_docs_modules_are_attributes_whatever_imported_their_package_first():
    """``tnlg.interop.hf`` after another module of the package was imported on its own (as a command does):
    the docs' ``tnlg.interop.hf.to_hf`` must not depend on which test or command ran first."""
    code = ("import tnlg.interop.hf_fields, tnlg; assert callable(tnlg.interop.hf.to_hf); "
            "assert tnlg.interop.megatron.checkpoint_to_megatron")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=checkout_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
