"""A LoRA run's checkpoint: its adapters and the run's state, on a frozen base named by its path and fingerprint.

A save of an adapter run (``tnlg finetune --lora-rank`` / ``--load-adapter``) is a tnlg checkpoint
(:func:`tnlg.checkpoint.save`) whose parameters are the adapters alone: their TP shards (each factor split or
replicated as :mod:`tnlg.adapters.lora` lays it out: :func:`adapter_layout`), the Adam moments and fp32 master
weights the engine holds for them, every rank's RNG states, the iteration, the samples consumed and the LR
schedule's position. The frozen base is not written again: the manifest's ``adapters`` section
(:func:`adapter_record`) holds the adapters' settings by PEFT's ``LoraConfig`` names (``rank``, ``alpha``,
``dropout``, ``use_rslora``, ``targets``) and the identity of the base checkpoint the run read (``--load``, or the
``SAVE/base`` a foreign ``--load`` was converted into): its resolved path and the fingerprint of its files
(:class:`tnlg.interop.sources.Source`: names, sizes and times, ``meta.json`` hashed).

A resume reads the base from ``--load`` again, then the adapters and the run's state into the engine, so it
continues as the uninterrupted run would, bit for bit (the layout may change, as for any checkpoint). Refused in
one paragraph before anything is loaded (:func:`check_adapter_resume`, in the launching process and again in the
workers): a base whose identity is not the recorded one (other weights, another model or shape, or gone), other
adapter settings, and an adapter run resumed from a checkpoint of full fine-tuning or the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..adapters.lora import LoraLinear, LoraSettings, adapter_parameters
from ..checkpoint.compat import ARCH_FIELDS, TRAINING_FIELDS
from ..checkpoint.manifest import Manifest
from ..config import GPTConfig
from ..errors import UserError
from ..interop.peft import add_lora, factor_targets, layout_of, load_peft_adapter
from ..parallel.sharding import ShardSpec
from ..parallel.state import ParallelState

__all__ = ["AdapterRun", "CheckpointView", "adapter_layout", "adapter_record", "planned_record", "base_identity",
           "check_adapter_resume", "settings_of_model", "targets_of"]

SETTINGS = ("rank", "alpha", "dropout", "use_rslora", "targets")  # recorded, and the same on resume


def settings_of_model(model) -> LoraSettings:
    """The settings of ``model``'s adapters (every adapted layer has the same)."""
    layer = next((m for m in model.modules() if isinstance(m, LoraLinear)), None)
    if layer is None:
        raise ValueError("the model has no adapters")
    return layer.settings


def targets_of(model) -> tuple[str, ...]:
    """PEFT's module names of ``model``'s adapted layers, as :func:`tnlg.interop.peft.add_lora` takes them."""
    return factor_targets(adapter_parameters(model), layout_of(model.config))


def adapter_layout(config: GPTConfig, tp_size: int, rank: int, targets: tuple[str, ...]) -> dict[str, ShardSpec]:
    """How every adapter factor of the whole GPT splits over ``tp_size`` ranks, by name: what an adapter run's
    checkpoint stores (the model built on the meta device with the adapters, as :meth:`tnlg.model.GPT.describe`
    reads the model's own parameters)."""
    fields = tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(config))
    return dict(_adapter_specs(fields, tp_size, rank, tuple(targets)))


@functools.lru_cache(maxsize=8)
def _adapter_specs(fields: tuple, tp_size: int, rank: int, targets: tuple) -> tuple[tuple[str, ShardSpec], ...]:
    from ..model import GPT
    with _disable_current_modes(), torch.device("meta"):  # (a fake-tensor run does not see the build)
        model = GPT(GPTConfig(*fields), ParallelState.for_virtual_rank(tp_size))
        add_lora(model, LoraSettings(rank), targets)
    return tuple((name, ShardSpec.of(p)) for name, p in adapter_parameters(model).items())


class CheckpointView:
    """``model`` as a checkpoint of its adapter run sees it: :meth:`layout` names the adapters (what the engine
    trains and the checkpoint stores); every other attribute is the model's."""

    def __init__(self, model, layout: dict[str, ShardSpec]):
        self._model, self._layout = model, layout

    def layout(self) -> dict[str, ShardSpec]:
        return self._layout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def base_identity(o) -> dict:
    """The identity of the run's frozen base, the tnlg checkpoint of ``--load`` (:class:`~tnlg.interop.sources.Source`)."""
    from ..interop.sources import identify
    if o.checkpoint.load is None:
        raise UserError("adapters train on the weights of --load; give --load DIR.")
    return identify(o.checkpoint.load, "ckpt").to_dict()


def adapter_record(model, base: dict) -> dict:
    """The manifest's ``adapters`` section of a run whose model (with its adapters) is ``model`` on the base
    ``base`` (:func:`base_identity`)."""
    s = settings_of_model(model)
    return dict(peft_type="LORA", rank=s.rank, alpha=float(s.alpha), dropout=float(s.dropout),
                use_rslora=bool(s.use_rslora), targets=list(targets_of(model)), base=base)


