"""The Adam state and LR-schedule position of a Megatron-LM checkpoint (``--with-optimizer``).

What is read (megatron-core 0.16.1's writers):

* ``torch_dist`` with the optimizer state in *model space*: each parameter's states are tensors of
  the parameter's own global shape and sharding, keyed ``optimizer.state.<state>.<the parameter's
  key>``, ``<state>`` one of ``exp_avg``, ``exp_avg_sq`` and the fp32 master (``fp32_param`` from
  the non-distributed optimizer of a 16-bit run, ``param`` from the distributed optimizer). This is
  what the non-distributed optimizer writes (``FP32Optimizer`` /
  ``Float16OptimizerWithFloat16Params.sharded_state_dict``: ``optim_state_to_sharding_state``) and
  what the distributed optimizer writes with ``distrib_optim_sharding_type="fully_reshardable"``
  (``DistributedOptimizer.sharded_param_state_fully_reshardable``; Megatron-LM's
  ``--dist-ckpt-optim-fully-reshardable``). The step count is in ``common.pt``: ``common_step``
  (non-distributed) or the param groups' ``step`` (distributed).
* the distributed optimizer's bucket layouts (:mod:`.buckets`, :mod:`.bucket_files`): ``torch_dist``
  in ``dp_reshardable`` (Megatron-LM's default since megatron-core 0.14; its param groups, with the
  step, in the ``optimizer.distributed.dp_group_idx_0.optimizer`` object) and the legacy
  ``distrib_optim.pt`` files (the step in ``model_optim_rng.pt``'s param groups): flat buffers laid
  out by Megatron's gradient buckets, which the import lays out again from the saved args.
* the legacy per-rank files (``--ckpt-format torch``) of the non-distributed optimizer: the
  ``optimizer`` entry of each ``model_optim_rng.pt`` is torch's optimizer state dict (its
  ``state`` numbered by param group; 16-bit runs nest it as ``optimizer`` beside
  ``fp32_from_fp16_params``), mapped to the parameters as megatron-core built the groups
  (:func:`legacy_states`).
* The LR schedule's position: ``opt_param_scheduler.num_steps`` (Megatron counts it in samples:
  each successful step adds the global batch size) divided by ``global_batch_size``; without a
  scheduler state, the checkpoint's iteration.

Every layout above is read for each model the weights convert for: GPT-2-style and the Llama family
(the bucket layouts' parameter order from the model's own tensors: :func:`~.buckets.stage_roles`;
the states rearranged into tnlg's layout as the weights are, being elementwise with them).

Refused (one :class:`UserError` naming it): the distributed optimizer's other layouts
(``dp_zero_gather_scatter``, ``fully_sharded_model_space``, ``fsdp_dtensor``); a ``fully_reshardable``
save whose states megatron-core 0.16.1 misplaced (padded buckets: :func:`_check_fully_reshardable`);
bucket files that do not hold the buckets the args give, or of a pre-core model (another parameter
order); and param groups beyond megatron-core's default weight-decay split (per-layer LR or decay
overrides) in the legacy non-distributed files.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ...errors import UserError
from .bucket_files import DISTRIB_OPTIM, DcpBuckets, LegacyBuckets
from .buckets import BucketStates, shifted_by_padding, span_key, stage_layouts, stage_roles
from .safe_load import shown

__all__ = ["MegatronOptimizer", "read_optimizer", "legacy_states", "schedule_position", "schedule_record",
           "optimizer_record"]

_STATE = "optimizer.state."
# tnlg kind -> the Megatron states that hold it, in the order they are looked for
_KINDS = {"exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",), "master": ("fp32_param", "param")}
_READ_LAYOUTS = (None, "fully_reshardable")  # None: the non-distributed optimizer's sharded state dict
_BUCKETS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "param"}  # kind -> bucket state
_HINT = ("Save the Megatron run in the distributed optimizer's default 'dp_reshardable' layout, or with "
         "--dist-ckpt-optim-fully-reshardable, or without --use-distributed-optimizer, or convert without "
         "--with-optimizer: training then starts fresh Adam moments, its LR schedule at the checkpoint's "
         "position. Nothing was written.")


@dataclass(frozen=True)
class MegatronOptimizer:
    """Where a checkpoint's Adam states are and what they were stepped with."""
    prefixes: dict          # tnlg kind (exp_avg, exp_avg_sq, master) -> DCP key prefix (legacy, buckets: a state)
    step: int               # Adam's step count (bias correction)
    hyperparameters: dict   # betas, eps, weight_decay, lr of Megatron's param groups
    states: object = None   # where the states are read (shape, tensor), the checkpoint's source if None


_MAX_DEPTH = 32  # the nesting searched in an optimizer state (megatron-core's is under 10 deep)


