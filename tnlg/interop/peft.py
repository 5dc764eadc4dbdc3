"""PEFT's LoRA names for the families tnlg reads, and PEFT's adapter folder in and out.

PEFT names an adapted module by transformers' module name; tnlg's layer holding it, and which *part* of a
fused layer it is (:class:`tnlg.adapters.lora.LoraLinear`), per family layout:

=============  =====================================  ====================================================
layout         PEFT module (per layer)                tnlg layer (part)
=============  =====================================  ====================================================
``gpt2``       ``attn.c_attn``, ``attn.c_proj``,      the same names (GPT-2's ``c_attn`` is one adapter on the
               ``mlp.c_fc``, ``mlp.c_proj``           fused QKV; its ``B`` rows ``[q|k|v]`` are tnlg's per head)
``llama``      ``self_attn.q_proj``                   ``attn.c_q``; full multi-head: ``attn.c_attn`` (q)
               ``self_attn.k_proj`` / ``v_proj``      ``attn.c_kv`` (k / v); full multi-head: ``attn.c_attn``
               ``self_attn.o_proj``                   ``attn.c_proj``
               ``mlp.gate_proj`` / ``up_proj``        ``mlp.c_fc`` (gate / up)
               ``mlp.down_proj``                      ``mlp.c_proj``
=============  =====================================  ====================================================

``target_modules`` are matched as PEFT matches a list: a module whose name ends with a target (so GPT-2's
``c_proj`` is both the attention's and the MLP's); ``all-linear`` is every one of them (PEFT's, less the LM
head). The default is PEFT's for the family (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``:
``c_attn`` for GPT-2, ``q_proj, v_proj`` for the Llama layout).

The folder (PEFT's ``save_pretrained``): ``adapter_config.json`` (``peft_type`` ``LORA``, ``r``,
``lora_alpha``, ``lora_dropout``, ``use_rslora``, ``target_modules``, ``fan_in_fan_out`` for GPT-2's
``Conv1D``, ``bias`` ``none``) and ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..config import GPTConfig
from ..errors import UserError

__all__ = ["PEFT_MODULES", "DEFAULT_TARGETS", "lora_sites", "resolve_targets", "check_lora_rank",
           "peft_adapter_state", "write_peft_folder", "read_peft_folder", "tnlg_adapter_state", "CONFIG_NAME",
           "WEIGHTS_NAME", "layout_of", "check_adapter_options", "add_lora", "save_peft_adapter", "load_peft_adapter",
           "weight_deltas", "merged_weights", "check_adapter_fits", "merge_peft_adapter", "merge_lora_checkpoint",
           "factor_targets"]

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"

# PEFT's module names per layout, in a layer's order
PEFT_MODULES = {"gpt2": ("c_attn", "c_proj", "c_fc"),
                "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
DEFAULT_TARGETS = {"gpt2": ("c_attn",), "llama": ("q_proj", "v_proj")}
_HF_PATH = {"gpt2": {"attn.c_attn": "attn.c_attn", "attn.c_proj": "attn.c_proj", "mlp.c_fc": "mlp.c_fc",
                     "mlp.c_proj": "mlp.c_proj"},
            "llama": {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                      "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                      "down_proj": "mlp.down_proj"}}
_LAYER_PREFIX = {"gpt2": "transformer.h", "llama": "model.layers"}


def _layer_slots(cfg: GPTConfig, layout: str) -> dict[str, tuple[str, int, int]]:
    """PEFT module (layer-relative HF path) -> (tnlg layer path in a block, part index, part count)."""
    if layout == "gpt2":
        return {"attn.c_attn": ("attn.c_attn", 0, 1), "attn.c_proj": ("attn.c_proj", 0, 1),
                "mlp.c_fc": ("mlp.c_fc", 0, 1), "mlp.c_proj": ("mlp.c_proj", 0, 1)}
    grouped = cfg.kv_groups != cfg.num_attention_heads
    attn = ({"q_proj": ("attn.c_q", 0, 1), "k_proj": ("attn.c_kv", 0, 2), "v_proj": ("attn.c_kv", 1, 2)} if grouped
            else {"q_proj": ("attn.c_attn", 0, 3), "k_proj": ("attn.c_attn", 1, 3), "v_proj": ("attn.c_attn", 2, 3)})
    return {**attn, "o_proj": ("attn.c_proj", 0, 1), "gate_proj": ("mlp.c_fc", 0, 2), "up_proj": ("mlp.c_fc", 1, 2),
            "down_proj": ("mlp.c_proj", 0, 1)}


def _matches(module: str, targets: Sequence[str]) -> bool:
    return any(module == t or module.endswith("." + t) for t in targets)


def resolve_targets(targets: Optional[Sequence[str]], layout: str, what: str = "--lora-target-modules") -> tuple[str, ...]:
    """The target names checked against the family's (PEFT's default when ``targets`` is empty or ``None``;
    ``all-linear``: every one); a :class:`UserError` naming an unknown one and those the family has."""
    names = PEFT_MODULES[layout]
    if not targets:
        return DEFAULT_TARGETS[layout]
    targets = tuple(t for item in targets for t in str(item).split(",") if t)
    if targets == ("all-linear",):
        return names
    unknown = [t for t in targets if not any(_matches(m, [t]) or m == t for m in _HF_PATH[layout].values())
               and t not in names]
    if unknown:
        raise UserError(f"{what} names {', '.join(map(repr, unknown))}, which this model does not have: its "
                        f"{'GPT-2' if layout == 'gpt2' else 'Llama-layout'} linear layers are "
                        f"{', '.join(names)} (PEFT's names; or all-linear for every one). Nothing was run.")
    return targets


def lora_sites(layer_names: Iterable[str], cfg: GPTConfig, layout: str,
               targets: Sequence[str]) -> dict[str, tuple[Optional[str], ...]]:
    """Every adapted tnlg layer of the blocks ``layer_names`` (``transformer.h.N``: a pipeline stage's own) ->
    its parts' PEFT names (``None``: a part not adapted), for :func:`tnlg.adapters.lora.apply_lora`."""
    slots = _layer_slots(cfg, layout)
    sites: dict[str, list] = {}
    for block in layer_names:
        for hf_path, (path, index, count) in slots.items():
            if _matches(_HF_PATH[layout].get(hf_path, hf_path), targets) or _matches(hf_path, targets):
                parts = sites.setdefault(f"{block}.{path}", [None] * count)
                parts[index] = hf_path.rsplit(".", 1)[-1]
    return {k: tuple(v) for k, v in sites.items()}


def check_lora_rank(rank, cfg: GPTConfig, targets: Sequence[str], layout: str, flag: str = "--lora-rank") -> None:
    """A rank of at least 1 and at most the narrowest adapted layer's width (``min(in, out)`` of each part:
    above it the low-rank update is no longer low rank, and PEFT's would not be either); one paragraph."""
    if not isinstance(rank, int) or rank < 1:
        raise UserError(f"{flag} must be a positive integer (the adapters' rank), got {rank!r}. Nothing was run.")
    widths = _part_widths(cfg, layout)
    chosen = {t: w for t, w in widths.items() if _matches(_HF_PATH[layout].get(t, t), targets) or _matches(t, targets)}
    narrow = min(chosen.items(), key=lambda kv: kv[1])
    if rank > narrow[1]:
        raise UserError(f"{flag} {rank} is above the width of {narrow[0]} ({narrow[1]}: the smaller of its input "
                        f"and output features); a rank of 1 to {narrow[1]} is a low-rank update of every targeted "
                        f"layer ({', '.join(chosen)}). Nothing was run.")


def _part_widths(cfg: GPTConfig, layout: str) -> dict[str, int]:
    h, d, ffn = cfg.hidden_size, cfg.head_dim, cfg.ffn_hidden_size or 4 * cfg.hidden_size
    heads, groups = cfg.num_attention_heads, cfg.kv_groups
    if layout == "gpt2":
        return {"attn.c_attn": min(h, 3 * heads * d), "attn.c_proj": min(heads * d, h), "mlp.c_fc": min(h, ffn),
                "mlp.c_proj": min(ffn, h)}
    return {"q_proj": min(h, heads * d), "k_proj": min(h, groups * d), "v_proj": min(h, groups * d),
            "o_proj": min(heads * d, h), "gate_proj": min(h, ffn), "up_proj": min(h, ffn), "down_proj": min(ffn, h)}


# --------------------------------------------------------------------------- PEFT's folder

_TNLG_FACTOR = re.compile(r"^transformer\.h\.(\d+)\.(.+)\.lora_([AB])_(\w+)$")


def _qkv_rows(t: torch.Tensor, heads: int, to_per_head: bool) -> torch.Tensor:
    """GPT-2's fused QKV rows: ``[q|k|v]`` (transformers) <-> ``[head][q, k, v][d]`` (tnlg)."""
    rest = t.shape[1:]
    if to_per_head:
        return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def peft_adapter_state(full: dict[str, torch.Tensor], cfg: GPTConfig, layout: str) -> dict[str, torch.Tensor]:
    """PEFT's keys and tensors of tnlg's full (unsplit) adapter factors ``full`` (``...lora_A_<part>``)."""
    out = {}
    for name, t in full.items():
        m = _TNLG_FACTOR.match(name)
        if m is None:
            raise ValueError(f"not an adapter factor: {name}")
        layer, path, factor, part = m.groups()
        module = part if layout == "llama" else path
        if layout == "gpt2" and path == "attn.c_attn" and factor == "B":
            t = _qkv_rows(t, cfg.num_attention_heads, to_per_head=False)
        hf = f"{_LAYER_PREFIX[layout]}.{layer}.{_HF_PATH[layout][module]}"
        out[f"base_model.model.{hf}.lora_{factor}.weight"] = t.contiguous()
    return out


def factor_targets(names: Iterable[str], layout: str) -> tuple[str, ...]:
    """PEFT's module names of the adapters whose tnlg factor names are ``names`` (``...lora_A_<part>``), as
    :func:`add_lora` takes them: the Llama layout's parts (``q_proj``), GPT-2's layer paths (``attn.c_proj``: not
    ``mlp.c_proj``)."""
    out = set()
    for n in names:
        m = _TNLG_FACTOR.match(n)
        if m is None:
            raise ValueError(f"not an adapter factor: {n}")
        out.add(m.group(4) if layout == "llama" else m.group(2))
    return tuple(sorted(out))


def tnlg_adapter_state(peft_sd: dict[str, torch.Tensor], cfg: GPTConfig, layout: str,
                       where: str) -> dict[str, torch.Tensor]:
    """tnlg's full adapter factors of PEFT's keys (the inverse of :func:`peft_adapter_state`)."""
    slots = _layer_slots(cfg, layout)
    by_hf = {_HF_PATH[layout][k]: k for k in _HF_PATH[layout]}
    pattern = re.compile(r"^base_model\.model\." + re.escape(_LAYER_PREFIX[layout]) + r"\.(\d+)\.(.+)\.lora_([AB])\.weight$")
    out = {}
    for key, t in peft_sd.items():
        m = pattern.match(key)
        if m is None or m.group(2) not in by_hf:
            raise UserError(f"{where} holds {key!r}, which is no LoRA factor of a linear layer of this model "
                            f"({_LAYER_PREFIX[layout]}.N.<{', '.join(_HF_PATH[layout].values())}>.lora_A/B.weight). "
                            "Nothing was loaded.")
        layer, hf_path, factor = m.groups()
        module = by_hf[hf_path]
        path, _, _ = slots[module]
        part = module.rsplit(".", 1)[-1]
        if layout == "gpt2" and path == "attn.c_attn" and factor == "B":
            t = _qkv_rows(t, cfg.num_attention_heads, to_per_head=True)
        out[f"transformer.h.{layer}.{path}.lora_{factor}_{part}"] = t.detach().float().contiguous()
    return out


def write_peft_folder(out_dir: str, full: dict[str, torch.Tensor], cfg: GPTConfig, layout: str, *, rank: int,
                      alpha: float, dropout: float, use_rslora: bool, base_model: Optional[str] = None) -> None:
    """PEFT's ``save_pretrained`` folder of tnlg's full adapter factors ``full``."""
    from safetensors.torch import save_file
    state = peft_adapter_state(full, cfg, layout)
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, lora_dropout=dropout,
                  use_rslora=use_rslora, target_modules=modules, fan_in_fan_out=layout == "gpt2", bias="none",
                  base_model_name_or_path=base_model, inference_mode=True, init_lora_weights=True,
                  modules_to_save=None, use_dora=False, rank_pattern={}, alpha_pattern={}, layers_to_transform=None)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(out_dir, WEIGHTS_NAME))


