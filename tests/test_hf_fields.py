"""Every field of transformers' GPT2Config, LlamaConfig, Qwen2Config, MistralConfig and Qwen3Config (and the
mixtures of experts' MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig and OlmoeConfig), as the
installed transformers
declares it, is honoured, ignored (it does not change the logits) or refused at the values that change
the model; a round trip through a tnlg checkpoint writes back the honoured fields unchanged."""

from __future__ import annotations

import json

import pytest

from tnlg.errors import UserError
from tnlg.interop.families import FAMILIES
from tnlg.interop.hf_fields import check_fields

from .hf_reference import random_gpt2
from .llama_reference import random_llama

transformers = pytest.importorskip("transformers")
CONFIGS = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
           "qwen3": "Qwen3Config", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
           "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig"}


def test_the_registry_names_transformers_own_classes_of_each_model_type():
    """Each family's config and model classes are the ones transformers' Auto classes pick for its
    model_type, and every family tnlg reads is listed here."""
    assert set(FAMILIES) == set(CONFIGS)
    for model_type, family in FAMILIES.items():
        config = transformers.AutoConfig.for_model(model_type)
        assert type(config).__name__ == family.config_class == CONFIGS[model_type]
        model_cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        assert model_cls.__name__ == family.model_class, model_type


def _declared(kind: str) -> set:
    """The fields the installed transformers declares for the class: its defaults' keys, its attribute
    map's names, and the fields every PretrainedConfig has."""
    cls = getattr(transformers, CONFIGS[kind])
    return set(cls().to_dict()) | set(cls.attribute_map) | set(transformers.PretrainedConfig().to_dict())


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_every_declared_field_is_in_exactly_one_list(kind):
    family = FAMILIES[kind]
    lists = {"honoured": family.honoured, "ignored": family.ignored, "refused": family.refused}
    unlisted = sorted(f for f in _declared(kind) if not any(f in fields for fields in lists.values()))
    assert not unlisted, f"{CONFIGS[kind]} fields in no list (docs/hf.md): {unlisted}"
    twice = sorted(f for f in _declared(kind) if sum(f in fields for fields in lists.values()) > 1)
    assert not twice, twice
    assert all(isinstance(why, str) and why for why in family.ignored.values())


SMALL = dict(vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=32)
REFUSED_VALUES = [("gpt2", "add_cross_attention", True), ("llama", "hidden_act", "gelu"),
                  ("qwen2", "hidden_act", "relu"), ("qwen2", "layer_types", ["sliding_attention", "full_attention"]),
                  ("mistral", "hidden_act", "gelu"), ("qwen3", "hidden_act", "gelu"), ("qwen3", "attention_bias", True),
                  ("qwen3", "layer_types", ["full_attention", "sliding_attention"]),
                  ("olmoe", "hidden_act", "gelu"), ("olmoe", "attention_bias", True), ("olmoe", "clip_qkv", 8.0),
                  ("olmoe", "head_dim", 16)]


def _config(kind, **fields):
    cls = getattr(transformers, CONFIGS[kind])
    if kind == "gpt2":
        return cls(n_layer=2, n_embd=48, n_head=6, n_positions=32, vocab_size=100, **fields)
    return cls(**SMALL, **fields)


@pytest.mark.parametrize("kind,field,value", REFUSED_VALUES)
def test_a_refused_field_is_accepted_at_its_default_and_refused_by_name_otherwise(kind, field, value):
    assert set(f for k, f, _ in REFUSED_VALUES if k == kind) >= set(FAMILIES[kind].refused)
    check_fields(_config(kind), FAMILIES[kind], "the model")
    with pytest.raises(UserError) as err:
        check_fields(_config(kind, **{field: value}), FAMILIES[kind], "the model")
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kind,n_inner", [("gpt2", None), ("gpt2", 96), ("llama", None), ("qwen2", None)])
def test_a_round_trip_writes_back_every_honoured_field(tmp_path, kind, n_inner):
    """hf -> tnlg checkpoint -> hf leaves config.json's honoured (architectural) fields equal (GPT-2's
    n_inner null, the default width, stays null)."""
    from tnlg.interop.hf_checkpoint import checkpoint_to_hf, hf_to_checkpoint
    if kind == "gpt2":
        model = random_gpt2(100, 32, n_layer=2, n_inner=n_inner, layer_norm_epsilon=1e-6, activation_function="gelu",
                            tie_word_embeddings=False)
    else:
        model = random_llama(kind, rope_theta=5e5, rms_norm_eps=1e-6, attention_dropout=0.1,
                             initializer_range=0.03, tie_word_embeddings=kind == "qwen2")
    model.save_pretrained(tmp_path / "in")
    hf_to_checkpoint(str(tmp_path / "in"), str(tmp_path / "ck"))
    checkpoint_to_hf(str(tmp_path / "ck"), str(tmp_path / "out"), with_tokenizer=False)
    before, after = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("in", "out"))
    read = sorted(f for f in FAMILIES[kind].honoured if f in before)
    assert len(read) >= 11
    assert {f: after.get(f) for f in read} == {f: before[f] for f in read}


def test_a_mistral_without_a_window_comes_back_as_mistral_through_tnlg_convert(tmp_path):
    """A Mistral folder without a sliding window (Mistral-7B-v0.3's config: sliding_window null) computes what a
    Llama does; converted to a tnlg checkpoint and back with ``tnlg convert`` it is still a Mistral:
    config.json's model_type, architectures and every honoured field as they were, and transformers' logits of
    the exported folder equal to the original model's."""
    import torch
    from tnlg.cli import main
    torch.manual_seed(0)
    config = transformers.MistralConfig(**SMALL, sliding_window=None, rms_norm_eps=1e-6, rope_theta=1e6,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "in")
    assert main(["convert", "--from", "hf", str(tmp_path / "in"), "--to", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--from", str(tmp_path / "ck"), "--to", "hf", str(tmp_path / "out"),
                 "--no-tokenizer"]) == 0
    before, after = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("in", "out"))
    assert before["model_type"] == after["model_type"] == "mistral"
    assert before["architectures"] == after["architectures"] == ["MistralForCausalLM"]
    read = sorted(f for f in FAMILIES["mistral"].honoured if f in before)
    assert "sliding_window" in read and "head_dim" in read
    assert {f: after.get(f) for f in read} == {f: before[f] for f in read}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "MistralForCausalLM"
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-5)