def _find(node, key: str, out: list) -> list:
    """Every value of ``key`` in the nested dicts and lists of ``node``, in depth-first order; each
    container is visited once and no deeper than :data:`_MAX_DEPTH` (a crafted graph stays cheap)."""
    seen: set = set()
    stack = [(node, 0)]
    while stack:
        n, depth = stack.pop()
        if not isinstance(n, (dict, list, tuple)) or id(n) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(n))
        children = []
        for k, v in (n.items() if isinstance(n, dict) else enumerate(n)):
            if isinstance(n, dict) and isinstance(k, str) and k == key:
                out.append(v)
            children.append((v, depth + 1))
        stack.extend(reversed(children))
    return out


def _number(value, where: str, what: str, whole_number: bool = False):
    """``value`` of the optimizer state (a number or a one-element tensor) as a float (a non-negative
    int with ``whole_number``), else one :class:`UserError` naming it."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = value.item()
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if finite and not isinstance(value, bool) and (not whole_number or (value >= 0 and value == int(value))):
        return int(value) if whole_number else float(value)
    raise UserError(f"{where}: the optimizer state's {what} is {shown(value)}, not a{' whole' if whole_number else ''} "
                    "number; the checkpoint is damaged. Nothing was written.")


def _no_state(where: str) -> UserError:
    return UserError(f"{where} holds no optimizer state (Megatron-LM saved it with --no-save-optim, or it is a "
                     "converted model). Convert without --with-optimizer. Nothing was written.")


def _step(state: dict, where: str) -> int:
    """Adam's step: ``common_step`` (megatron-core's sharded state dicts), the param groups' ``step``
    (the distributed optimizer) or the per-parameter ``step`` of torch's state dict (legacy files)."""
    per_param = [v for d in _find(state, "state", []) if isinstance(d, dict) for v in d.values() if isinstance(v, dict)]
    found = (_find(state, "common_step", []) + _find(_find(state, "param_groups", []), "step", [])
             + [v.get("step") for v in per_param])
    steps = {_number(s, where, "step", True) for s in found if s is not None}
    if len(steps) != 1:
        raise UserError(f"{where}: the optimizer state gives {'no' if not steps else sorted(steps)} Adam step "
                        "count(s); one is needed for Adam's bias correction. Nothing was written.")
    return steps.pop()


def _hyperparameters(state: dict, where: str) -> dict:
    groups = [g for gs in _find(state, "param_groups", []) if isinstance(gs, list) for g in gs if isinstance(g, dict)]
    if not groups:
        return {}
    num = lambda g, name, default: _number(g.get(name, default), where, f"param group's {name}")  # noqa: E731
    g = max(groups, key=lambda g: num(g, "wd_mult", 1.0))  # the group with weight decay
    betas = g.get("betas", (0.9, 0.999))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise UserError(f"{where}: the optimizer's betas are not a pair of numbers. Nothing was written.")
    return dict(betas=[_number(b, where, "betas") for b in betas], eps=num(g, "eps", 1e-8),
                weight_decay=num(g, "weight_decay", 0.0) * num(g, "wd_mult", 1.0),
                lr=num(g, "lr", None) if g.get("lr") is not None else None)


def read_optimizer(source, common: dict, sixteen_bit: bool, cfg) -> MegatronOptimizer:
    """The optimizer state of a Megatron checkpoint (module docstring), validated: a layout tnlg does
    not read, no state at all or a missing fp32 master of a 16-bit run is one :class:`UserError`.
    ``cfg`` (the model's :class:`~tnlg.config.GPTConfig`) lays out the distributed optimizer's buckets."""
    where = f"--with-optimizer: Megatron checkpoint {source.iter_dir!r}"
    state = common.get("optimizer")
    if source.format != "torch_dist":
        return _read_legacy(source, common, state, sixteen_bit, where, cfg)
    if state is None:
        raise _no_state(where)
    layouts = set(_find(state, "param_state_sharding_type", []))
    layout = layouts.pop() if len(layouts) == 1 else (None if not layouts else sorted(layouts))
    if layout == "dp_reshardable":
        groups = [source.load_object(k) for k in source.meta.state_dict_metadata
                  if k.startswith("optimizer.distributed.dp_group_idx_0.optimizer/")]
        return _bucket_optimizer(source, common, {"optimizer": groups}, DcpBuckets(source), sixteen_bit, where, cfg)
    if layout not in _READ_LAYOUTS or source.has_key("optimizer.distributed."):
        raise UserError(f"{where} holds the distributed optimizer's state in its {layout or 'bucket'!r} layout, "
                        "which tnlg does not read; it reads the model-space layouts and the default "
                        f"'dp_reshardable' bucket layout. {_HINT}")
    prefixes = {}
    for kind, names in _KINDS.items():
        found = [f"{_STATE}{n}." for n in names if source.has_key(f"{_STATE}{n}.")]
        if found:
            prefixes[kind] = found[0]
    missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in prefixes]
    if missing:
        raise UserError(f"{where} has no {_STATE}{missing[0]}.* tensors: its optimizer is not Adam, or the state "
                        "was not saved. Nothing was written.")
    if not sixteen_bit:
        prefixes.pop("master", None)  # an fp32 run's master is its weights
    elif "master" not in prefixes:
        raise UserError(f"{where}: the weights are 16-bit but the checkpoint has no fp32 master weights "
                        f"({_STATE}fp32_param.* or {_STATE}param.*); tnlg resumes a 16-bit run from its fp32 "
                        "master. Nothing was written.")
    if layout == "fully_reshardable":
        _check_fully_reshardable(source, cfg, common["args"], where)
    return MegatronOptimizer(prefixes, _step(state, where), _hyperparameters(state, where))


