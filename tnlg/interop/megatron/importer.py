"""A Megatron-LM GPT checkpoint -> a tnlg checkpoint (``tnlg convert --from megatron DIR --to CKPT``).

The source is a checkpoint root (``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/``; ``release``
too) or one iteration folder, in ``torch_dist`` (:mod:`.torch_dist`) or legacy per-rank
(:mod:`.legacy`) format, at any TP x PP (a mixture of experts: legacy files at any TP x PP x EP, the experts
joined into tnlg's ``[E, ...]`` tensors; ``torch_dist`` holds them whole; :mod:`.names`). The architecture comes from the saved args
(:mod:`.args`); everything is validated (args, every rank file, every tensor's presence and
shape) before the destination is created. Then each tnlg TP rank's file is streamed one tensor
at a time: a tensor is assembled from the Megatron shards or chunks that hold it, its padded
vocabulary rows dropped (tnlg pads for its own TP size), sliced for the rank and written. At most
one full tensor is held beyond what is written.

The tnlg checkpoint holds the weights, the iteration and consumed samples of the Megatron run and
its LR schedule's position (the manifest's ``schedule.num_steps``: ``tnlg pretrain --load`` continues the
schedule there). With ``with_optimizer`` it also holds the Adam state (:mod:`.optimizer`): the moments,
the fp32 master of a 16-bit run and Adam's step count, as one piece per parameter and TP rank;
without it, training starts fresh Adam moments (bias correction from step 1). The states are
streamed like the weights: one tensor at a time. A weight or state that holds NaN or inf is refused,
naming it (what is written so far is removed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

import torch

from ...checkpoint.manifest import CONVERTED_KEYS, FORMAT, Layout, Manifest, OptimizerState, Schedule
from ...checkpoint.reshard import slice_full, targets_for
from ...checkpoint.saving import all_finite, write_offline
from ...config import GPTConfig
from ...errors import UserError
from .args import config_from_args, layout_of, or_default, whole
from .legacy import LegacySource, first_file, is_legacy
from .names import VOCAB_PARAMS, Role, global_roles, layer_roles, megatron_shape, tnlg_name, to_tnlg
from .optimizer import optimizer_record, read_optimizer, schedule_position, schedule_record
from .safe_load import load_pt
from .torch_dist import TorchDistSource, is_torch_dist

__all__ = ["megatron_to_checkpoint", "open_megatron", "iteration_dir"]

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(path: str) -> str:
    """The iteration folder ``path`` designates: itself, or the one its tracker file names."""
    if not os.path.isdir(path):
        raise UserError(f"--from megatron {path!r} is not a directory.")
    if is_torch_dist(path) or is_legacy(path):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        raise UserError(f"--from megatron {path!r} is not a Megatron-LM checkpoint: it has no {TRACKER} and is not "
                        "an iteration folder (metadata.json of a torch_dist checkpoint, or mp_rank_* folders of a "
                        "legacy one). Give the checkpoint root (--save of the Megatron run) or one iter_* folder.")
    with open(tracker) as f:
        text = f.read().strip()
    name = "release" if text == "release" else (f"iter_{int(text):07d}" if text.isdigit() else None)
    if name is None:
        raise UserError(f"{tracker!r} holds {text[:40]!r}, neither an iteration number nor 'release'.")
    d = os.path.join(path, name)
    if os.path.isfile(os.path.join(d, "meta.json")):
        raise UserError(f"--from megatron {path!r} is a tnlg checkpoint, not a Megatron-LM one (its {name} holds "
                        "meta.json); give it as --from DIR without 'megatron'.")
    if not os.path.isdir(d) or not (is_torch_dist(d) or is_legacy(d)):
        raise UserError(f"{tracker!r} names {name}, but {d!r} is missing or holds no Megatron checkpoint.")
    return d


def open_megatron(path: str, vocab_size: Optional[int] = None):
    """``(source, config, common)``: the tensors, the tnlg config and the non-tensor entries
    (``args``, ``iteration``, ...) of the Megatron checkpoint at ``path``."""
    iter_dir = iteration_dir(path)
    where = f"Megatron checkpoint {iter_dir!r}"
    if is_torch_dist(iter_dir):
        common_path = os.path.join(iter_dir, "common.pt")
        if not os.path.isfile(common_path):
            raise UserError(f"{where} has no common.pt (the saved args); it is incomplete. Nothing was written.")
        common = load_pt(common_path, "Megatron common state")
    else:
        common = load_pt(first_file(iter_dir), "Megatron checkpoint file")
    if not isinstance(common, dict) or "args" not in common:
        raise UserError(f"{where} has no saved 'args', so its architecture is unknown; tnlg reads checkpoints written "
                        "by Megatron-LM's training loop (which saves its args). Nothing was written.")
    cfg = config_from_args(common["args"], where, vocab_size)
    layout = layout_of(common["args"], where, common)
    source: TorchDistSource | LegacySource
    if is_torch_dist(iter_dir):
        source = TorchDistSource(iter_dir, layout)
    else:
        source = LegacySource(iter_dir, common, layout, cfg.num_layers, cfg.num_attention_heads, cfg.num_experts,
                              cfg.swiglu)
    stored = source.layers()  # before anything is built for the args' layers
    if stored != cfg.num_layers:
        raise UserError(f"{where}: its args give num_layers={cfg.num_layers} but its files hold {stored or 'no'} "
                        "layers; the args do not describe these files. Nothing was written.")
    return source, cfg, common


def _roles(cfg: GPTConfig, last_stage: int):
    """``(role, layer, pipeline stage)`` of every tnlg parameter, in tnlg's order (a layer's stage
    follows from its index: ``None``)."""
    first, last = global_roles(cfg)
    for role in first:
        yield role, None, 0
    for i in range(cfg.num_layers):
        for role in layer_roles(cfg, i):
            yield role, i, None
    for role in last:
        yield role, None, last_stage


def _to_tnlg(t: torch.Tensor, role: Role, cfg: GPTConfig) -> torch.Tensor:
    """Megatron's full tensor in tnlg's layout: the padded vocabulary rows dropped, grouped-query QKV
    and SwiGLU's fc1 rearranged (:func:`.names.to_tnlg`; full multi-head QKV needs nothing)."""
    return t[:cfg.vocab_size] if role.tnlg in VOCAB_PARAMS else to_tnlg(role, t, cfg)


