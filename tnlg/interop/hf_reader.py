"""Reading a Hugging Face ``save_pretrained`` folder into tnlg: the rule is that a folder either loads
into exactly the model transformers computes from it, or is refused in one paragraph naming what is
unsupported, before anything is written (docs/hf.md, "What tnlg reads").

:func:`check_hf_folder` decides from ``config.json`` and the weight files' headers alone (no tensor data;
the launcher of ``tnlg generate`` / ``tnlg eval`` calls it before any worker starts), in this order:

1. ``config.json``: JSON of at most 16 MiB, a ``model_type`` tnlg reads; a scaled rope or a
   ``quantization_config`` refused by name.
2. The weight files (:func:`tnlg.interop.hf_files.weight_files`): every tensor's name, dtype and shape.
3. The layer count ``config.json`` claims against the layers the files hold, before transformers builds
   the config (a 20,000-layer claim in a 2-layer folder is refused at once, not built).
4. transformers' own config class built from the JSON (its defaults and checks), then every field
   checked (:func:`tnlg.interop.hf_fields.check_fields`: honoured, ignored or refused) and mapped to a
   :class:`~tnlg.config.GPTConfig`.
5. The names and shapes transformers' class expects (the model built on the ``meta`` device, no memory)
   against the files': a tensor the files lack (which ``from_pretrained`` would initialise at random), one
   the model has no place for, or one of another shape is refused, naming it. Names saved without the
   base model's prefix (``h.0...`` for ``transformer.h.0...``, as in OpenAI's GPT-2 folder) are read
   with it, as transformers reads them.

:func:`open_hf_folder` then gives tnlg's state dict lazily (:class:`HFTensors`: each tnlg tensor read and
built from its own Hugging Face tensors when looked up; ``tnlg convert`` writes shards from it one tensor
at a time), :func:`read_hf_folder` all of it at once. A tied config (``tie_word_embeddings``) whose files
hold an ``lm_head.weight`` unlike the embedding loads untied, as transformers 5 does ("will NOT tie them").
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from ..config import GPTConfig
from ..errors import UserError
from .families import Family, family_named
from .hf_fields import ROPE_TYPES, check_counts, check_fields
from .hf_files import WeightFiles, inside, weight_files
from .hf_llama import rope_type_of, saved_spelling
from .hf_mapping import build_tensor, config_from_hf, tnlg_recipes
from .megatron.safe_load import reason, shown

__all__ = ["HFFolder", "HFTensors", "check_hf_folder", "open_hf_folder", "read_hf_folder"]

# tensors old files hold that transformers skips (GPT-2's causal-mask buffers, Llama's rope frequencies)
_SKIPPED = re.compile(r"\.attn\.(bias|masked_bias)$|\.rotary_emb\.inv_freq$")
_NOTHING = "Nothing was loaded or written."


class HFFolder(NamedTuple):
    """A checked folder: its family (``model_type``'s entry), transformers' config, tnlg's config, the weight
    files, and the file name of each tensor under the name transformers' model gives it."""
    family: Family
    hf_config: object
    cfg: GPTConfig
    files: WeightFiles
    names: dict


def _bad(folder: str, what: str) -> UserError:
    return UserError(f"Hugging Face folder {folder!r}: {what} {_NOTHING}")


def _raw_config(folder: str) -> dict:
    path = inside(folder, "config.json")
    try:
        if os.path.getsize(path) > 16 * 2**20:
            raise ValueError(f"{os.path.getsize(path)} bytes; a config is a few kB")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise _bad(folder, f"config.json cannot be read as JSON ({reason(exc)}).") from None
    if not isinstance(raw, dict):
        raise _bad(folder, f"config.json holds a {type(raw).__name__}, not a record of fields.")
    return raw


def _refused_by_name(folder: str, raw: dict) -> None:
    """What is refused by name before transformers reads the config: quantization and a rope_type tnlg does
    not compute."""
    if raw.get("quantization_config") is not None:
        method = raw["quantization_config"]
        method = method.get("quant_method") if isinstance(method, dict) else method
        raise _bad(folder, f"config.json has a quantization_config (quant_method {str(method)[:40]!r}): quantized "
                   "weights and their scales are not read by tnlg; give the unquantized model.")
    for key in ("rope_parameters", "rope_scaling"):
        rope = raw.get(key)
        kind = rope_type_of(rope) if isinstance(rope, dict) else None
        if kind is not None and kind not in ROPE_TYPES:
            raise _bad(folder, f"config.json's {key} has rope_type {str(kind)[:40]!r}, which tnlg does not compute "
                       f"(longrope and the others are not supported yet); tnlg computes rope_type "
                       f"{', '.join(ROPE_TYPES)}.")


def _prefixed(family: Family, names) -> dict:
    """``{transformers' name: file's name}``: names saved without the base model's prefix get it."""
    prefix = family.prefix + "."
    if any(n.startswith(prefix) for n in names):
        return {n: n for n in names}
    return {(n if n == "lm_head.weight" else prefix + n): n for n in names}


def _check_layers(folder: str, family: Family, raw: dict, names) -> None:
    """The layer count ``config.json`` claims (or the class's default) against the layers in the files."""
    import transformers
    key = next((k for k in family.layer_keys if k in raw), family.layer_keys[0])
    claimed = raw.get(key, getattr(getattr(transformers, family.config_class), key, None))
    pattern = re.compile(rf"^{family.prefix}\.{family.layers}\.(\d{{1,9}})\.")
    held = sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})
    if not isinstance(claimed, int) or isinstance(claimed, bool) or claimed < 1:
        raise _bad(folder, f"config.json's {key} is {shown(claimed)}; it must be a positive integer (the "
                   f"weight files hold {len(held)} layers).")
    if len(held) != claimed or held != list(range(claimed)):
        some: list = held if len(held) <= 6 else [*held[:3], "...", *held[-2:]]
        raise _bad(folder, f"config.json's {key} is {claimed}, but the weight files hold layers {some}; every "
                   f"layer 0 .. {claimed - 1} must be in the files (transformers would initialise a missing one "
                   "at random).")