# PEFT's LoraConfig fields whose non-default values change what the adapter computes, and tnlg does not build
_REFUSED: dict[str, tuple] = {
    "use_dora": (False, None), "modules_to_save": (None, []), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
    "bias": ("none",), "layers_to_transform": (None,), "lora_bias": (False,), "fan_in_fan_out": (),
    "use_qalora": (False, None), "trainable_token_indices": (None,), "layer_replication": (None,),
    "exclude_modules": (None,)}


def read_peft_folder(path: str, cfg: GPTConfig, layout: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(settings, full factors)`` of PEFT's adapter folder ``path``: ``settings`` holds ``rank``, ``alpha``,
    ``dropout``, ``use_rslora`` and ``targets``; a field PEFT uses that tnlg does not build (DoRA,
    ``modules_to_save``, per-layer ranks, biases) refused by name, in one paragraph."""
    where = f"the adapter folder {path}"
    cfg_file, weights = os.path.join(path, CONFIG_NAME), os.path.join(path, WEIGHTS_NAME)
    if not (os.path.isfile(cfg_file) and os.path.isfile(weights)):
        raise UserError(f"{where} needs {CONFIG_NAME} and {WEIGHTS_NAME} (PEFT's save_pretrained). Nothing was loaded.")
    with open(cfg_file) as f:
        conf = json.load(f)
    if conf.get("peft_type") != "LORA":
        raise UserError(f"{where} is a {conf.get('peft_type')!r} adapter; tnlg reads LORA adapters. Nothing was loaded.")
    for field, accepted in _REFUSED.items():
        if field not in conf:
            continue
        value = conf[field]
        if field == "fan_in_fan_out":
            if value != (layout == "gpt2"):
                raise UserError(f"{where} sets fan_in_fan_out {value}, which this model's layers are not "
                                f"({'Conv1D' if layout == 'gpt2' else 'nn.Linear'}). Nothing was loaded.")
            continue
        if value not in accepted:
            raise UserError(f"{where} sets {field}={value!r}: tnlg builds plain LoRA adapters (no DoRA, no "
                            "modules_to_save, one rank and alpha for every layer, no biases, every layer); "
                            f"{field} must be {accepted[0]!r}. Nothing was loaded.")
    from safetensors.torch import load_file
    full = tnlg_adapter_state(load_file(weights), cfg, layout, where)
    ranks = {t.shape[0] for n, t in full.items() if "lora_A_" in n}
    if ranks != {conf.get("r")}:
        raise UserError(f"{where}: its factors have ranks {sorted(ranks)}, its config r={conf.get('r')}. "
                        "Nothing was loaded.")
    targets = conf.get("target_modules") or []
    if isinstance(targets, str):
        raise UserError(f"{where}: target_modules is the pattern {targets!r}; tnlg reads a list of module names. "
                        "Nothing was loaded.")
    settings = dict(rank=int(conf["r"]), alpha=float(conf.get("lora_alpha", 8)),
                    dropout=float(conf.get("lora_dropout", 0.0)), use_rslora=bool(conf.get("use_rslora", False)),
                    targets=tuple(targets))
    return settings, full


# --------------------------------------------------------------------------- a model's adapters in and out

def layout_of(cfg: GPTConfig, recorded: Optional[str] = None) -> str:
    """The PEFT naming of ``cfg``'s Hugging Face family (``gpt2`` or ``llama``: :mod:`.families`); an architecture
    no family computes is named as the layout its layers have (``llama``: SwiGLU or grouped-query attention)."""
    from .families import family_of
    try:
        return family_of(cfg, recorded).layout
    except UserError:
        return "llama" if cfg.swiglu or cfg.kv_groups != cfg.num_attention_heads else "gpt2"


def check_adapter_options(a, cfg: GPTConfig) -> None:
    """``--lora-target-modules`` the model has and a ``--lora-rank`` each targeted layer can take (``a``: the run's
    :class:`~tnlg.options.components.AdapterOptions`); one paragraph, before any process starts."""
    if a.load_adapter is not None:  # the folder read and checked against the model's layers (built on meta)
        from ..model import GPT
        from ..parallel.state import ParallelState
        load_peft_adapter(GPT(cfg, ParallelState.single(), device="meta"), a.load_adapter)
    if a.lora_rank is None:
        return
    layout = layout_of(cfg)
    check_lora_rank(a.lora_rank, cfg, resolve_targets(a.lora_target_modules, layout), layout)


def add_lora(model, settings, targets: Optional[Sequence[str]] = None, recorded: Optional[str] = None) -> list[str]:
    """Freeze ``model`` (a :class:`tnlg.GPT` or a pipeline stage) and add adapters on PEFT's ``targets`` (checked;
    default: PEFT's for the family) of its own layers; the rank checked against every targeted layer's width.
    Returns the wrapped layers' names."""
    from ..adapters.lora import apply_lora
    cfg = model.config
    layout = layout_of(cfg, recorded)
    chosen = resolve_targets(targets, layout)
    check_lora_rank(settings.rank, cfg, chosen, layout)
    blocks = sorted({n.rsplit(".", 1)[0] for n, _ in model.named_modules() if re.fullmatch(r"transformer\.h\.\d+\.attn", n)})
    return apply_lora(model, settings, lora_sites(blocks, cfg, layout, chosen), head_dim=cfg.head_dim)


def save_peft_adapter(model, out_dir: str, settings, recorded: Optional[str] = None,
                      base_model: Optional[str] = None) -> None:
    """PEFT's adapter folder of ``model``'s adapters (gathered over TP, over DP under ZeRO 3 and over the pipeline's
    stages: collective; the first rank writes)."""
    from ..adapters.lora import adapter_parameters
    from ..parallel.sharding import gather_full
    ps = model.ps
    full = {}
    for n, p in adapter_parameters(model).items():
        local = p.detach()
        if hasattr(local, "full_tensor"):  # ZeRO 3 (FSDP2): this TP rank's shard, gathered over DP first
            local = local.full_tensor()
        full[n] = gather_full(local, p, ps).float()
    if ps.pp_size > 1:  # every pipeline stage's layers (small: the adapters alone), to the first rank
        import torch.distributed as dist
        stages: list = [None] * ps.pp_size
        dist.all_gather_object(stages, full, group=ps.pp_group)
        full = {n: t for stage in stages for n, t in stage.items()}
    if ps.rank == 0:
        write_peft_folder(out_dir, full, model.config, layout_of(model.config, recorded), rank=settings.rank,
                          alpha=settings.alpha, dropout=settings.dropout, use_rslora=settings.use_rslora,
                          base_model=base_model)


@torch.no_grad()
def load_peft_adapter(model, path: str, recorded: Optional[str] = None):
    """Add the adapters of PEFT's folder ``path`` to ``model`` (frozen) with its factors (this rank's slices);
    returns their :class:`~tnlg.adapters.lora.LoraSettings`. A factor whose shape differs from the model's
    layer is refused in one paragraph."""
    from ..adapters.lora import LoraSettings, adapter_parameters
    from ..parallel.sharding import ShardSpec, shard_of
    cfg = model.config
    layout = layout_of(cfg, recorded)
    conf, full = read_peft_folder(path, cfg, layout)
    settings = LoraSettings(conf["rank"], conf["alpha"], conf["dropout"], conf["use_rslora"])
    add_lora(model, settings, factor_targets(full, layout), recorded)  # (the folder's factors' modules)
    params = adapter_parameters(model)
    for name, p in params.items():
        if name not in full:  # a layer or part the folder does not adapt: zeros, it adds nothing
            p.zero_()
            continue
        spec = ShardSpec.of(p)
        if tuple(full[name].shape) != tuple(spec.shape):
            raise UserError(f"the adapter folder {path}: {name} is {tuple(full[name].shape)}, this model's layer takes "
                            f"{tuple(spec.shape)} (another base model?). Nothing was loaded.")
        p.copy_(shard_of(full[name], p, model.ps.tp_rank))
    return settings



# --------------------------------------------------------------------------- merging

def weight_deltas(full: dict[str, torch.Tensor], cfg: GPTConfig, layout: str,
                  scaling: float) -> dict[str, Callable[..., torch.Tensor]]:
    """For each weight the adapters ``full`` (tnlg's full factors) change: a function ``delta(shape, spec=None,
    tp_rank=0)`` of the weight's full shape giving ``scaling * B A`` (float64) in tnlg's layout (the fused QKV's
    parts per head, key/value per group, the gate/up pair stacked; a part without an adapter adds nothing); with
    ``spec`` (the weight's :class:`~tnlg.parallel.sharding.ShardSpec`) only TP rank ``tp_rank``'s shard of it,
    computed from that rank's rows of ``B`` (or, split by input columns, its columns of ``A``), never the whole
    delta. What :func:`merged_weights` (a checkpoint's full weights) and :func:`merge_peft_adapter` (a loaded
    model's shards) add.

    Every layout is one product: the parts' ``A`` stacked ``[P r, in]``, and ``B`` laid out as the weight's rows
    ``[*shape[:-1], P r]``, part ``i``'s rows holding its ``B`` in columns ``i r .. (i + 1) r`` and zeros elsewhere
    (exact zeros: each row is its own part's ``B A``)."""
    slots = _layer_slots(cfg, layout)
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    counts: dict[str, int] = {}
    for name in full:
        m = _TNLG_FACTOR.match(name)
        if m is None or m.group(3) != "A":
            continue
        layer, path, _, part = m.groups()
        key = next(k for k, (p, _, _) in slots.items() if p == path and k.rsplit(".", 1)[-1] == part)
        _, index, count = slots[key]
        site = f"transformer.h.{layer}.{path}.weight"
        layers.setdefault(site, {})[index] = (full[name], full[name[:-len(f"lora_A_{part}")] + f"lora_B_{part}"])
        counts[site] = count

    def b_rows(site: str, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B laid out as the weight's rows [*shape[:-1], P r], A stacked [P r, in])``, float64."""
        parts, count = layers[site], counts[site]
        present = sorted(parts)
        r = parts[present[0]][0].shape[0]
        a = torch.cat([parts[i][0].double() for i in present])
        if count == 1:
            return parts[0][1].double().reshape(*shape[:-1], r), a
        rows = torch.zeros(*shape[:-1], len(present) * r, dtype=torch.float64)
        for j, i in enumerate(present):
            b, cols = parts[i][1].double(), slice(j * r, (j + 1) * r)
            if site.endswith("mlp.c_fc.weight"):  # [2, f, in]: gate, up
                rows[i, :, cols] = b
            elif len(shape) == 4:  # [G, 2, d, in]: key, value per group
                rows[:, i, :, cols] = b.view(shape[0], shape[2], r)
            else:  # [H 3 d, in]: q, k, v per head
                rows.view(-1, 3, cfg.head_dim, len(present) * r)[:, i, :, cols] = b.view(-1, cfg.head_dim, r)
        return rows, a

    def delta_of(site: str) -> Callable[..., torch.Tensor]:
        def delta(shape: tuple, spec=None, tp_rank: int = 0) -> torch.Tensor:
            shape = tuple(shape)
            rows, a = b_rows(site, shape)
            if spec is not None and spec.dim is not None:  # this rank's rows of B, or its input columns of A
                start, size = spec.start(tp_rank), spec.sizes[tp_rank]
                if spec.dim == len(shape) - 1:
                    a = a.narrow(1, start, size)
                else:
                    rows = rows.narrow(spec.dim, start, size)
            return scaling * (rows @ a)
        return delta

    return {site: delta_of(site) for site in layers}


def merged_weights(full: dict[str, torch.Tensor], cfg: GPTConfig, layout: str,
                   scaling: float) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """For each weight the adapters ``full`` change: a function of the base's full weight giving
    ``W + scaling * B A`` in tnlg's layout (:func:`weight_deltas`), in the weight's dtype."""
    deltas = weight_deltas(full, cfg, layout, scaling)

    def merge(delta: Callable[[tuple], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda w: (w.double() + delta(tuple(w.shape))).to(w.dtype)
    return {site: merge(delta) for site, delta in deltas.items()}


def _scaling(conf: dict) -> float:
    """PEFT's ``lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA) of :func:`read_peft_folder`'s settings."""
    return conf["alpha"] / (conf["rank"] ** 0.5 if conf["use_rslora"] else conf["rank"])


def check_adapter_fits(cfg: GPTConfig, path: str, recorded: Optional[str] = None) -> None:
    """PEFT's folder ``path`` is an adapter of a model of ``cfg``: its settings tnlg builds, its target modules and
    layers ones the model has, every factor the shape of the model's layer (checked on a model built on meta: no
    weights); one paragraph, before any process does work."""
    from ..adapters.lora import adapter_parameters
    from ..model import GPT
    from ..parallel.state import ParallelState
    model = GPT(cfg, ParallelState.single(), device="meta")
    load_peft_adapter(model, path, recorded)
    _, full = read_peft_folder(path, cfg, layout_of(cfg, recorded))
    extra = sorted(set(full) - set(adapter_parameters(model)))
    if extra:
        raise UserError(f"the adapter folder {path} adapts {extra[0]}, a layer this model ({cfg.num_layers} layers) "
                        "does not have (another base model?). Nothing was loaded.")


@torch.no_grad()
def merge_peft_adapter(model, path: str, recorded: Optional[str] = None) -> dict:
    """Merge PEFT's adapter folder ``path`` into ``model``'s weights in place (a :class:`tnlg.GPT` or a pipeline
    stage at any TP: each rank adds its shard of ``scaling * B A``, computed from its slice of the factors alone, to
    its shard of each adapted weight, in float64, then back to the weight's dtype; a stage the layers it holds). No
    collectives. Returns the folder's settings
    (:func:`read_peft_folder`). A folder that does not fit the model is refused in one paragraph
    (:func:`check_adapter_fits`; the launching process runs it first)."""
    from ..parallel.sharding import ShardSpec
    cfg = model.config
    check_adapter_fits(cfg, path, recorded)
    conf, full = read_peft_folder(path, cfg, layout_of(cfg, recorded))
    deltas = weight_deltas(full, cfg, layout_of(cfg, recorded), _scaling(conf))
    params = dict(model.named_parameters())
    for site, delta in deltas.items():
        p = params.get(site)
        if p is None:  # another pipeline stage's layer
            continue
        spec = ShardSpec.of(p)  # this rank's shard of the delta only (B's rows or A's columns it needs)
        local = delta(spec.shape, spec, model.ps.tp_rank).to(p.device)
        p.copy_((p.double() + local).to(p.dtype))
    return conf


def merge_lora_checkpoint(src: str, adapter_dir: str, dst: str, dst_kind: str = "ckpt", tp_size: int = 1,
                          tokenizer_model=None, with_tokenizer: bool = True) -> str:
    """A tnlg checkpoint ``src`` with PEFT's adapter ``adapter_dir`` merged into its weights: a new tnlg checkpoint
    (iteration 0, weights only) at TP ``tp_size`` (``dst_kind`` ``ckpt``: each merged weight built when written,
    one at a time) or a Hugging Face folder (``hf``; with ``with_tokenizer``, the checkpoint's tokenizer or
    ``tokenizer_model`` beside it, as ``tnlg convert --to hf`` writes it)."""
    from ..checkpoint import files as F
    from ..checkpoint.manifest import Layout, OptimizerState
    from ..checkpoint.offline import open_source
    from ..checkpoint.reshard import ShardReader, full_targets
    iter_dir, manifest, cfg = open_source(src)
    recorded = (manifest.converted_from or {}).get("model_type")
    layout = layout_of(cfg, recorded if isinstance(recorded, str) else None)
    conf, full = read_peft_folder(adapter_dir, cfg, layout)
    merges = merged_weights(full, cfg, layout, _scaling(conf))
    reader = ShardReader(iter_dir, manifest, F.model_file)
    wanted = full_targets(manifest)
    for site in merges:
        if site not in wanted:
            raise UserError(f"the adapter folder {adapter_dir} adapts {site}, which checkpoint {iter_dir!r} does not "
                            "have (another base model?). Nothing was written.")
        shape = tuple(wanted[site]["shape"])
        a_shape = next(t.shape for n, t in full.items() if n.startswith(site[:-len("weight")]) and "lora_A_" in n)
        if a_shape[1] != shape[-1]:
            raise UserError(f"the adapter folder {adapter_dir}: the factors of {site} take {a_shape[1]} input features, "
                            f"the checkpoint's layer {shape[-1]} (another base model?). Nothing was written.")

    def tensor(name: str) -> torch.Tensor:
        t = reader.tensor(name, name, wanted[name])
        return merges[name](t) if name in merges else t

    if dst_kind == "hf":
        from .hf import build_hf_model, write_hf_folder
        from .hf_checkpoint import _export_tokenizer
        from ..data.hf_tokenizer import hf_tokenizer_files
        tok = _export_tokenizer(manifest, cfg, tokenizer_model) if with_tokenizer else None
        files = None if tok is None else hf_tokenizer_files(tok, cfg.seq_length)
        hf = build_hf_model({n: tensor(n) for n in wanted}, cfg, None if tok is None else tok.eod_id,
                            where=f"checkpoint {iter_dir!r}", family=recorded if isinstance(recorded, str) else None)
        return write_hf_folder(hf, dst, files)
    merged = manifest.replace(iteration=0, consumed_samples=0, optimizer=OptimizerState(), schedule=None, options={},
                              layout=Layout(param_dtype=manifest.layout.param_dtype),
                              converted_from=dict(manifest.converted_from or {}, merged_lora=os.path.abspath(adapter_dir)))
    return _write_merged(dst, merged, cfg, tp_size, tensor)


def _write_merged(dst: str, manifest, cfg: GPTConfig, tp_size: int, tensor: Callable[[str], torch.Tensor]) -> str:
    """The merged weights (``tensor(name)``: one full merged weight, built when looked up) written as a tnlg
    checkpoint at TP ``tp_size`` (:func:`merge_lora_checkpoint`), each TP rank's shard sliced when written."""
    from ..checkpoint.offline import write_converted
    from ..checkpoint.reshard import slice_full, targets_for
    from ..model import GPT
    tp_layout = GPT.describe(cfg, tp_size)

    class _Merged(Mapping):
        def __init__(self, targets):
            self.targets = targets

        def __getitem__(self, name):
            return slice_full(tensor(name), self.targets[name])

        def __iter__(self):
            return iter(self.targets)

        def __len__(self):
            return len(self.targets)

    return write_converted(dst, manifest, cfg, tp_size, lambda r, names: (_Merged(targets_for(tp_layout, r)), None),
                           layout=tp_layout)
