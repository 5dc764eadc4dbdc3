"""A Hugging Face mixture of experts (Mixtral) through the user's path, against plain ``transformers``:

* ``tnlg finetune --load MIXTRAL_DIR``: 5 steps equal ``transformers``' ``MixtralForCausalLM`` trained by
  ``torch.optim.AdamW`` (decay on matrices only; the per-token mean over the global batch; no auxiliary loss, as
  the folder's ``output_router_logits`` is off) within 1e-5, at TP 1, TP 2 with sequence parallelism and EP 2
  (the experts split over the two data-parallel ranks);
* ``tnlg generate --checkpoint MIXTRAL_DIR --greedy``: ``transformers``' greedy tokens, token for token, at TP 1
  and TP 2.

The routers keep their initial scale: routers scaled up saturate their softmax, whose gradients then fall to
rounding level, and Adam (which divides by their size) turns rounding differences into steps of full size, in
either implementation; the losses then part after three steps (by 5e-5 with routers 20 times larger).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .pool import run_distributed
from .sft_reference import ROWS, SEQ, finetune_options, folder_losses, samples, train


ITERS, LR = 5, 2e-3
PROMPTS = ["The king said", "Two and two"]


def _mixtral(seed: int = 0):
    """A small random Mixtral (4 experts, top-2, GQA), its norms off 1."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=4096, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False, initializer_range=0.2)
    model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral") / "hf"
    _mixtral().save_pretrained(path)
    return path


@pytest.mark.slow
def test_fine_tuning_a_mixtral_folder_equals_transformers_at_tp_and_ep(folder, tmp_path):
    from tnlg.data.tokenizer import builtin_tokenizer_path, load_tokenizer
    tok_path = builtin_tokenizer_path()
    ref = folder_losses(folder, samples(load_tokenizer(tok_path)), ITERS, LR)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(prompt=p, completion=c)) + "\n" for p, c in ROWS))
    common = ["--load", str(folder), "--tokenizer-model", tok_path, "--sft-data-path", str(rows),
              "--train-iters", str(ITERS), "--lr", str(LR), "--lr-decay-style", "constant", "--clip-grad", "0",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "0", "--no-plot",
              "--micro-batch-size", "1", "--log-interval", "100", "--global-batch-size", str(len(ROWS)),
              "--no-packing"]
    layouts = {"tp1": (1, []), "tp2-sp": (2, ["--tp", "2", "--sequence-parallel"]), "ep2": (2, ["--ep", "2"])}
    for name, (world, flags) in layouts.items():
        opts = finetune_options([common + flags + ["--save", str(tmp_path / name)]], world)
        got = run_distributed(train, world, 1, opts, timeout_s=300)[0][0]
        assert got == pytest.approx(ref, abs=1e-5), (name, got, ref)
    assert ref[-1] < ref[0] - 0.1  # (it learned: the steps are not all alike)


def _greedy(model, ids: list[int], new: int, eod: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eod)
    out = out[0, len(ids):].tolist()
    return out[:out.index(eod) + 1] if eod in out else out


def test_greedy_generation_of_a_mixtral_folder_is_transformers_token_for_token(folder):
    import transformers
    from tnlg.data.tokenizer import load_tokenizer
    tok = load_tokenizer("builtin")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [_greedy(ref, tok.encode(p), 12, tok.eod_id) for p in PROMPTS]
    assert len(set(map(tuple, want))) == len(PROMPTS)
    argv = ["generate", "--checkpoint", str(folder), "--tokenizer-model", "builtin", "--greedy",
            "--max-new-tokens", "12", "--json", *sum((["--prompt", p] for p in PROMPTS), [])]
    for tp in ("1", "2"):
        done = subprocess.run([sys.executable, "-m", "tnlg", *argv, "--tp", tp], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [r["tokens"] for r in json.loads(done.stdout)["results"]] == want, tp
