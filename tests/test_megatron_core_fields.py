"""Every field of the installed megatron-core's ``TransformerConfig`` is placed: honoured (tnlg computes
what Megatron computes with it), inert (it does not change what the saved model computes) or refused
by name when a checkpoint's args set it to a value that selects another model. A field a later
megatron-core adds fails the walk until it is placed.

The refusals are checked on the saved args alone and once through the importer, on a ``torch_dist``
checkpoint written by tnlg's exporter whose ``common.pt`` args are edited (megatron-core itself is only
needed for its ``TransformerConfig``: the args of a run that saved every field at megatron-core's own
defaults must convert to the model the plain args describe).
"""

import argparse
import dataclasses
import os
import shutil

import pytest
import torch

from tests.fresh_checkpoint import fresh_checkpoint
from tnlg.config import GPTConfig
from tnlg.errors import UserError
from tnlg.interop.megatron import checkpoint_to_megatron, megatron_to_checkpoint
from tnlg.interop.megatron.args import args_for, config_from_args
from tnlg.interop.megatron.core_fields import HONOURED, INERT, REFUSED, inert_fields

CFG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32)
WHERE = "Megatron checkpoint 'x'"

# what a Megatron-LM 0.16.1 run saves for each choice that converted with exit 0 into another model
MODEL_CHANGING = [("layernorm_zero_centered_gamma", True), ("apply_layernorm_1p", True), ("window_size", [8, 2]),
                  ("window_size", (8, 1)), ("window_size", (-1, 4)), ("no_rope_freq", 4), ("no_rope_freq", [0, 1]), ("qk_l2_norm", True),
                  ("softmax_type", "off-by-one"), ("softmax_type", "learnable"), ("glu_linear_offset", 1.0),
                  ("activation_func_clamp_value", 7.0), ("softmax_scale", 0.5), ("attention_output_gate", True),
                  ("num_moe_experts", 8), ("experimental_attention_variant", "dsa"),
                  ("gated_linear_unit", True)]


def _transformer_config_fields() -> list[str]:
    core = pytest.importorskip("megatron.core.transformer.transformer_config")
    return [f.name for f in dataclasses.fields(core.TransformerConfig)]


def test_every_transformer_config_field_is_placed_once():
    inert = inert_fields()
    tables = {"honoured": set(HONOURED), "inert": set(inert), "refused": set(REFUSED)}
    for a in tables:
        for b in tables:
            assert a == b or not tables[a] & tables[b], f"{sorted(tables[a] & tables[b])} are both {a} and {b}"
    assert sum(len(names) for names, _ in INERT) == len(inert), "a field is listed twice as inert"
    fields = _transformer_config_fields()
    unplaced = [f for f in fields if not any(f in t for t in tables.values())]
    assert not unplaced, (f"megatron-core's TransformerConfig has fields tnlg has not placed (honoured, inert or "
                          f"refused in tnlg/interop/megatron/core_fields.py): {unplaced}")
    stale = sorted((set(HONOURED) | set(inert)) - set(fields))
    assert not stale, f"honoured or inert names that are no TransformerConfig field (misspelt?): {stale}"
    assert all(why.strip() for why in inert.values())


def _args(**changes) -> argparse.Namespace:
    args = args_for(CFG, tp=1, pp=1, iteration=3)
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def test_the_args_of_every_field_at_megatron_cores_default_convert():
    """A run that saved all of TransformerConfig's fields (megatron-core's own defaults, the plain
    args' values where they describe the model) converts to the model the plain args describe."""
    core = pytest.importorskip("megatron.core.transformer.transformer_config")
    tc = core.TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0,
                                attention_dropout=0.0)
    saved = {f.name: getattr(tc, f.name) for f in dataclasses.fields(tc)}
    args = argparse.Namespace(**{**saved, **vars(args_for(CFG, tp=1, pp=1, iteration=3))})
    assert args.softmax_type == "vanilla" and args.glu_linear_offset == 0.0 and args.window_size is None
    assert config_from_args(args, WHERE) == CFG


def test_head_width_qk_norm_and_sliding_windows_convert_both_ways():
    """kv_channels apart from hidden / heads, qk_layernorm and a causal window_size (left, 0) with
    window_attn_skip_freq (an integer: every N-th layer full; a list: 1 per sliding layer) are read as
    tnlg's fields and written back as Megatron saves them."""
    wide = GPTConfig(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
                     kv_channels=12, qk_layernorm=True, sliding_window=5, window_layers=[1, 0, 1, 1])
    args = args_for(wide, tp=1, pp=1, iteration=3)
    assert (args.kv_channels, args.qk_layernorm, args.window_size, args.window_attn_skip_freq) == \
        (12, True, (4, 0), [1, 0, 1, 1])
    assert config_from_args(args, WHERE) == wide
    every_second = config_from_args(_args(num_layers=4, window_size=(3, 0), window_attn_skip_freq=2), WHERE)
    assert (every_second.sliding_window, every_second.window_layers) == (4, [1, 0, 1, 0])
    assert config_from_args(_args(window_size=[7, 0]), WHERE).layer_window(1) == 8
    assert config_from_args(_args(window_size=(-1, 0)), WHERE) == CFG
    assert config_from_args(_args(kv_channels=8), WHERE) == CFG  # hidden / heads: the default width


@pytest.mark.parametrize("name,value", MODEL_CHANGING, ids=lambda v: str(v))
def test_a_model_changing_field_is_refused_by_name(name, value):
    with pytest.raises(UserError) as info:
        config_from_args(_args(**{name: value}), WHERE)
    msg = str(info.value)
    assert f"{name}=" in msg and "Nothing was written" in msg and "\n" not in msg, msg