class _Tensors(Mapping):
    """tnlg name -> this rank's shard, computed when looked up (one tensor at a time); ``prefix``: of an
    optimizer state (``optimizer.state.exp_avg.``) instead of the weight."""

    def __init__(self, source, cfg: GPTConfig, tp: int, rank: int, dtype: torch.dtype, prefix: str = ""):
        self.source, self.cfg, self.dtype, self.prefix = source, cfg, dtype, prefix
        from ...model import GPT
        self.targets = targets_for(GPT.describe(cfg, tp), rank)
        self.where = {tnlg_name(r, layer): (r, layer, stage) for r, layer, stage in _roles(cfg, source.layout.pp - 1)}

    def __getitem__(self, name: str) -> torch.Tensor:
        role, layer, stage = self.where[name]
        full = self.source.tensor(role, layer, stage, prefix=self.prefix)
        if not all_finite(full):  # (its min and max: not a flag per element)
            kind = f"Adam state {self.prefix.rstrip('.').rsplit('.', 1)[-1]} of " if self.prefix else ""
            raise UserError(f"Megatron checkpoint {self.source.iter_dir!r}: the {kind}{role.dist_key}"
                            f"{'' if layer is None else f' of layer {layer}'} (tnlg's {name}) holds NaN or infinite "
                            "values; a model converted from it would compute nothing but NaN (a run that diverged "
                            "saved it: convert an earlier iteration"
                            + (", or without --with-optimizer: fresh Adam moments)" if self.prefix else ")")
                            + ". Nothing was written.")
        return slice_full(_to_tnlg(full, role, self.cfg).to(self.dtype), self.targets[name])

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class _StatesOf(Mapping):
    """kind (``exp_avg``, ``exp_avg_sq``, ``master``) -> this rank's shard of one parameter's state,
    computed when looked up (``write_offline`` writes one at a time)."""

    def __init__(self, name: str, by_kind: dict):
        self.name, self.by_kind = name, by_kind

    def __getitem__(self, kind: str) -> torch.Tensor:
        return self.by_kind[kind][self.name]

    def __contains__(self, kind) -> bool:
        return kind in self.by_kind

    def __iter__(self):
        return iter(self.by_kind)

    def __len__(self) -> int:
        return len(self.by_kind)


