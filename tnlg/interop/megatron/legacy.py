"""Megatron-LM's per-rank (legacy, ``--ckpt-format torch``) checkpoints: read and write.

Layout (``megatron/training/checkpointing.py``, ``get_checkpoint_name``): ``iter_NNNNNNN/mp_rank_TT/
model_optim_rng.pt`` per TP rank, ``mp_rank_TT_PPP/`` with pipeline parallelism, and with expert parallelism
``_EEE`` appended (``mp_rank_TT_EEE`` or ``mp_rank_TT_PPP_EEE``: the saved args' sizes tell them apart): each EP
rank's file holds the layers' dense tensors (the same in every EP rank's file: the first one's are read) and its
own experts (:mod:`.names`). Each file is a
``torch.save`` of ``{"args", "checkpoint_version", "iteration", "model", "optimizer", "rng_state", ...}``;
``model`` is the state dict of that rank's shard of its pipeline stage, whose layers are numbered
from 0 within the stage (stage ``p`` of ``pp`` holds layers ``p L/pp`` to ``(p+1) L/pp - 1``). The
legacy model nests it (``{"language_model": {"embedding": {...}, "encoder": {...}}}``); the nesting
is flattened with dots. Files are memory-mapped (:func:`~.safe_load.load_pt`): a tensor is read
when it is assembled, one at a time.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from ...checkpoint import torch_file
from ...errors import UserError
from .args import MegatronLayout
from .names import (CORE_LAYER_PREFIX, EXPERT_TAKES, LEGACY_LAYER_PREFIXES, LOCAL_EXTRA_STATE, Role,
                    expert_rank_shards, local_expert_names, qkv_to_current, swiglu_join)
from .safe_load import load_pt

__all__ = ["FILE", "rank_dir", "is_legacy", "first_file", "LegacySource", "write_rank_files", "local_extra_state"]

FILE = "model_optim_rng.pt"
_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    base = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return base if ep == 1 else f"{base}_{ep_rank:03d}"


def is_legacy(iter_dir: str) -> bool:
    return any(_RANK_RE.match(n) for n in os.listdir(iter_dir))


_MAX_DEPTH = 16  # the nesting of a state dict (the legacy model's is 4 deep)
_LAYER_RE = re.compile(r"^(?:" + "|".join(re.escape(p) for p in (CORE_LAYER_PREFIX, *LEGACY_LAYER_PREFIXES)) +
                       r")(\d+)\.")


def _flatten(d: dict, path: str) -> dict:
    """The nested dicts of ``d`` as one dict of dotted names, in their order. Each dict is visited once
    (no recursion): a dict met twice (a shared or cyclic graph, which no state dict is) or nested more
    than :data:`_MAX_DEPTH` deep is one :class:`UserError` about ``path``."""
    out: dict = {}
    seen = {id(d)}
    stack = [("", iter(d.items()))]
    while stack:
        prefix, items = stack[-1]
        for k, v in items:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise UserError(f"{path!r}: its model entry has a key of type {type(k).__name__}; a state dict's "
                                "names are strings. The file is damaged or not a Megatron checkpoint. Nothing was "
                                "written.")
            if not isinstance(v, dict):
                out[f"{prefix}{k}"] = v
                continue
            if id(v) in seen or len(stack) >= _MAX_DEPTH:
                why = "holds one dict in two places (or inside itself)" if id(v) in seen else \
                    f"nests dicts more than {_MAX_DEPTH} deep"
                raise UserError(f"{path!r}: its model entry {why}, which no state dict does; the file is damaged or "
                                "was crafted. Nothing was written.")
            seen.add(id(v))
            stack.append((f"{prefix}{k}.", iter(v.items())))
            break
        else:
            stack.pop()
    return out


def first_file(iter_dir: str) -> str:
    """The file of TP rank 0 (first stage): where the args are read."""
    for name in (rank_dir(0, 0, 1), rank_dir(0, 0, 2), rank_dir(0, 0, 2, 0, 2)):  # (_000: PP or EP rank 0)
        path = os.path.join(iter_dir, name, FILE)
        if os.path.isfile(path):
            return path
    dirs = sorted(n for n in os.listdir(iter_dir) if _RANK_RE.match(n))
    raise UserError(f"{iter_dir!r} has rank folders {dirs[:4]} but no {os.path.join(rank_dir(0, 0, 1), FILE)!r}: "
                    "the file of tensor-parallel rank 0 is missing. Nothing was written.")


class LegacySource:
    """The tensors of a legacy checkpoint, assembled over its TP ranks in Megatron's layout."""

    format = "legacy"

    def __init__(self, iter_dir: str, first: dict, layout: MegatronLayout, num_layers: int, num_heads: int,
                 num_experts: Optional[int] = None, swiglu: bool = False):
        self.iter_dir, self.layout = iter_dir, layout
        self.heads_per_rank = num_heads // layout.tp  # Megatron splits heads evenly
        if num_heads % layout.tp:
            raise UserError(f"{iter_dir!r}: {num_heads} heads over TP={layout.tp} is not a Megatron layout (its "
                            "args are inconsistent). Nothing was written.")
        if num_layers % layout.pp:
            raise UserError(f"{iter_dir!r}: {num_layers} layers over pipeline size {layout.pp} is an uneven split, "
                            "which tnlg does not read. Nothing was written.")
        self.per_stage = num_layers // layout.pp
        self.files: dict[tuple[int, ...], dict] = {}
        self.optimizers: dict[tuple[int, ...], Optional[dict]] = {}
        self.states: dict[tuple[int, int], dict] = {}
        self._first = first
        self.num_experts, self.swiglu = num_experts, swiglu
        if num_experts is not None and num_experts % layout.ep:
            raise UserError(f"{iter_dir!r}: {num_experts} experts over expert_model_parallel_size={layout.ep} is not "
                            "a Megatron layout (its args are inconsistent). Nothing was written.")
        ep = layout.ep if num_experts is not None else 1
        self.ep = ep
        for p in range(layout.pp):  # every rank file must be there before anything is written
            for t in range(layout.tp):
                for e in range(ep):
                    path = self._path(t, p, e)
                    if not os.path.isfile(path):
                        raise UserError(f"{iter_dir!r} was written at TP={layout.tp} x PP={layout.pp}"
                                        + (f" x EP={ep}" if ep > 1 else "") + f" (its args) but {path!r} is missing: "
                                        "every rank's file is needed. Nothing was written.")

    def _path(self, t: int, p: int, e: int = 0) -> str:
        return os.path.join(self.iter_dir, rank_dir(t, p, self.layout.pp, e, self.ep), FILE)

    def _model(self, t: int, p: int, e: int = 0) -> dict:
        if (t, p, e) not in self.files:
            path = self._path(t, p, e)
            state = self._first if (t, p, e) == (0, 0, 0) else load_pt(path, "Megatron checkpoint file")
            if not isinstance(state, dict):
                raise UserError(f"{path!r} holds a {type(state).__name__}, not the dict of a Megatron checkpoint "
                                "file. Nothing was written.")
            if "model" not in state:
                extra = [k for k in state if isinstance(k, str) and re.match(r"model\d+$", k)]
                why = ("an interleaved (virtual) pipeline checkpoint, which tnlg does not read" if extra
                       else "it has no 'model' entry")
                raise UserError(f"{path!r}: {why}. Nothing was written.")
            if not isinstance(state["model"], dict):
                raise UserError(f"{path!r}: its 'model' entry is a {type(state['model']).__name__}, not a state "
                                "dict. Nothing was written.")
            self.files[(t, p, e)] = _flatten(state["model"], path)
            self.optimizers[(t, p, e)] = state.get("optimizer")
        return self.files[(t, p, e)]

    def _states(self, t: int, p: int, kind: str) -> dict:
        """One rank's optimizer state ``kind`` by parameter name (the legacy ``optimizer`` entry, read by
        :func:`~.optimizer.legacy_states`)."""
        from .optimizer import legacy_states
        if (t, p) not in self.states:
            model = self._model(t, p)
            self.states[(t, p)] = legacy_states(model, self.optimizers[(t, p, 0)], self._path(t, p))
        return self.states[(t, p)][kind]

    def _lookup(self, model: dict, role: Role, layer: Optional[int]) -> tuple[Optional[torch.Tensor], bool]:
        """(tensor, whether it has a legacy name) of ``role`` in one rank's state dict."""
        if layer is None:
            for legacy, names in ((False, role.core), (True, role.legacy)):
                for n in names:
                    if n in model:
                        return model[n], legacy
            return None, False
        for legacy, prefixes, names in ((False, (CORE_LAYER_PREFIX,), role.core),
                                        (True, LEGACY_LAYER_PREFIXES, role.legacy)):
            for prefix in prefixes:
                for n in names:
                    key = f"{prefix}{layer}.{n}"
                    if key in model:
                        return model[key], legacy
        return None, False

    def _shards(self, role: Role, layer: Optional[int], stage: Optional[int],
                kind: str = "") -> Optional[list[tuple[torch.Tensor, bool]]]:
        """Every TP rank's (memory-mapped) tensor of ``role`` and whether it was found under a legacy name
        (``kind``: its optimizer state of that kind), QKV reordered lazily by :meth:`tensor`."""
        if layer is not None:
            stage, layer = divmod(layer, self.per_stage)
        shards = []
        for t in range(self.layout.tp if role.split is not None else 1):
            names = self._states(t, stage or 0, kind) if kind else self._model(t, stage or 0)
            value, legacy = self._lookup(names, role, layer)
            if value is None:
                return None
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                what = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
                raise UserError(f"{self._path(t, stage or 0)!r}: the entry for {role.tnlg!r} is {what}; the weights "
                                "and Adam states of a Megatron GPT are floating-point tensors. Nothing was written.")
            shards.append((value, legacy))
        return shards

    def shape(self, role: Role, layer: Optional[int], stage: Optional[int] = None,
              prefix: str = "") -> Optional[tuple[int, ...]]:
        """The full shape of ``role`` (no data read); ``None`` where the checkpoint has none. ``prefix``:
        of its optimizer state of that kind (``exp_avg``, ``exp_avg_sq``, ``master``)."""
        if role.take in EXPERT_TAKES:
            experts = self._expert_shards(role, layer)
            if experts is None:
                return None
            return (len(experts), *self._join_expert(role, experts[0], shape_only=True))
        shards = self._shards(role, layer, stage, prefix)
        if shards is None:
            return None
        shape = list(shards[0][0].shape)
        if role.split is not None:
            shapes = [tuple(v.shape) for v, _ in shards]
            if any(len(s) <= role.split or s[:role.split] + s[role.split + 1:] != shapes[0][:role.split] +
                   shapes[0][role.split + 1:] for s in shapes):
                raise UserError(f"{self.iter_dir!r}: the TP shards of {role.tnlg!r} have shapes {shapes[:4]}, which do "
                                f"not join along dimension {role.split} as Megatron splits it; the rank files are "
                                "damaged. Nothing was written.")
            shape[role.split] = sum(s[role.split] for s in shapes)
        return tuple(shape)

    def tensor(self, role: Role, layer: Optional[int], stage: Optional[int] = None,
               prefix: str = "") -> Optional[torch.Tensor]:
        """The full tensor of ``role`` (of global ``layer``; globals of pipeline ``stage``; ``prefix``: its
        optimizer state of that kind), TP shards concatenated (SwiGLU's as ``[gate; up]``), QKV in
        ``[heads, 3, hn]`` order; ``None``
        where the checkpoint has none (a tied output layer). An expert role's is ``[E, ...]``: every expert's
        full ``linear_fc1`` / ``linear_fc2`` (:mod:`.names`)."""
        if role.take in EXPERT_TAKES:
            experts = self._expert_shards(role, layer)
            return None if experts is None else torch.stack([self._join_expert(role, e) for e in experts])
        shards = self._shards(role, layer, stage, prefix)
        if shards is None:
            return None
        out = []
        for value, legacy in shards:
            if role.tnlg.startswith("attn.c_attn"):
                value = qkv_to_current(value, self.layout.checkpoint_version if legacy else 3.0, self.heads_per_rank)
            out.append(value)
        if role.take == "swiglu":  # each rank's [gate_r; up_r] -> [gate; up]
            return swiglu_join(out)
        return out[0].clone() if len(out) == 1 or role.split is None else torch.cat(out, dim=role.split)

    def _expert_shards(self, role: Role, layer: Optional[int]) -> Optional[list[list[torch.Tensor]]]:
        """Per global expert, its TP shards of ``role`` (``linear_fc1`` ``[2 f_t, h]`` / ``linear_fc2``
        ``[h, f_t]``) from the EP ranks' files, in either layout (``SequentialMLP`` or ``GroupedMLP``);
        ``None`` where the files hold neither."""
        assert layer is not None and self.num_experts is not None
        stage, j = divmod(layer, self.per_stage)
        local = self.num_experts // self.ep
        per_rank: list[list[list[torch.Tensor]]] = []  # [ep][tp][local expert]
        for e in range(self.ep):
            per_rank.append([])
            for t in range(self.layout.tp):
                model, path = self._model(t, stage, e), self._path(t, stage, e)
                prefix = f"{CORE_LAYER_PREFIX}{j}."
                names = [prefix + n for n in local_expert_names(role, local)]
                grouped = prefix + role.core[1]
                if all(n in model for n in names):
                    tensors = [model[n] for n in names]
                elif grouped in model:
                    tensors = [model[grouped]]
                else:
                    return None
                for value in tensors:
                    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 2:
                        raise UserError(f"{path!r}: the entry for the experts' {role.tnlg!r} of layer {layer} is not a "
                                        "floating-point matrix; the file is damaged. Nothing was written.")
                if len(tensors) == 1 and grouped in model and names[0] not in model:
                    hidden = self._hidden(model)
                    if tensors[0].numel() % (local * hidden):
                        raise UserError(f"{path!r}: the grouped experts' {role.core[1]} of layer {layer} has shape "
                                        f"{tuple(tensors[0].shape)}, which does not hold {local} experts of hidden "
                                        f"size {hidden}. Nothing was written.")
                    tensors = expert_rank_shards(role, tensors[0], local, hidden)
                per_rank[-1].append(tensors)
        return [[per_rank[e][t][i] for t in range(self.layout.tp)] for e in range(self.ep) for i in range(local)]

    def _hidden(self, model: dict) -> int:
        """The hidden size, from the router's weight ``[E, h]`` of the first layer in ``model``."""
        for name, value in model.items():
            if str(name).endswith("mlp.router.weight") and isinstance(value, torch.Tensor) and value.dim() == 2:
                return int(value.shape[1])
        raise UserError(f"{self.iter_dir!r}: a mixture-of-experts file without a router weight "
                        "(mlp.router.weight). Nothing was written.")

    def _join_expert(self, role: Role, shards: list[torch.Tensor], shape_only: bool = False):
        """One expert's full ``linear_fc1`` (SwiGLU's ``[gate; up]``) or ``linear_fc2`` of its TP shards."""
        dim = 0 if role.take == "experts_fc1" else 1
        shapes = [tuple(s.shape) for s in shards]
        if any(s[1 - dim] != shapes[0][1 - dim] for s in shapes):
            raise UserError(f"{self.iter_dir!r}: the TP shards of the experts' {role.tnlg!r} have shapes {shapes[:4]}, "
                            f"which do not join along dimension {dim}. Nothing was written.")
        if shape_only:
            joined = list(shapes[0])
            joined[dim] = sum(s[dim] for s in shapes)
            return tuple(joined)
        if role.take == "experts_fc1" and self.swiglu:
            return swiglu_join(list(shards))
        return torch.cat(list(shards), dim=dim)

    def layers(self) -> int:
        """How many layers the files hold: the layer numbers of the first stage's file, times the stages."""
        found = {m.group(1) for m in map(_LAYER_RE.match, map(str, self._model(0, 0))) if m}
        return len(found) * self.layout.pp

    @property
    def dtype(self) -> torch.dtype:
        model = self._model(0, 0)
        for v in model.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.dtype
        raise UserError(f"{self._path(0, 0)!r} holds no floating-point tensor: it has no weights. Nothing was "
                        "written.")


def write_rank_files(iter_dir: str, common: dict, tp: int, pp: int, state_of_rank, ep: int = 1) -> list[str]:
    """One ``mp_rank_*/model_optim_rng.pt`` per (TP, PP, EP) rank: ``common`` (``args``,
    ``checkpoint_version``, ``iteration``) plus ``model = state_of_rank(tp_rank, pp_rank, ep_rank)``; returns
    the files written. Each rank's state dict is built, saved and dropped before the next."""
    written = []
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                path = os.path.join(iter_dir, rank_dir(t, p, pp, e, ep), FILE)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                state = dict(common, model=state_of_rank(t, p, e))
                torch_file.save(state, path)  # a full disk: its OSError, not torch's RuntimeError
                written.append(path)
                del state
    return written


def local_extra_state(layers, names: tuple[str, ...] = LOCAL_EXTRA_STATE) -> dict:
    """The ``_extra_state`` entries (``None``) megatron-core's local spec keeps for its linear layers ``names``."""
    return {f"{CORE_LAYER_PREFIX}{j}.{n}._extra_state": None for j in layers for n in names}

