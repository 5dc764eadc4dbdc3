"""Folders that ship only a Hugging Face ``tokenizer.json`` (a Llama-3-style byte-level BPE with special tokens,
and a SentencePiece model converted by transformers), built here offline: tnlg reads them as a tokenizer kind
of its own whose ids equal ``AutoTokenizer``'s, whose end-of-document id is the folder's eos, whose fingerprint
follows its files, and whose chat template gives ``apply_chat_template``'s ids."""

from __future__ import annotations

import json
import shutil

import pytest

from tnlg.data.chat import chat_template_for, segments
from tnlg.data.fingerprint import fingerprint
from tnlg.data.sft import tokenize_segments
from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer
from tnlg.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
          "m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
PROBES = ["", " ", "Hello, world!", "  leading and trailing  ", "new\nlines\r\n\n and\ttabs", "digits 0123456789 3.14",
          "accents é à ü ß", "CJK 中文 日本語", "emoji 🎭 👩‍👩‍👧", "MiXeD CaSe (brackets) [x] {y} \"q\"", "it's we'll"]
WITH_SPECIALS = ["before <|eot_id|> after", "<|begin_of_text|>x", "</s> and <s> and <unk>"]
CHAT = [("system", "Be brief."), ("user", "Hi there!"), ("assistant", "Hello."), ("user", "Bye?"),
        ("assistant", "Goodbye.")]


