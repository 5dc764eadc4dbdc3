"""Every field of the Hugging Face config classes tnlg reads (``GPT2Config``, ``LlamaConfig``,
``Qwen2Config``, ``MistralConfig``, ``Qwen3Config``) is in one of three lists of its family's entry
(:class:`tnlg.interop.families.Family`; docs/hf.md's table), checked here:

* ``honoured``: the field sets what tnlg computes exactly as it sets transformers' logits (the
  :class:`~tnlg.config.GPTConfig` field it becomes); an invalid value (a count that is not a positive
  integer, ...) is refused.
* ``ignored``: the field does not change the logits of the causal-LM forward (generation defaults,
  token ids, what ``forward`` returns, the dtype transformers would load in, ...), each with its reason.
* ``refused``: the field is accepted only at values that leave the model one tnlg computes (its
  default, or one with the same effect); any other value is refused in one paragraph naming the field
  and value, because honouring it would change the model's computation (not supported yet).

``tests/test_hf_fields.py`` walks each class's fields as the installed transformers declares them and
fails on a field in none of the lists, so a field a later transformers adds cannot slip through.
Keys a config class does not declare are kept by transformers as attributes its model never reads,
except those in the entry's ``undeclared`` (read by the loading code or by ``getattr`` in the model).
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import boolean, fraction, optional_positive, optional_positive_int, positive, positive_int
from ..errors import UserError
from .families import NO_WINDOW, Family
from .hf_llama import ROPE_KEYS, rope_parameters_in, rope_type_of

__all__ = ["ROPE_TYPES", "check_counts", "check_fields"]

def _windowed_layers_have_a_window(c) -> bool:
    """A layer that ``layer_types`` marks ``sliding_attention`` needs a window (``use_sliding_window`` with
    ``sliding_window``): without one transformers' attention has none to apply."""
    kinds = getattr(c, "layer_types", None) or []
    return "sliding_attention" not in kinds or getattr(c, "sliding_window", None) is not None


# --------------------------------------------------------------------------- checks

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# each scaled type's keys: (check, whether transformers needs the key); yarn's factor may be missing
# (max_position_embeddings / original_max_position_embeddings), its other keys have defaults
_ROPE_CHECKS: dict[str, Callable] = dict(factor=positive, low_freq_factor=positive, high_freq_factor=positive,
                                         original_max_position_embeddings=positive_int, beta_fast=optional_positive,
                                         beta_slow=optional_positive, mscale=optional_positive,
                                         mscale_all_dim=optional_positive, attention_factor=optional_positive,
                                         truncate=boolean)


def _rope_wrong(rope: Any, kind, top_level: frozenset = frozenset()) -> list[str]:
    """What is wrong with a ``rope_parameters`` of a valid ``rope_theta``: a ``rope_type`` tnlg does not
    compute, a scaled type's value that is not valid, or a ``partial_rotary_factor`` (read by the scaled
    types' frequencies, not by Llama's rotation, which then fails). ``top_level``: the keys whose value
    came from the config's top level (:func:`~.hf_llama.rope_parameters_in`), named as such."""
    if kind not in ROPE_TYPES:
        return [f"rope_parameters has rope_type {_shown(kind)}: tnlg computes rope_type {', '.join(ROPE_TYPES)} "
                "(longrope and the others are not supported yet)"]
    if kind == "default":
        return []
    optional = {"truncate"} | ({"factor"} if kind == "yarn" else set())
    wrong = []
    for key in ROPE_KEYS[kind]:
        value = rope.get(key)
        must = None if value is None and key in optional else _ROPE_CHECKS[key](value)
        if must:
            where = (f"{key} (beside rope_parameters, which transformers reads first)" if key in top_level
                     else f"rope_parameters' {key}")
            wrong.append(f"{where} {_shown(value)} must {must}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        wrong.append(f"rope_parameters' partial_rotary_factor {_shown(rope['partial_rotary_factor'])} must be 1.0 "
                     f"(a {kind} rope over part of each head is not computed by Llama's attention)")
    if kind == "llama3" and not wrong and rope["high_freq_factor"] <= rope["low_freq_factor"]:
        wrong.append(f"rope_parameters' high_freq_factor {rope['high_freq_factor']} must be greater than its "
                     f"low_freq_factor {rope['low_freq_factor']}")
    return wrong


