"""Published attention variants against transformers' own classes: a head width apart from hidden / heads
(Mistral-Nemo's shape), Qwen3's per-head QK norm (tied and untied) and sliding windows (Mistral's on every
layer, Qwen2's and Qwen3's per layer from ``layer_types``).

Each reference is transformers' ``MistralForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` on
random weights saved with ``save_pretrained``; tnlg reads the folder and must give its logits (fp32, 1e-5)
at TP 1, 2 and 4 (6 heads over 2 KV groups: uneven at TP 4, each group shared by two ranks), its greedy
tokens (the KV cache
past the window), and write the folder back with the same architectural fields.
"""

from __future__ import annotations

import json

import pytest
import torch

from tnlg.interop.families import FAMILIES as FAMILY_ENTRIES

from .pool import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 24
SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=0, attention_dropout=0.0)
# the published shapes, shrunk in size only
FAMILIES = {
    # Mistral-7B: a window (here 5) shorter than the sequence, on every layer
    "mistral": ("mistral", dict(sliding_window=5)),
    # Mistral-Nemo: head_dim 128 where hidden / heads is 160 (here 16 where 80 / 4 = 20), no window
    "mistral-nemo": ("mistral", dict(hidden_size=80, num_attention_heads=4, head_dim=16, sliding_window=None)),
    # Qwen3: head_dim 128 whatever hidden / heads is (here 16 where 48 / 6 = 8), q_norm and k_norm
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3-tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    # Qwen3 and Qwen2 with a window on some layers (layer_types; Qwen2's from max_window_layers)
    "qwen3-window": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=4,
                                   layer_types=["sliding_attention", "full_attention"])),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
}
CLASSES = {"mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def random_family(name: str, seed: int = 0):
    """transformers' model of ``FAMILIES[name]``, random weights sharpened so attention is far from uniform
    (a window or a norm left out would show), norms not ones."""
    kind, fields = FAMILIES[name]
    config_cls, model_cls = (getattr(transformers, c) for c in CLASSES[kind])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SMALL, **fields}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
            if n.endswith(("norm.weight", ".bias")):
                p.add_(0.3 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


def _tokens(batch: int = 2, seq: int = 20) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every family saved by ``save_pretrained``, with its reference logits: ``{name: (folder, logits)}``."""
    out = {}
    for name in FAMILIES:
        model, folder = random_family(name), tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        with torch.no_grad():
            out[name] = (str(folder), model(_tokens()).logits)
    return out


def _logits(ps, folders: dict, tokens: torch.Tensor) -> dict:
    """Worker: tnlg's full logits of every folder at this rank's TP (``from_hf``, vocabulary shards gathered)."""
    from tnlg.interop.hf import from_hf
    from tnlg.parallel.vocab import gather_logits
    out = {}
    for name, folder in folders.items():
        model = from_hf(folder, ps)
        with torch.no_grad():
            out[name] = gather_logits(model(tokens), ps, VOCAB)
    return out


def test_published_attention_variants_give_transformers_logits_at_tp_1_2_and_4(folders):
    """Mistral's window, Mistral-Nemo's head width, Qwen3 (untied, tied, with per-layer windows) and
    Qwen2's per-layer window: tnlg's logits are transformers' at TP 1, 2 and 4."""
    paths = {name: folder for name, (folder, _) in folders.items()}
    for tp in (1, 2, 4):
        got = run_distributed(_logits, tp, tp, paths, _tokens())[0]
        for name, (_, ref) in folders.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5, msg=lambda m, k=(name, tp): f"{k}: {m}")