def _other(valid: tuple):
    """A value other than the ones tnlg models: the opposite bool, another number or string, a tuple."""
    if True in valid or False in valid:
        return not valid[0]
    if valid and isinstance(valid[0], str):
        return valid[0] + "-other"
    if valid and isinstance(valid[0], (int, float)):
        return valid[0] + 3
    return (4, 0)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_every_refused_choice_is_refused_under_each_of_its_names(field):
    entry = REFUSED[field]
    for name in entry.names:
        with pytest.raises(UserError, match=f"{name}=.*which tnlg does not model"):
            config_from_args(_args(**{name: _other(entry.valid)}), WHERE)
        if entry.valid:
            config_from_args(_args(**{name: entry.valid[0]}), WHERE)  # the value tnlg models converts


@pytest.fixture(scope="module")
def torch_dist_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("core_fields")
    ckpt = fresh_checkpoint(str(root / "tnlg"), CFG)
    return checkpoint_to_megatron(ckpt, str(root / "torch_dist"), fmt="torch_dist", tp=1)


@pytest.mark.parametrize("name,value", MODEL_CHANGING[:8], ids=lambda v: str(v))
def test_the_importer_refuses_them_and_writes_nothing(torch_dist_ckpt, tmp_path, name, value):
    src = tmp_path / "iter_0000003"  # an iteration folder is a source too
    shutil.copytree(torch_dist_ckpt, src)
    common = src / "common.pt"
    assert os.path.isfile(common)
    state = torch.load(common, weights_only=False)
    setattr(state["args"], name, value)
    torch.save(state, common)
    with pytest.raises(UserError, match=f"{name}=") as info:
        megatron_to_checkpoint(str(src), str(tmp_path / "out"))
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- Llama 3.1's --use-rope-scaling

ROPE = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=16, vocab_size=32,
                 position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm", swiglu=True,
                 add_bias_linear=False)


def test_use_rope_scaling_reads_as_megatron_cores_llama3_frequencies():
    """``--use-rope-scaling --rope-scaling-factor 8`` converts to the inverse frequencies megatron-core's own
    ``RotaryEmbedding`` computes (its fixed low/high frequency factors and original length), and back."""
    rotary = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    from tnlg.parallel.rotary import scaled_frequencies
    for factor in (8.0, 32.0):
        cfg = config_from_args(_args_of(ROPE, use_rope_scaling=True, rope_scaling_factor=factor), WHERE)
        assert cfg.rope_scaling_type == "llama3" and cfg.rope_scaling_factor == factor
        want = rotary.RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                                      rope_scaling_factor=factor, use_cpu_initialization=True).inv_freq
        got, attention = scaled_frequencies(cfg.rotary_dim, cfg.rotary_base, cfg.rope_scaling)
        assert not torch.equal(got, scaled_frequencies(32, 500000.0, None)[0])  # (the scaling changes them)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert attention == 1.0
        back = args_for(cfg, tp=1, pp=1, iteration=3)
        assert back.use_rope_scaling is True and back.rope_scaling_factor == factor
        assert config_from_args(back, WHERE) == cfg
    assert not args_for(ROPE, tp=1, pp=1, iteration=3).use_rope_scaling


def _args_of(cfg, **changes) -> argparse.Namespace:
    args = args_for(cfg, tp=1, pp=1, iteration=3)
    for name, value in changes.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("fields,named", [
    (dict(rope_scaling_type="llama3", rope_scaling_factor=8.0, rope_original_max_position=16),
     "rope_original_max_position=16"),
    (dict(rope_scaling_type="yarn", rope_scaling_factor=4.0), "rope_scaling_type='yarn'"),
    (dict(add_attn_bias=True), "add_attn_bias=True")])
def test_a_model_no_megatron_argument_carries_is_refused_on_export(fields, named):
    cfg = dataclasses.replace(ROPE, **fields)
    with pytest.raises(UserError, match=named) as info:
        args_for(cfg, tp=1, pp=1, iteration=3)
    assert "\n" not in str(info.value)


def test_a_llama3_rope_checkpoint_goes_to_megatron_and_back(tmp_path):
    """A tnlg checkpoint with megatron-core's llama3 scaling exports with ``use_rope_scaling`` and
    ``rope_scaling_factor`` and imports back to the same config; another original length is refused before
    anything is written."""
    from tnlg.checkpoint.offline import open_source
    cfg = dataclasses.replace(ROPE, rope_scaling_type="llama3", rope_scaling_factor=32.0,
                              rope_original_max_position=8192)
    ckpt = fresh_checkpoint(str(tmp_path / "tnlg"), cfg)
    out = checkpoint_to_megatron(ckpt, str(tmp_path / "meg"), fmt="torch_dist", tp=1)
    args = torch.load(os.path.join(out, "common.pt"), weights_only=False)["args"]
    assert args.use_rope_scaling is True and args.rope_scaling_factor == 32.0
    back = megatron_to_checkpoint(str(tmp_path / "meg"), str(tmp_path / "back"))
    assert open_source(back)[2] == cfg
    other = fresh_checkpoint(str(tmp_path / "other"), dataclasses.replace(cfg, rope_original_max_position=16))
    with pytest.raises(UserError, match="rope_original_max_position=16"):
        checkpoint_to_megatron(other, str(tmp_path / "no"), fmt="torch_dist", tp=1)
    assert not (tmp_path / "no").exists()