def planned_record(o, cfg: GPTConfig) -> dict:
    """The ``adapters`` record the run of options ``o`` would write (before any process starts: the model on the
    meta device with the run's adapters, ``--lora-rank``'s or ``--load-adapter``'s folder's)."""
    from ..model import GPT
    from .adapters import settings_of
    model = GPT(cfg, ParallelState.single(), device="meta")
    if o.adapters.load_adapter is not None:
        load_peft_adapter(model, o.adapters.load_adapter)
    else:
        add_lora(model, settings_of(o, cfg), o.adapters.lora_target_modules)
    return adapter_record(model, base_identity(o))


@dataclasses.dataclass
class AdapterRun:
    """What a checkpoint of an adapter run needs of the model: its view (:class:`CheckpointView`), the record of
    its adapters and base, and their settings (PEFT's folder ``SAVE/adapter``)."""

    view: CheckpointView
    record: dict
    settings: LoraSettings

    @classmethod
    def of(cls, model, o, config: GPTConfig) -> "AdapterRun":
        settings = settings_of_model(model)
        layout = adapter_layout(config, model.ps.tp_size, settings.rank, targets_of(model))
        return cls(CheckpointView(model, layout), adapter_record(model, base_identity(o)), settings)


def check_adapter_resume(manifest: Manifest, iter_dir: str, planned: Optional[dict],
                         config: Optional[GPTConfig] = None) -> None:
    """That the checkpoint ``iter_dir`` (its ``manifest``) is resumed as it was trained: with adapters (``planned``:
    this run's :func:`adapter_record`; ``None``: a run training every weight) on the same base (the same identity;
    ``config``: this run's model, whose shape differences are named) and settings. One paragraph otherwise."""
    saved, it = manifest.adapters, manifest.iteration
    if saved is None and planned is None:
        return
    if saved is None:
        raise UserError(f"checkpoint {iter_dir!r} (iteration {it}) is of a run that trained every weight, and this "
                        "run trains low-rank adapters on a frozen base (--lora-rank / --load-adapter): resuming one "
                        "as the other would drop what that run trained. Give this run another --save, or drop the "
                        "adapter flags to resume that run as it was. Nothing was loaded or written.")
    from ..interop.sources import Source
    try:
        recorded = Source.from_dict(saved.get("base"))
        if not all(k in saved for k in SETTINGS):
            raise ValueError("settings missing")
    except ValueError:
        raise UserError(f"{iter_dir!r}/meta.json: its 'adapters' section is damaged (no base identity or settings of "
                        "its adapters); it was not written by tnlg or was edited. Give this run another --save. "
                        "Nothing was loaded or written.") from None
    if planned is None:
        raise UserError(f"checkpoint {iter_dir!r} (iteration {it}) is of a LoRA run (rank-{saved['rank']} adapters "
                        f"on {', '.join(saved['targets'])} of the frozen base {recorded.path}): it holds the adapters "
                        "and their optimizer state, not the model's weights, and this run trains every weight. Resume "
                        f"it with its adapter flags (--lora-rank {saved['rank']} ...), or give this run another --save. "
                        "Nothing was loaded or written.")
    now = Source.from_dict(planned["base"])
    if not recorded.same_model(now):
        why = ("that base is gone" if not os.path.exists(recorded.path) else
               "the same folder, whose files changed since (other weights)" if recorded.path == now.path else
               "another model")
        shape = _shape_differences(manifest, config)
        raise UserError(f"checkpoint {iter_dir!r} holds adapters (iteration {it}) trained on the frozen base "
                        f"{recorded.describe()}, but this run's base (--load) is {now.describe()}: {why}"
                        + (f", of another shape ({shape})" if shape else "") + ". Adapters are a change to the weights "
                        "they were trained on: resuming them on others would train something else. Give --load the "
                        "base they were trained on, its files unchanged, or start a new run with another --save (its "
                        "SAVE/adapter holds the adapters as PEFT's folder). Nothing was loaded or written.")
    diffs = [f"{k} {saved.get(k)!r} in the checkpoint vs {planned[k]!r} now" for k in SETTINGS
             if saved.get(k) != planned[k]]
    if diffs:
        raise UserError(f"checkpoint {iter_dir!r} holds adapters (iteration {it}) with other settings than this "
                        f"run's: {'; '.join(diffs)}. A resume continues the same adapters: give the checkpoint's "
                        "(--lora-rank, --lora-alpha, --lora-dropout, --lora-target-modules, --use-rslora, or the same "
                        "--load-adapter folder), or another --save. Nothing was loaded or written.")


def _shape_differences(manifest: Manifest, config: Optional[GPTConfig]) -> str:
    if config is None or not manifest.config:
        return ""
    now = config.to_dict()
    return ", ".join(f"{k} {manifest.config[k]!r} in the checkpoint vs {now[k]!r} now" for k in ARCH_FIELDS
                     if k not in TRAINING_FIELDS and k in manifest.config and manifest.config[k] != now[k])
