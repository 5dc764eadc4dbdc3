"""Hugging Face Llama and Qwen2 folders in and out: ``tnlg convert --from hf`` reads the class its
``config.json`` names (a Llama folder once became a random GPT-2: its logits here are the reference's),
``--to hf`` writes the class the architecture is, and any other ``model_type`` is refused in one paragraph
before anything is written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tnlg.errors import UserError

from .llama_reference import random_llama


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_llama_folder_converts_with_its_logits_and_back(tmp_path, kind):
    from tnlg.generation.loading import load_for_inference
    from tnlg.interop.hf_checkpoint import checkpoint_to_hf, hf_to_checkpoint
    from tnlg.parallel.state import ParallelState
    import transformers
    hf = random_llama(kind, groups=2 if kind == "llama" else 6)
    hf.save_pretrained(tmp_path / "in")
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
    hf_to_checkpoint(str(tmp_path / "in"), str(tmp_path / "ck"), tp_size=2)
    model, _ = load_for_inference(str(tmp_path / "ck"), ParallelState.single())
    with torch.no_grad():
        got = model(tokens)[..., :hf.config.vocab_size]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    checkpoint_to_hf(str(tmp_path / "ck"), str(tmp_path / "out"), with_tokenizer=False)
    assert json.load(open(tmp_path / "out" / "config.json"))["model_type"] == kind
    back = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]).from_pretrained(
        tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ref, rtol=1e-5, atol=1e-5)


def test_an_hf_folder_of_another_model_type_is_refused_before_anything_is_written(tmp_path):
    from tnlg.generation.loading import precheck_checkpoint
    from tnlg.interop.hf_checkpoint import hf_to_checkpoint
    os.makedirs(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    for call in (lambda: hf_to_checkpoint(str(tmp_path / "m"), str(tmp_path / "ck")),
                 lambda: precheck_checkpoint(str(tmp_path / "m"), None)):
        with pytest.raises(UserError) as e:
            call()
        assert "'gemma'" in str(e.value) and "LlamaForCausalLM" in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "ck")


def test_shared_kv_groups_reshard_from_tp_4_to_3_and_load_at_tp_1(tmp_path):
    """A checkpoint whose KV groups are shared by TP ranks (TP 4 over 2 groups) reshards to TP 3 (a rank
    holding both groups) and loads at TP 1 with the reference's logits."""
    from tnlg.generation.loading import load_for_inference
    from tnlg.checkpoint.offline import reshard_checkpoint
    from tnlg.model import GPT
    from tnlg.interop.hf_checkpoint import hf_to_checkpoint
    from tnlg.parallel.state import ParallelState
    hf = random_llama("llama")
    hf.save_pretrained(tmp_path / "in")
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
    hf_to_checkpoint(str(tmp_path / "in"), str(tmp_path / "tp4"), tp_size=4)
    meta = json.load(open(next((tmp_path / "tp4").glob("iter_*")) / "meta.json"))
    assert meta["params"]["transformer.h.0.attn.c_kv.weight"]["offsets"] == [0, 0, 1, 1]
    reshard_checkpoint(str(tmp_path / "tp4"), str(tmp_path / "tp3"), tp_size=3, describe=GPT.describe)
    model, _ = load_for_inference(str(tmp_path / "tp3"), ParallelState.single())
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :hf.config.vocab_size], ref, rtol=1e-5, atol=1e-5)