def _check_fully_reshardable(source, cfg, args, where: str) -> None:
    """megatron-core 0.16.1 misplaces the states of a ``fully_reshardable`` save whose gradient buckets
    are padded (:func:`~.buckets.shifted_by_padding`): the fp32 master of the most misplaced parameter
    must be its weight (exactly; rounded to the weights' dtype in a 16-bit run), else the save is refused."""
    first, layer_order, last = stage_roles(cfg)
    roles = {span_key(r, None)[0]: r for r in (*first, *layer_order, *last)}
    for p, layout in enumerate(stage_layouts(source, cfg, args, where)):
        key = shifted_by_padding(layout)
        if key is None:
            continue
        role, layer = roles[key[0]], key[1]
        master = source.tensor(role, layer, p, prefix=f"{_STATE}param.")
        weight = source.tensor(role, layer, p)
        if master is not None and not torch.equal(master.to(weight.dtype), weight):
            raise UserError(
                f"{where} holds the distributed optimizer's 'fully_reshardable' layout, but its states are "
                f"misplaced: the saved fp32 master of {role.tnlg}{'' if layer is None else f' of layer {layer}'} is not "
                "that parameter's weights. megatron-core 0.16.1 writes this layout wrong when its gradient buckets "
                "are padded (--overlap-grad-reduce with several buckets; its log warns 'param range exceeds "
                "unpadded buffer'): each parameter's states are cut at its offset in the padded buffer from the "
                "buckets joined without their padding. Save the run in the default 'dp_reshardable' layout "
                "(without --dist-ckpt-optim-fully-reshardable), which tnlg reads, or convert without "
                "--with-optimizer. Nothing was written.")


def _bucket_optimizer(source, common: dict, state, store, sixteen_bit: bool, where: str, cfg) -> MegatronOptimizer:
    """The distributed optimizer's bucket layout (:mod:`.buckets`) in ``store``; ``state`` holds its
    param groups (Adam's step, the hyperparameters)."""
    kinds = {k: v for k, v in _BUCKETS.items() if sixteen_bit or k != "master"}
    states = BucketStates(source, cfg, common["args"], store, where)
    return MegatronOptimizer(kinds, _step(state, where), _hyperparameters(state, where), states)


def _read_legacy(source, common: dict, state, sixteen_bit: bool, where: str, cfg) -> MegatronOptimizer:
    """The non-distributed optimizer's entry of the legacy files (:func:`legacy_states`), or the
    distributed optimizer's ``distrib_optim.pt`` beside them (its param groups in the ``optimizer`` entry)."""
    distributed = bool(getattr(common["args"], "use_distributed_optimizer", False)) or any(
        os.path.isfile(os.path.join(source.iter_dir, d, DISTRIB_OPTIM)) for d in os.listdir(source.iter_dir))
    if distributed:
        if not isinstance(state, dict):
            raise _no_state(where)
        model = common.get("model")
        if isinstance(model, dict) and any(isinstance(k, str) and k.startswith("language_model") for k in model):
            raise UserError(f"{where} holds the distributed optimizer's distrib_optim.pt of a pre-core (legacy) "
                            "model (language_model.* names), whose parameters lie in its buckets in another order "
                            "than megatron-core's; tnlg reads the buckets of megatron-core models. Convert without "
                            "--with-optimizer (fresh Adam moments). Nothing was written.")
        return _bucket_optimizer(source, common, state, LegacyBuckets(source), sixteen_bit, where, cfg)
    if not isinstance(state, dict):
        raise _no_state(where)
    kinds = ("exp_avg", "exp_avg_sq") + (("master",) if sixteen_bit else ())
    if sixteen_bit and not state.get("fp32_from_fp16_params"):
        raise UserError(f"{where}: the weights are 16-bit but the optimizer entry has no fp32_from_fp16_params "
                        "(the fp32 master); tnlg resumes a 16-bit run from its master. Nothing was written.")
    return MegatronOptimizer({k: k for k in kinds}, _step(state, where), _hyperparameters(state, where))


