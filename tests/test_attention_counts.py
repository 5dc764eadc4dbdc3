"""The planner's parameter counts and FLOPs with a head width apart from hidden / heads, QK norm and sliding
windows: the published shapes' parameter counts are transformers' own (its models built on the meta device),
every TP rank's count is the layers' (uneven heads and shared KV groups at TP 3), and a window ``W`` counts
``4 s W (a D)`` core FLOPs per sliding layer where full attention counts ``4 s^2 (a D)``."""

from __future__ import annotations

import pytest
import torch

from tnlg.config import LLAMA, GPTConfig

transformers = pytest.importorskip("transformers")

# the published configurations (config.json on the hub), sizes as published
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
MISTRAL_NEMO = dict(vocab_size=131072, hidden_size=5120, intermediate_size=14336, num_hidden_layers=40,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1024000,
                    tie_word_embeddings=False, sliding_window=None, rms_norm_eps=1e-5)


@pytest.mark.parametrize("kind,fields", [("qwen3", QWEN3_0_6B), ("mistral", MISTRAL_NEMO)], ids=["qwen3-0.6b", "nemo"])
def test_published_parameter_counts_are_transformers(kind, fields):
    """The formula, the layers' description and the tnlg model built on the meta device count what
    transformers' model of the published config holds."""
    import tnlg
    from tnlg.interop.hf_mapping import config_from_hf
    from tnlg.model import GPT
    config = getattr(transformers, {"qwen3": "Qwen3Config", "mistral": "MistralConfig"}[kind])(**fields)
    with torch.device("meta"):
        hf = getattr(transformers, {"qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[kind])(config)
    published = sum(p.numel() for p in hf.parameters())  # (a tied head is the embedding, counted once)
    cfg = config_from_hf(config)
    assert cfg.num_parameters_formula() == tnlg.parameter_counts(cfg)["total"] == published
    assert sum(p.numel() for p in GPT(cfg, device="meta").parameters()) == published


def test_every_rank_counts_its_layers_at_uneven_tp():
    """6 heads 12 wide (hidden / heads 8) over 2 KV groups with QK norm at TP 1-4: every rank's count is its
    layers' (TP 3 and 4 share a group between ranks and split the heads unevenly at TP 4)."""
    import tnlg
    cfg = GPTConfig(num_layers=2, hidden_size=48, num_attention_heads=6, group_query_attention=True,
                    num_query_groups=2, kv_channels=12, qk_layernorm=True, vocab_size=100, **LLAMA)
    for tp in (1, 2, 3, 4):
        counts = tnlg.parameter_counts(cfg, tp)
        assert [r["params"] for r in counts["per_rank"]] == [r["params"] for r in cfg.parameters_per_rank(tp)], tp


def test_a_sliding_window_counts_s_times_w_in_the_core():
    from tnlg.plan.flops import flops_per_iteration
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, kv_channels=24, seq_length=256, vocab_size=100)
    full = GPTConfig(**base)
    windowed = GPTConfig(**base, sliding_window=32, window_layers=[1, 1, 0, 1])
    s, w, width = 256, 32, 4 * 24
    # forward + backward (3 x forward); the core of a sliding layer: 4 s W (a D) instead of 4 s^2 (a D)
    assert flops_per_iteration(full, 8, False, 128) - flops_per_iteration(windowed, 8, False, 128) == \
        pytest.approx(8 * 3 * 3 * 4 * s * (s - w) * width, rel=1e-12)
    # the head width: queries and projection 4 s h (a D), keys and values 4 s h (a D) without GQA, core 4 s^2 (a D)
    plain = GPTConfig(**{**base, "kv_channels": None})
    h = 64
    assert flops_per_iteration(full, 1, False, 128) - flops_per_iteration(plain, 1, False, 128) == \
        pytest.approx(3 * 4 * (8 * s * h + 4 * s * s) * (width - h), rel=1e-12)