def _hf_config(folder: str, family: Family, raw: dict):
    """transformers' config object of ``raw`` (its defaults, its own checks), or one paragraph."""
    import transformers
    cls = getattr(transformers, family.config_class)
    try:
        return cls.from_dict(dict(raw))
    except Exception as exc:  # noqa: BLE001 - transformers' checks raise many kinds; each is a bad field
        raise _bad(folder, f"config.json is not a valid {cls.__name__} ({reason(exc)}).") from None


def _expected(family: Family, hf_config) -> dict[str, tuple]:
    """Every tensor name and shape transformers' class holds for ``hf_config`` (built on ``meta``)."""
    import transformers
    try:
        with torch.device("meta"):
            model = getattr(transformers, family.model_class)(hf_config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build a model of (sizes past 2^63, ...)
        raise UserError(f"config.json describes a {family.model_class} that transformers cannot build "
                        f"({reason(exc)}). {_NOTHING}") from None
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def _compare(folder: str, family: Family, cfg: GPTConfig, expected: dict, files: WeightFiles, names: dict) -> None:
    present = {n for n in names if not _SKIPPED.search(n)}
    optional = {"lm_head.weight"} if not cfg.untie_embeddings_and_output_weights else set()
    missing = sorted(set(expected) - present - optional)
    unexpected = sorted(present - set(expected))
    wrong = [f"{n} {list(files.entries[names[n]].shape)} (the config gives {list(expected[n])})"
             for n in sorted(present & set(expected)) if files.entries[names[n]].shape != expected[n]]
    told = []
    if missing:
        told.append(f"{len(missing)} tensors the model needs are not in the files ({', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''}; transformers would initialise them at random)")
    if unexpected:
        told.append(f"{len(unexpected)} tensors have no place in the model the config describes "
                    f"({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''})")
    if wrong:
        told.append(f"{len(wrong)} tensors have another shape: {'; '.join(wrong[:3])}")
    if told:
        raise _bad(folder, f"its weight files do not match config.json's {family.model_class}: {'; '.join(told)}.")


def check_hf_folder(folder: str) -> HFFolder:
    """The checked folder (module docstring, steps 1-5), from ``config.json`` and the weight files'
    headers; no tensor data is read (a ``.bin`` is memory-mapped)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise UserError(f"Hugging Face model folder {folder!r} does not exist; give a folder written by "
                        "save_pretrained (config.json + model.safetensors).")
    raw = _raw_config(folder)
    family = family_named(raw.get("model_type"), f"Hugging Face folder {folder!r}")
    _refused_by_name(folder, raw)
    files = weight_files(folder)
    names = _prefixed(family, files.entries)
    _check_layers(folder, family, raw, names)
    where = f"Hugging Face folder {folder!r}"
    check_counts(raw, family, where)
    hf_config = _hf_config(folder, family, raw)
    check_fields(hf_config, family, where)
    try:
        cfg = config_from_hf(hf_config)
    except ValueError as exc:  # GPTConfig's checks across fields (heads dividing the width, ...)
        raise _bad(folder, f"config.json describes a model tnlg cannot build: {exc}") from None
    _compare(folder, family, cfg, saved_spelling(_expected(family, hf_config), family, names), files, names)
    return HFFolder(family, hf_config, cfg, files, names)


class HFTensors(Mapping):
    """tnlg's full state dict of a checked folder, built lazily: looking a name up reads only the Hugging
    Face tensors it is made of (:func:`~.hf_mapping.tnlg_recipes`; a safetensors or zip ``.bin`` file is
    memory-mapped) and builds the tnlg tensor from them, which the caller holds or lets go. Iterating
    gives the names without reading anything."""

    def __init__(self, found: HFFolder, cfg: GPTConfig):
        self.found = found
        self.recipes = tnlg_recipes([n for n in found.names if not _SKIPPED.search(n)], cfg)

    def read(self, hf_name: str) -> torch.Tensor:
        """One tensor of the files, by the name transformers' model gives it."""
        return self.found.files.tensor(self.found.names[hf_name])

    def __getitem__(self, name: str) -> torch.Tensor:
        recipe = self.recipes[name]
        return build_tensor(recipe, [self.read(s) for s in recipe.sources])

    def __iter__(self) -> Iterator[str]:
        return iter(self.recipes)

    def __len__(self) -> int:
        return len(self.recipes)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values (compared in their own dtype when they share one: no copy)."""
    return torch.equal(a, b) if a.dtype == b.dtype else torch.equal(a.float(), b.float())


def open_hf_folder(folder: str) -> tuple[GPTConfig, HFTensors]:
    """tnlg's config and lazy full state dict (:class:`HFTensors`) of a checked folder
    (:func:`check_hf_folder`); a tied config whose ``lm_head.weight`` differs from the embedding loads
    untied (those two tensors alone are read to tell)."""
    found = check_hf_folder(folder)
    cfg = found.cfg
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in found.names:
        head, wte = (found.files.tensor(found.names[n]) for n in ("lm_head.weight", found.family.embedding))
        if not _same_values(head, wte):
            cfg = config_from_hf(found.hf_config, untie_embeddings_and_output_weights=True)
    return cfg, HFTensors(found, cfg)


def read_hf_folder(folder: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """tnlg's config and full state dict of a checked folder (:func:`open_hf_folder`), every tensor read
    from the files and held."""
    cfg, tensors = open_hf_folder(folder)
    return cfg, dict(tensors)