def _no_weight_decay(name: str, value) -> bool:
    """megatron-core's default split of its param groups: biases and 1-D parameters get no weight decay."""
    return name.endswith(".bias") or value.dim() == 1


def legacy_states(model: dict, entry, path: str) -> dict:
    """``{kind: {parameter name: tensor}}`` of one legacy rank file: torch's optimizer state dict (in
    ``entry``, or ``entry["optimizer"]`` beside the 16-bit run's ``fp32_from_fp16_params``) numbers the
    parameters by param group; megatron-core builds its groups from ``named_parameters()`` (the model
    entry's order) split by weight decay (``wd_mult`` 1, or 0 for biases and 1-D parameters), so group
    ``g``'s ``i``-th id is the ``i``-th parameter of that kind. Every state's shape is checked."""
    where = f"--with-optimizer: {path!r}"
    inner = entry.get("optimizer", entry) if isinstance(entry, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise UserError(f"{where} has no optimizer state dict (state and param_groups). Nothing was written.")
    groups, masters = inner["param_groups"], entry.get("fp32_from_fp16_params")
    params = [(n, v) for n, v in model.items() if isinstance(v, torch.Tensor) and not n.endswith("_extra_state")]
    decays = [float(g.get("wd_mult", 1.0)) == 0.0 for g in groups]
    if len(set(decays)) != len(decays):
        raise UserError(f"{where}: the optimizer has {len(groups)} param groups, more than megatron-core's default "
                        "split by weight decay, so its parameters cannot be told apart; tnlg does not read it yet. "
                        "Nothing was written.")
    out: dict = {"exp_avg": {}, "exp_avg_sq": {}, "master": {}}
    for g, (group, no_decay) in enumerate(zip(groups, decays)):
        members = [(n, v) for n, v in params if _no_weight_decay(n, v) == no_decay]
        if len(members) != len(group.get("params", ())):
            raise UserError(f"{where}: param group {g} has {len(group.get('params', ()))} parameters but the model "
                            f"has {len(members)} of its kind; the optimizer does not match the model. Nothing was "
                            "written.")
        for i, ((name, value), pid) in enumerate(zip(members, group["params"])):
            st = dict(inner.get("state", {}).get(pid) or {})
            if masters:
                st["master"] = masters[g][i]
            for kind in out:
                t = st.get(kind)
                if t is not None and tuple(t.shape) != tuple(value.shape):
                    raise UserError(f"{where}: the optimizer's {kind} for {name!r} has shape {tuple(t.shape)}, the "
                                    f"parameter {tuple(value.shape)}; the optimizer does not match the model. Nothing "
                                    "was written.")
                if t is not None:
                    out[kind][name] = t
    return out


def schedule_position(common: dict, args, iteration: int) -> int:
    """The LR schedule's position (successful optimizer steps) of a Megatron checkpoint: its scheduler's
    ``num_steps`` (samples) over the global batch size, else ``iteration``."""
    sched = common.get("opt_param_scheduler") or common.get("lr_scheduler")
    batch = getattr(args, "global_batch_size", None)
    if isinstance(sched, dict) and sched.get("num_steps") is not None and batch:
        where = "Megatron checkpoint: its LR scheduler"
        return _number(sched["num_steps"], where, "num_steps", True) // max(1, _number(batch, where, "batch", True))
    return int(iteration)


def schedule_record(args, position: int) -> dict:
    """``meta["schedule"]`` of an imported checkpoint: its position and the Megatron run's LR flags."""
    def arg(name: str, kind):  # a flag the file gives as something else is not recorded
        value = getattr(args, name, None)
        ok = isinstance(value, kind) and not isinstance(value, bool) and (
            not isinstance(value, float) or math.isfinite(value))
        return value if ok else None
    return dict(num_steps=int(position), max_lr=arg("lr", (int, float)), min_lr=arg("min_lr", (int, float)),
                warmup_iters=arg("lr_warmup_iters", int),
                decay_iters=arg("lr_decay_iters", int) or arg("train_iters", int),
                decay_style=arg("lr_decay_style", str))


def optimizer_record(opt: Optional[MegatronOptimizer]) -> dict:
    """``meta["optimizer"]`` of an imported checkpoint."""
    if opt is None:
        return dict(present=False)
    h = opt.hyperparameters
    return dict(present=True, num_steps=opt.step, zero_stage=None, betas=h.get("betas"), eps=h.get("eps"),
                weight_decay=h.get("weight_decay"), loss_scaler=None, converted=True)