def _check_tensors(source, cfg: GPTConfig, prefix: str = "") -> None:
    """Every tensor tnlg needs (``prefix``: every state of them) is present with its shape (from the index
    or the rank files' headers: no tensor is read), before anything is written."""
    from ...model import GPT
    where = f"Megatron checkpoint {source.iter_dir!r}"
    specs = GPT.describe(cfg, 1)
    for role, layer, stage in _roles(cfg, source.layout.pp - 1):
        shape = source.shape(role, layer, stage, prefix=prefix)
        if shape is None:
            what = "the untied output layer (output_layer.weight)" if role.tnlg == "lm_head.weight" else (
                f"{role.tnlg}" + ("" if layer is None else f" of layer {layer}"))
            raise UserError(f"{where} has no {f'{prefix}* tensor' if prefix else 'tensor'} for {what}; it does not "
                            f"match its args ({source.format} format, names of megatron-core's local or "
                            "Transformer Engine spec or of the legacy model). Nothing was written.")
        want = megatron_shape(role, cfg, specs[tnlg_name(role, layer)].shape)
        if role.tnlg in VOCAB_PARAMS:  # with Megatron's padding rows
            want = (source.layout.padded_vocab_size, *want[1:])
        if shape != want:
            raise UserError(f"{where}: {tnlg_name(role, layer)} has shape {shape} but its args give {want}. Nothing "
                            "was written.")


def megatron_to_checkpoint(path: str, dst: str, tp_size: int = 1, vocab_size: Optional[int] = None,
                           tokenizer=None, with_optimizer: bool = False) -> str:
    """Convert the Megatron checkpoint at ``path`` into a new tnlg checkpoint ``dst`` at TP ``tp_size``.
    ``vocab_size``: the tokenizer's real size (default: the saved args' tokenizer, else the padded
    size); ``tokenizer`` (a tnlg tokenizer) is recorded in the checkpoint; ``with_optimizer``: also
    the Adam state (:mod:`.optimizer`; refused, naming why, where the checkpoint's layout is not read)."""
    source, cfg, common = open_megatron(path, vocab_size or (tokenizer.vocab_size if tokenizer else None))
    if with_optimizer and cfg.num_experts is not None:
        raise UserError(f"--with-optimizer: the Megatron checkpoint {source.iter_dir!r} is a mixture of experts, whose "
                        "Adam state tnlg does not read yet (the expert parameters' states per EP rank); convert "
                        "without --with-optimizer (fresh Adam moments). Nothing was written.")
    try:
        cfg.check_tensor_parallel(tp_size)
    except ValueError as exc:
        raise UserError(f"--tensor-model-parallel-size {tp_size}: {exc}") from None
    _check_tensors(source, cfg)
    dtype = source.dtype
    opt = read_optimizer(source, common, dtype != torch.float32, cfg) if with_optimizer else None
    states = (opt.states if opt else None) or source  # where the Adam states are read
    for prefix in (opt.prefixes.values() if opt else ()):
        _check_tensors(states, cfg, prefix)
    args = common["args"]
    iteration = source.layout.iteration
    consumed = whole(or_default(getattr(args, "consumed_train_samples", None), 0),
                     "the saved args' consumed_train_samples",
                     f"Megatron checkpoint {source.iter_dir!r}", 0)
    manifest = Manifest(
        format=FORMAT, iteration=iteration, consumed_samples=consumed,
        config=cfg.to_dict(), options={}, data=None, tokenizer=tokenizer.describe() if tokenizer else None,
        layout=Layout(param_dtype=str(dtype).replace("torch.", "")),
        optimizer=OptimizerState.from_dict(optimizer_record(opt)),
        schedule=Schedule.from_dict(schedule_record(args, schedule_position(common, args, iteration))),
        torch=torch.__version__, converted_from=dict(
            megatron=os.path.abspath(source.iter_dir), format=source.format, tp=source.layout.tp,
            pp=source.layout.pp, checkpoint_version=source.layout.checkpoint_version),
        key_order=CONVERTED_KEYS[:-2] + ("torch", "converted_from"))  # the order this converter always wrote

    def shard(r, names):
        if opt is None:
            return _Tensors(source, cfg, tp_size, r, dtype), None
        by_kind = {k: _Tensors(states, cfg, tp_size, r, torch.float32, prefix) for k, prefix in opt.prefixes.items()}
        return _Tensors(source, cfg, tp_size, r, dtype), {n: _StatesOf(n, by_kind) for n in names}

    from ...model import GPT
    return write_offline(dst, manifest, tp_size, shard, layout=GPT.describe(cfg, tp_size))