def _corpus() -> str:
    from tnlg.data import tokenizer as module
    return open(module.__file__, encoding="utf-8").read()


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory):
    """A byte-level BPE trained on a few kB of text, Llama 3's pre-split regex, its five special tokens, a
    post-processor that adds <|begin_of_text|>, and tokenizer_config.json naming bos, eos and the template."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    folder = tmp_path_factory.mktemp("llama3")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_corpus()], trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3}))
    return folder


@pytest.fixture(scope="module")
def converted_folder(tmp_path_factory):
    """The built-in SentencePiece model as transformers converts and saves it: tokenizer.json alone."""
    src = tmp_path_factory.mktemp("sentencepiece")
    shutil.copy(builtin_tokenizer_path(), src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    out = tmp_path_factory.mktemp("converted")
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    for extra in out.glob("*.model"):
        extra.unlink()
    assert (out / "tokenizer.json").is_file()
    return out


@pytest.mark.parametrize("which", ["llama3", "converted"])
def test_ids_equal_autotokenizers(request, which):
    folder = request.getfixturevalue(f"{which}_folder")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    split = transformers.AutoTokenizer.from_pretrained(str(folder), split_special_tokens=True)
    tok = load_tokenizer(str(folder))
    assert tok.kind == "tokenizer-json" and tok.vocab_size == len(hf)
    assert tok.eod_id == hf.eos_token_id == (hf.convert_tokens_to_ids("<|eot_id|>") if which == "llama3" else 2)
    for text in PROBES:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text, add_special_tokens=False)), text
    for text in WITH_SPECIALS:  # a special token's text inside a document is ordinary characters, as in tnlg
        assert tok.encode(text) == split.encode(text, add_special_tokens=False), text
    assert tok.encode_batch(PROBES) == [tok.encode(t) for t in PROBES]
    for spec in (str(folder / "tokenizer.json"), tok.describe()):
        again = load_tokenizer(spec)
        assert again.describe() == tok.describe() and again.encode(PROBES[4]) == tok.encode(PROBES[4])


def test_the_chat_template_gives_apply_chat_templates_ids(llama3_folder):
    tok = load_tokenizer(str(llama3_folder))
    hf = transformers.AutoTokenizer.from_pretrained(str(llama3_folder))
    ids = tokenize_segments([segments(CHAT, chat_template_for(tok))], tok).ids.tolist()
    want = list(hf.apply_chat_template([{"role": r, "content": c} for r, c in CHAT], tokenize=True,
                                       return_dict=False))
    assert ids == want and ids[0] == hf.bos_token_id and ids[-1] == hf.eos_token_id == tok.eod_id


def test_the_fingerprint_follows_tokenizer_json_and_the_eos_it_names(tmp_path, llama3_folder):
    folder = tmp_path / "copy"
    shutil.copytree(llama3_folder, folder)
    tok = load_tokenizer(str(folder))
    spec = tok.describe()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|end_of_text|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    other = load_tokenizer(str(folder))
    assert other.eod_id == other.piece_id("<|end_of_text|>") != tok.eod_id
    assert fingerprint(other) != fingerprint(tok)
    with pytest.raises(UserError, match="changed since the spec was recorded"):
        load_tokenizer(spec)


def test_a_tokenizer_json_without_an_end_of_document_token_is_one_paragraph(tmp_path):
    from tokenizers import models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="has no end-of-document token") as err:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(err.value)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="is not a tokenizer.json"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_a_model_folder_with_only_tokenizer_json_converts_records_and_exports_it(tmp_path, llama3_folder):
    """``convert --from hf`` records the tokenizer.json tokenizer in the checkpoint (which --use-checkpoint-args
    reads back as --tokenizer-model), and ``--to hf`` writes the folder's own tokenizer files: transformers then
    gives the same ids and the same chat template."""
    from tnlg.checkpoint.files import read_meta, resolve
    from tnlg.interop.hf_checkpoint import checkpoint_to_hf, hf_to_checkpoint
    from tnlg.options.recorded import manifest_options

    from .llama_reference import random_llama
    hf_model = random_llama("llama", groups=2, vocab=len(SPECIALS) + 400)
    folder = tmp_path / "model"
    hf_model.save_pretrained(folder)
    for f in llama3_folder.iterdir():
        shutil.copy(f, folder / f.name)
    tok = load_tokenizer(str(folder))
    assert tok.kind == "tokenizer-json" and tok.vocab_size <= hf_model.config.vocab_size
    hf_to_checkpoint(str(folder), str(tmp_path / "ck"), tokenizer_model=str(folder))
    recorded = manifest_options(read_meta(resolve(str(tmp_path / "ck"))))
    assert recorded["tokenizer_model"] == str(folder / "tokenizer.json")
    assert load_tokenizer(recorded["tokenizer_model"]).describe() == tok.describe()
    checkpoint_to_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    out = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    msgs = [{"role": r, "content": c} for r, c in CHAT]
    src = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert out.apply_chat_template(msgs, tokenize=True, return_dict=False) == \
        src.apply_chat_template(msgs, tokenize=True, return_dict=False)
    for text in PROBES:
        assert out.encode(text, add_special_tokens=False) == tok.encode(text)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == tok.eod_id


@pytest.mark.slow
def test_finetune_load_of_a_tokenizer_json_folder_trains_and_exports(tmp_path, llama3_folder):
    """``tnlg finetune --load`` of a model folder whose only tokenizer file is tokenizer.json trains on `messages`
    rows with its chat template, and ``tnlg convert --to hf`` writes a folder whose tokenizer gives the same
    chat template's ids and whose eos is tnlg's end-of-document id."""
    import os
    import subprocess
    import sys

    from .llama_reference import random_llama
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tmp_path / "model"
    random_llama("llama", groups=2, vocab=len(SPECIALS) + 400, seq=64).save_pretrained(folder)
    for f in llama3_folder.iterdir():
        shutil.copy(f, folder / f.name)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                     {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
                            for i in range(8)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TNLG_CACHE=str(tmp_path / "cache"))

    def tnlg(*argv):
        proc = subprocess.run([sys.executable, "-m", "tnlg", *map(str, argv)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    out = tnlg("finetune", "--load", folder, "--sft-data-path", rows, "--train-iters", 2, "--micro-batch-size", 1,
               "--global-batch-size", 2, "--nproc-per-node", 1, "--eval-interval", 0, "--no-plot", "--save",
               tmp_path / "S")
    assert "saved checkpoint at iteration 2" in out, out
    tnlg("convert", "--from", tmp_path / "S", "--to", "hf", tmp_path / "out")
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    source = transformers.AutoTokenizer.from_pretrained(str(folder))
    msgs = [{"role": r, "content": c} for r, c in CHAT]
    assert exported.apply_chat_template(msgs, tokenize=True, return_dict=False) == \
        source.apply_chat_template(msgs, tokenize=True, return_dict=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == exported.eos_token_id == source.convert_tokens_to_ids("<|eot_id|>")


def test_generate_and_eval_read_a_tokenizer_json_folder_without_tokenizer_model(tmp_path, llama3_folder, capsys):
    """``tnlg generate`` / ``tnlg eval`` of a model folder whose only tokenizer file is tokenizer.json find the
    folder's own tokenizer (no --tokenizer-model): the greedy tokens are transformers' for the same prompt ids."""
    import torch

    from tnlg.cli import main

    from .llama_reference import random_llama
    hf_model = random_llama("llama", groups=2, vocab=len(SPECIALS) + 400, seq=64).eval()
    folder = tmp_path / "model"
    hf_model.save_pretrained(folder)
    for f in llama3_folder.iterdir():
        shutil.copy(f, folder / f.name)
    tok = load_tokenizer(str(folder))
    ids = tok.encode("it's we'll")
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=tok.eod_id)
    want = out[0, len(ids):].tolist()
    want = want[:want.index(tok.eod_id) + 1] if tok.eod_id in want else want
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "it's we'll", "--greedy", "--max-new-tokens",
                 "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["tokens"] == want
    (tmp_path / "wiki.txt").write_text(" = Title = \n\n it's we'll , digits 0123456789 .\n")
    assert main(["eval", "--task", "wikitext", "--checkpoint", str(folder), "--input", str(tmp_path / "wiki.txt")]) == 0