def _counts(family: Family) -> dict[str, Callable]:
    if family.layout == "gpt2":
        return dict(vocab_size=positive_int, n_positions=positive_int, n_embd=positive_int, n_layer=positive_int,
                    n_head=positive_int, n_inner=optional_positive_int, layer_norm_epsilon=positive,
                    resid_pdrop=fraction, attn_pdrop=fraction, embd_pdrop=fraction, initializer_range=positive,
                    tie_word_embeddings=boolean)
    return dict(vocab_size=positive_int, hidden_size=positive_int, intermediate_size=positive_int,
                num_hidden_layers=positive_int, num_attention_heads=positive_int, num_key_value_heads=positive_int,
                max_position_embeddings=positive_int, rms_norm_eps=positive, initializer_range=positive,
                attention_dropout=fraction, tie_word_embeddings=boolean, head_dim=optional_positive_int,
                sliding_window=optional_positive_int)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_counts(raw: dict, family: Family, where: str) -> None:
    """Refuse, in one paragraph, ``config.json`` values of the honoured counts and rates that are not valid
    (checked on the JSON, before transformers' config class divides by them)."""
    checks = _counts(family)
    wrong = []
    for key, value in raw.items():
        name = family.aliases.get(key, key)
        off = name == "sliding_window" and value is not None and value == family.window_off
        must = checks[name](value) if name in checks and not off else None
        if must:
            wrong.append(f"{key} {_shown(value)} must {must}")
    if wrong:
        raise UserError(f"{where}: config.json has {'; '.join(wrong)}. Nothing was loaded or written.")


def check_fields(c, family: Family, where: str) -> None:
    """Refuse, in one paragraph naming every offending field and value, a config (transformers' object of
    ``family``'s class) with an honoured field whose value is invalid, a quantization, or a refused field at
    a value tnlg does not compute. ``where`` names the folder or model."""
    def value(name):  # (a class's own "no window" value reads as none)
        v = getattr(c, name, None)
        return None if name == "sliding_window" and v is not None and v == family.window_off else v
    wrong = [f"{name} {_shown(getattr(c, name, None))} must {must}" for name, check in _counts(family).items()
             if (must := check(value(name)))]
    rope_layout = family.layout == "llama"
    if rope_layout and not wrong and c.num_attention_heads % c.num_key_value_heads:
        wrong.append(f"num_key_value_heads {c.num_key_value_heads} must divide num_attention_heads "
                     f"{c.num_attention_heads}")
    if getattr(c, "quantization_config", None) is not None:
        wrong.append("quantization_config is set (quantized weights and their scales are not read; give the "
                     "unquantized model)")
    rope = getattr(c, "rope_parameters", None)
    if rope_layout and not (isinstance(rope, dict) and positive(rope.get("rope_theta")) is None):
        wrong.append(f"rope_parameters {_shown(rope)} must hold a positive rope_theta")
    elif rope_layout:  # the parameters transformers' rope computes with (a top-level pretraining length first)
        used, inner = rope_parameters_in(c), rope if isinstance(rope, dict) else {}
        top_level = frozenset(k for k in used if k not in inner or used[k] is not inner[k])
        wrong += _rope_wrong(used, rope_type_of(used), top_level)
    if not wrong:  # the refused fields' tests need valid counts
        told = set()
        for name, (accepts, why) in family.refused.items():
            if accepts(c) or why in told:
                continue
            told.add(why)
            wrong.append(f"{name} {_shown(getattr(c, name, None))}: {why}")
        if family.window == "layer_types" and not _windowed_layers_have_a_window(c):
            wrong.append(f"layer_types {_shown(c.layer_types)} with use_sliding_window "
                         f"{_shown(getattr(c, 'use_sliding_window', None))}: {NO_WINDOW}")
    if wrong:
        raise UserError(f"{where}: config.json has {'; '.join(wrong)}. Nothing was loaded or written.")