def test_the_window_and_the_qk_norm_change_the_logits(folders):
    """The references are sensitive to what is tested: without its window (or with its QK norm weights at
    ones) a family's logits move far beyond the tolerance."""
    from tnlg.interop.hf import from_hf
    tokens = _tokens()
    for name, change in (("mistral", dict(sliding_window=None)), ("qwen2-window", dict(sliding_window=None,
                                                                                        window_layers=None))):
        folder, ref = folders[name]
        with torch.no_grad():
            assert (from_hf(folder, **change)(tokens)[..., :VOCAB] - ref).abs().max() > 1e-2, name
    model = from_hf(folders["qwen3"][0])
    with torch.no_grad():
        for layer in model.transformer.h:
            layer.attn.q_norm.weight.fill_(1.0)
        assert (model(tokens)[..., :VOCAB] - folders["qwen3"][1]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["mistral", "qwen3", "qwen3-window"])
def test_greedy_generation_is_transformers_token_for_token_past_the_window(name):
    """Greedy decoding with the KV cache from an 4-token prompt to the end of the positions (past every
    window): the same tokens as transformers' ``generate``."""
    from tnlg.generation.generator import generate_ids
    from tnlg.interop.hf import from_hf
    hf = random_family(name)
    prompt = _tokens(1, 4)
    new = SEQ - prompt.shape[1]
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate_ids(from_hf(hf), [prompt[0].tolist()], max_new_tokens=new, greedy=True, stop_at_eod=False)
    assert got[0] == ref[0, prompt.shape[1]:].tolist()
    assert len(got[0]) == new > hf.config.sliding_window if name == "mistral" else True


@pytest.mark.parametrize("name", ["mistral", "mistral-nemo", "qwen3-tied", "qwen3-window", "qwen2-window"])
def test_a_round_trip_keeps_the_architectural_fields(tmp_path, folders, name):
    """hf -> tnlg checkpoint (TP 2) -> hf: the same model_type (a Mistral without a window is Llama, written
    as LlamaForCausalLM), every other honoured field of config.json equal, tnlg's config equal, and the
    written folder gives the reference's logits in transformers."""
    from tnlg.generation.loading import load_for_inference
    from tnlg.interop.hf_checkpoint import checkpoint_to_hf, hf_to_checkpoint
    from tnlg.interop.hf_reader import read_hf_folder
    from tnlg.parallel.state import ParallelState
    folder, ref = folders[name]
    hf_to_checkpoint(folder, str(tmp_path / "ck"), tp_size=2)
    model, _ = load_for_inference(str(tmp_path / "ck"), ParallelState.single())
    checkpoint_to_hf(str(tmp_path / "ck"), str(tmp_path / "out"), with_tokenizer=False)
    before, after = (json.loads(open(f"{d}/config.json").read()) for d in (folder, tmp_path / "out"))
    kind = FAMILIES[name][0]  # (a Mistral without a window too: the checkpoint records the family it came from)
    assert after["model_type"] == before["model_type"] == kind
    assert after["architectures"] == before["architectures"]
    read = sorted(f for f in FAMILY_ENTRIES[kind].honoured if f in before and f != "model_type")
    assert {f: after.get(f) for f in read} == {f: before[f] for f in read}
    assert read_hf_folder(str(tmp_path / "out"))[0] == read_hf_folder(folder)[0] == model.config
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    back.config._attn_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(back(_tokens()).logits, ref, rtol=1e-5, atol=1e-5)


def test_a_per_layer_window_without_a_class_is_refused_on_export(tmp_path):
    """A window on some layers of a Llama without QKV biases or QK norm has no transformers class (Mistral's
    window covers every layer): refused in one paragraph, nothing written."""
    from tnlg.config import LLAMA, GPTConfig
    from tnlg.errors import UserError
    from tnlg.interop.families import family_of
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, sliding_window=4, window_layers=[1, 0],
                    **LLAMA)
    with pytest.raises(UserError) as err:
        family_of(cfg)
    assert "window_layers=[1, 0]" in str(err.value) and "\n" not in str(err.value)
    assert family_of(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, sliding_window=4,
                               window_layers=[1, 1], **LLAMA)).model_type == "mistral"
