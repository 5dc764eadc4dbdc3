"""``--load-adapter DIR`` on ``tnlg generate``, ``tnlg eval`` and ``tnlg serve``: PEFT's LoRA folder merged into
the loaded model's weights, each rank its shard.

The references are transformers + peft on the same Hugging Face folder and the same adapter folder (made by peft,
random factors, GPT-2's fused QKV and Llama's grouped key/value and gate/up pairs partly adapted): greedy
``generate`` at TP 1 and TP 2, a dataset's loss, a served completion. An adapter that does not fit the model is
refused in one paragraph before any process starts.
"""

from __future__ import annotations

import json
from contextlib import redirect_stdout
from io import StringIO

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tnlg.cli import main

from .sft_reference import SEQ, hf_model as _hf_model
from .test_lora_finetune import _refusal

pytestmark = pytest.mark.needs_package("peft")

TARGETS = {"gpt2": ["c_attn", "c_proj", "mlp.c_fc"], "llama": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}
PROMPTS = ["To be, or not to be", "Sing"]


def _folders(tmp_path, kind: str, use_rslora: bool = False):
    """(base folder, adapter folder, transformers + peft model) of a random ``kind`` model and a random adapter."""
    import peft
    from tnlg.data.tokenizer import load_tokenizer
    eod = load_tokenizer("builtin").eod_id
    hf = _hf_model(kind)
    hf.config.eos_token_id = hf.config.bos_token_id = eod
    hf.save_pretrained(tmp_path / "hf")
    torch.manual_seed(5)
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=6.0, target_modules=TARGETS[kind],
                                                      init_lora_weights=False, use_rslora=use_rslora,
                                                      fan_in_fan_out=kind == "gpt2"))
    with torch.no_grad():  # B large enough that the merged model's tokens differ from the base's
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.mul_(20.0)
    adapted.save_pretrained(tmp_path / "adapter")
    return tmp_path / "hf", tmp_path / "adapter", adapted.eval()


@torch.no_grad()
def _greedy(model, ids, new: int, eod: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eod)
    out = out[0, len(ids):].tolist()
    return out[:out.index(eod) + 1] if eod in out else out


def _json(argv) -> dict:
    """The one JSON object the command prints (in a process of its own at several ranks: their stdout)."""
    if "--tp" in argv and argv[argv.index("--tp") + 1] != "1":
        import subprocess
        import sys
        done = subprocess.run([sys.executable, "-m", "tnlg", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)
    out = StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generate_with_an_adapter_gives_peft_greedy_tokens_at_tp_1_and_2(tmp_path, kind):
    from tnlg.data.tokenizer import load_tokenizer
    tok = load_tokenizer("builtin")
    base, adapter, ref = _folders(tmp_path, kind, use_rslora=kind == "llama")
    want = [_greedy(ref, tok.encode(p), 10, tok.eod_id) for p in PROMPTS]
    with ref.disable_adapter():  # the adapter changes the tokens: the test tells merged from not merged
        assert want != [_greedy(ref, tok.encode(p), 10, tok.eod_id) for p in PROMPTS]
    argv = ["generate", "--checkpoint", str(base), "--tokenizer-model", "builtin", "--load-adapter", str(adapter),
            "--greedy", "--max-new-tokens", "10", "--json", *sum((["--prompt", p] for p in PROMPTS), [])]
    for tp in ("1", "2"):
        got = _json(argv + ["--tp", tp])["results"]
        assert [r["tokens"] for r in got] == want, tp


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_eval_loss_with_an_adapter_equals_peft_loss(tmp_path, kind):
    from tnlg.data.indexed import IndexedDatasetBuilder
    from tnlg.eval.loss import build_eval_dataset
    base, adapter, ref = _folders(tmp_path, kind)
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "docs")
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for _ in range(8):
            doc = rng.integers(0, 4095, int(rng.integers(20, 90)))
            b.add_document(doc, [len(doc)])
        b.finalize(prefix + ".idx")
    res = _json(["eval", "--task", "loss", "--checkpoint", str(base), "--input", prefix, "--load-adapter",
                 str(adapter), "--data-cache-path", str(tmp_path / "cache"), "--json"])
    ds = build_eval_dataset(prefix, SEQ, vocab_size=4096, cache_dir=str(tmp_path / "cache"))
    items = [ds[i] for i in range(len(ds))]
    tokens, labels = torch.stack([it["tokens"] for it in items]), torch.stack([it["labels"] for it in items])
    with torch.no_grad():
        want = F.cross_entropy(ref(input_ids=tokens).logits.double().reshape(-1, 4096), labels.reshape(-1))
        with ref.disable_adapter():
            base_loss = F.cross_entropy(ref(input_ids=tokens).logits.double().reshape(-1, 4096), labels.reshape(-1))
    assert res["num_tokens"] == labels.numel()
    assert abs(res["loss"] - float(want)) <= 1e-5 < abs(float(base_loss) - float(want))


@pytest.mark.needs_package("fastapi", "uvicorn", "openai")
def test_serve_with_an_adapter_answers_the_merged_models_greedy_tokens(tmp_path):
    from tests.served import Server
    from tests.test_serve import completion_ids
    from tnlg.data.tokenizer import load_tokenizer
    tok = load_tokenizer("builtin")
    base, adapter, ref = _folders(tmp_path, "llama")
    s = Server(base, "--load-adapter", str(adapter))
    try:
        client = s.client()
        for p in PROMPTS:
            assert completion_ids(client, p, max_tokens=8, temperature=0)[0] == _greedy(ref, tok.encode(p), 8,
                                                                                       tok.eod_id)
    finally:
        s.stop()


def test_an_adapter_that_does_not_fit_is_refused_before_any_process_starts(tmp_path, capsys):
    import peft
    base, adapter, _ = _folders(tmp_path / "llama", "llama")
    gpt2 = _hf_model("gpt2")
    peft.get_peft_model(gpt2, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)).save_pretrained(
        tmp_path / "gpt2-adapter")
    wider = _hf_model("llama")  # the same family, another size: its factors' shapes differ
    wide = type(wider)(type(wider.config)(**{**wider.config.to_dict(), "hidden_size": 64}))
    peft.get_peft_model(wide, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "wide")
    deeper = type(wider)(type(wider.config)(**{**wider.config.to_dict(), "num_hidden_layers": 3}))
    peft.get_peft_model(deeper, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "deep")
    conf = json.loads((adapter / "adapter_config.json").read_text())
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    cases = [(tmp_path / "gpt2-adapter", "fan_in_fan_out True"), (tmp_path / "wide", "another base model"),
             (tmp_path / "deep", "does not have"), (tmp_path / "dora", "use_dora=True"),
             (tmp_path / "missing", "is not a folder")]
    commands = [["generate", "--prompt", "a", "--tokenizer-model", "builtin"],
                ["eval", "--task", "wikitext", "--input", str(tmp_path / "wiki.txt")],
                ["serve", "--tokenizer-model", "builtin"]]
    (tmp_path / "wiki.txt").write_text(" = Title = \n\n a b c .\n")
    for folder, words in cases:
        for command in commands if folder == cases[0][0] else commands[:1]:
            err = _refusal([*command, "--checkpoint", str(base), "--load-adapter", str(folder), "--tp", "2"], capsys)
            assert words in err and "starting" not in err, (command, folder, err[-2000:])
