"""Megatron-LM's per-rank (legacy, ``--ckpt-format torch``) checkpoints: read and write.

Layout (``megatron/training/checkpointing.py``, ``get_checkpoint_name``): ``iter_NNNNNNN/mp_rank_TT/
model_optim_rng.pt`` per TP rank, ``mp_rank_TT_PPP/`` with pipeline parallelism. Each file is a
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
from .names import CORE_LAYER_PREFIX, LEGACY_LAYER_PREFIXES, LOCAL_EXTRA_STATE, Role, qkv_to_current, swiglu_join
from .safe_load import load_pt

__all__ = ["FILE", "rank_dir", "is_legacy", "first_file", "LegacySource", "write_rank_files", "local_extra_state"]

FILE = "model_optim_rng.pt"
_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


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
    for name in (rank_dir(0, 0, 1), rank_dir(0, 0, 2)):
        path = os.path.join(iter_dir, name, FILE)
        if os.path.isfile(path):
            return path
    dirs = sorted(n for n in os.listdir(iter_dir) if _RANK_RE.match(n))
    if any(m.group(3) for m in map(_RANK_RE.match, dirs) if m):
        raise UserError(f"{iter_dir!r} is an expert-parallel checkpoint ({dirs[0]}): mixtures of experts are not "
                        "modelled by tnlg. Nothing was written.")
    raise UserError(f"{iter_dir!r} has rank folders {dirs[:4]} but no {os.path.join(rank_dir(0, 0, 1), FILE)!r}: "
                    "the file of tensor-parallel rank 0 is missing. Nothing was written.")


class LegacySource:
    """The tensors of a legacy checkpoint, assembled over its TP ranks in Megatron's layout."""

    format = "legacy"

    def __init__(self, iter_dir: str, first: dict, layout: MegatronLayout, num_layers: int, num_heads: int):
        self.iter_dir, self.layout = iter_dir, layout
        self.heads_per_rank = num_heads // layout.tp  # Megatron splits heads evenly
        if num_heads % layout.tp:
            raise UserError(f"{iter_dir!r}: {num_heads} heads over TP={layout.tp} is not a Megatron layout (its "
                            "args are inconsistent). Nothing was written.")
        if num_layers % layout.pp:
            raise UserError(f"{iter_dir!r}: {num_layers} layers over pipeline size {layout.pp} is an uneven split, "
                            "which tnlg does not read. Nothing was written.")
        self.per_stage = num_layers // layout.pp
        self.files: dict[tuple[int, int], dict] = {}
        self.optimizers: dict[tuple[int, int], Optional[dict]] = {}
        self.states: dict[tuple[int, int], dict] = {}
        self._first = first
        for p in range(layout.pp):  # every rank file must be there before anything is written
            for t in range(layout.tp):
                path = self._path(t, p)
                if not os.path.isfile(path):
                    raise UserError(f"{iter_dir!r} was written at TP={layout.tp} x PP={layout.pp} (its args) but "
                                    f"{path!r} is missing: every rank's file is needed. Nothing was written.")

    def _path(self, t: int, p: int) -> str:
        return os.path.join(self.iter_dir, rank_dir(t, p, self.layout.pp), FILE)

    def _model(self, t: int, p: int) -> dict:
        if (t, p) not in self.files:
            path = self._path(t, p)
            state = self._first if (t, p) == (0, 0) else load_pt(path, "Megatron checkpoint file")
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
            self.files[(t, p)] = _flatten(state["model"], path)
            self.optimizers[(t, p)] = state.get("optimizer")
        return self.files[(t, p)]

    def _states(self, t: int, p: int, kind: str) -> dict:
        """One rank's optimizer state ``kind`` by parameter name (the legacy ``optimizer`` entry, read by
        :func:`~.optimizer.legacy_states`)."""
        from .optimizer import legacy_states
        if (t, p) not in self.states:
            model = self._model(t, p)
            self.states[(t, p)] = legacy_states(model, self.optimizers[(t, p)], self._path(t, p))
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
        where the checkpoint has none (a tied output layer)."""
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


def write_rank_files(iter_dir: str, common: dict, tp: int, pp: int, state_of_rank) -> list[str]:
    """One ``mp_rank_*/model_optim_rng.pt`` per (TP, PP) rank: ``common`` (``args``,
    ``checkpoint_version``, ``iteration``) plus ``model = state_of_rank(tp_rank, pp_rank)``; returns the
    files written. Each rank's state dict is built, saved and dropped before the next."""
    written = []
    for p in range(pp):
        for t in range(tp):
            path = os.path.join(iter_dir, rank_dir(t, p, pp), FILE)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            state = dict(common, model=state_of_rank(t, p))
            torch_file.save(state, path)  # a full disk: its OSError, not torch's RuntimeError
            written.append(path)
            del state
    return written


def local_extra_state(layers: range) -> dict:
    """The ``_extra_state`` entries (``None``) megatron-core's local spec keeps for its linear layers."""
    return {f"{CORE_LAYER_PREFIX}{j}.{n}._extra_state": None for j in layers for n in LOCAL_EXTRA_STATE}

