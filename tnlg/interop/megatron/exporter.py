"""A tnlg checkpoint -> a Megatron-LM checkpoint (``tnlg convert --from CKPT --to megatron DIR``).

Writes ``DIR/latest_checkpointed_iteration.txt`` and ``DIR/iter_NNNNNNN/`` in Megatron's
``torch_dist`` format (default) or its legacy per-rank format at TP ``tp`` x PP ``pp``, with the
``args`` Megatron-LM needs to rebuild the model (:func:`.args.args_for`; ``--use-checkpoint-args``
reads them) and no optimizer or RNG state (load with ``--no-load-optim --no-load-rng``, or
``--finetune``). Names are megatron-core's: the local spec's in legacy files, the ``torch_dist``
keys (valid for the local and Transformer Engine specs) in ``torch_dist``. The vocabulary is
padded as Megatron pads it at ``tp`` (a multiple of ``make_vocab_size_divisible_by * tp``), the
padded rows zeros. A mixture of experts: in ``torch_dist`` its experts stacked per layer (EP-independent;
``ep`` only recorded in the args), in legacy files split over ``ep`` expert-parallel ranks
(``mp_rank_TT[_PPP]_EEE``) under megatron-core's ``SequentialMLP`` names, or with ``grouped_gemm`` the legacy
``GroupedMLP``'s (``experts.weight1`` / ``weight2``, Megatron's ``--moe-grouped-gemm``; :mod:`.names`). The source may be saved
at any TP x PP: each tensor is read by name from the files
the manifest names for it (a pipeline run's stage files; the last stage's tied copy of the embedding
is not stored, and a tied head is written from the embedding).

Everything is written under ``DIR.tmp-<pid>`` beside ``DIR`` and renamed into place: a failure
leaves nothing at ``DIR``. Memory: ``torch_dist`` holds one tensor at a time; a legacy file is one
``torch.save`` of one rank's state dict (its 1/(tp pp) of the weights), built and dropped per rank.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from ...checkpoint import files as F
from ...checkpoint.manifest import Manifest, need
from ...checkpoint.reshard import ShardReader, full_targets
from ...config import GPTConfig, divisors, padded_vocab_size
from ...errors import UserError
from ...io import fsync_dir, temporary_name
from .args import args_for
from .legacy import local_extra_state, write_rank_files
from .names import (CORE_LAYER_PREFIX, EXPERT_TAKES, GLOBAL_ROLES, LOCAL_EXTRA_STATE, VOCAB_PARAMS, Role,
                    global_roles, grouped_expert_tensor, layer_roles, local_expert_names, per_layer_keys, qkv_from_tnlg,
                    swiglu_shard, tnlg_name)
from .torch_dist import TorchDistWriter

__all__ = ["checkpoint_to_megatron", "check_megatron_layout", "FORMATS"]

FORMATS = ("torch_dist", "legacy")


def check_megatron_layout(cfg: GPTConfig, tp: int, pp: int) -> None:
    """Megatron's own constraints on TP x PP (it splits heads, the MLP and layers evenly)."""
    for flag, size in (("--tp", tp), ("--pp", pp)):
        if not isinstance(size, int) or size < 1:
            raise UserError(f"{flag} must be a positive integer, got {size!r}.")
    if cfg.num_attention_heads % tp:
        valid = divisors(cfg.num_attention_heads)
        raise UserError(f"--tp {tp}: Megatron-LM needs num_attention_heads ({cfg.num_attention_heads}) to be a "
                        f"multiple of tensor_model_parallel_size ({tp}); valid TP sizes for this model: {valid}. "
                        "Nothing was written.")
    ffn = cfg.ffn_hidden_size
    assert ffn is not None  # GPTConfig.__post_init__ sets it
    if cfg.kv_groups % tp:
        valid = [t for t in divisors(cfg.kv_groups) if ffn % t == 0]
        raise UserError(f"--tp {tp}: Megatron-LM needs num_query_groups ({cfg.kv_groups}) to be a multiple of "
                        f"tensor_model_parallel_size ({tp}) (each rank holds whole key/value groups; tnlg itself runs "
                        f"this model at any TP, Megatron does not); valid TP sizes for a Megatron export of this "
                        f"model: {valid}. Nothing was written.")
    if ffn % tp:
        raise UserError(f"--tp {tp}: Megatron-LM splits ffn_hidden_size ({cfg.ffn_hidden_size}) evenly over TP; {tp} "
                        "does not divide it. Nothing was written.")
    if cfg.num_layers % pp:
        valid = divisors(cfg.num_layers)
        raise UserError(f"--pp {pp}: {cfg.num_layers} layers do not split evenly into {pp} pipeline stages; valid "
                        f"sizes: {valid}. Nothing was written.")


def _check_experts(cfg: GPTConfig, fmt: str, ep: int, grouped_gemm: bool = False) -> None:
    """A mixture of experts' experts split evenly over ``ep`` ranks (``grouped_gemm``: in legacy files); a dense
    model at EP 1, without grouped experts."""
    if not isinstance(ep, int) or ep < 1:
        raise UserError(f"--ep must be a positive integer, got {ep!r}.")
    if cfg.num_experts is None:
        if ep != 1:
            raise UserError(f"--ep {ep}: the model has no experts (a dense model is written at EP 1). Nothing was "
                            "written.")
        if grouped_gemm:
            raise UserError("--moe-grouped-gemm: the model has no experts (a dense model), so there are no grouped "
                            "expert weights to write. Nothing was written.")
        return
    if grouped_gemm and fmt != "legacy":
        raise UserError(f"--moe-grouped-gemm with --format {fmt}: torch_dist stores the experts in one layout that "
                        "megatron-core loads into SequentialMLP and GroupedMLP alike (so the flag changes nothing "
                        "there); it names the legacy files' GroupedMLP weights (--format legacy). Nothing was "
                        "written.")
    if cfg.num_experts % ep:
        valid = divisors(cfg.num_experts)
        raise UserError(f"--ep {ep}: Megatron-LM splits the {cfg.num_experts} experts evenly over the expert-parallel "
                        f"ranks; valid sizes: {valid}. Nothing was written.")


class _Full:
    """The tnlg checkpoint's full tensors in Megatron's layout, one at a time."""

    def __init__(self, iter_dir: str, manifest: Manifest, cfg: GPTConfig, padded: int):
        self.reader, self.targets = ShardReader(iter_dir, manifest, F.model_file), full_targets(manifest)
        self.cfg, self.padded = cfg, padded

    def __call__(self, role: Role, layer: Optional[int]) -> torch.Tensor:
        if role.take in ("q", "kv"):  # grouped-query attention: Megatron's linear_qkv of c_q and c_kv
            q = tnlg_name(role, layer).replace(".c_kv.", ".c_q.")
            return qkv_from_tnlg(self._read(q), self._read(q.replace(".c_q.", ".c_kv.")), self.cfg)
        t = self._read(tnlg_name(role, layer))
        if role.take == "experts_fc1" and t.dim() == 4:  # SwiGLU experts [E, 2, f, h] -> [E, 2 f, h]
            return t.flatten(1, 2)
        return t.flatten(0, 1) if role.take == "swiglu" else t  # [2, f, h] -> [gate; up]

    def _read(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and not self.cfg.untie_embeddings_and_output_weights:
            name = "transformer.wte.weight"  # a tied head: the embedding
        t = self.reader.tensor(name, name, self.targets[name])
        if name in VOCAB_PARAMS and self.padded > t.shape[0]:  # Megatron's padding rows: zeros
            t = torch.cat([t, t.new_zeros(self.padded - t.shape[0], *t.shape[1:])])
        return t


def _rank_state(full: _Full, cfg: GPTConfig, t: int, tp: int, p: int, pp: int, e: int = 0, ep: int = 1,
                grouped_gemm: bool = False) -> dict:
    """One legacy rank's ``model``: the local spec's state dict of TP rank ``t``'s shard of stage ``p`` (with
    experts: EP rank ``e``'s experts, megatron-core's ``SequentialMLP`` names or, ``grouped_gemm``, the legacy
    ``GroupedMLP``'s; :mod:`.names`)."""
    per_stage = cfg.num_layers // pp

    def shard(x: torch.Tensor, role: Role) -> torch.Tensor:
        if role.take == "swiglu":
            return swiglu_shard(x, tp, t)  # this rank's [gate_r; up_r]
        return x if role.split is None else x.chunk(tp, dim=role.split)[t].clone()

    out: dict = {}
    first, last = global_roles(cfg)
    if p == 0:
        for role in first:
            out[role.core[0]] = shard(full(role, None), role)
    extra: dict = {}
    for j in range(per_stage):
        layer = p * per_stage + j
        for role in _megatron_layer_roles(cfg, layer):
            if role.take in EXPERT_TAKES:
                out.update(_expert_state(full(role, layer), role, cfg, j, t, tp, e, ep, grouped_gemm))
            else:
                out[f"{CORE_LAYER_PREFIX}{j}.{role.core[0]}"] = shard(full(role, layer), role)
        extra.update(local_extra_state([j], _extra_state_names(cfg, layer, ep, grouped_gemm)))
    out.update(extra)
    if p == pp - 1:
        for role in last[:(1 if cfg.normalization == "RMSNorm" else 2)]:
            out[role.core[0]] = shard(full(role, None), role)
        if cfg.untie_embeddings_and_output_weights or pp > 1:  # a tied head's copy on the last stage
            out[GLOBAL_ROLES[4].core[0]] = shard(full(GLOBAL_ROLES[4], None), GLOBAL_ROLES[4])
        out["output_layer._extra_state"] = None
    return out


def _expert_state(experts: torch.Tensor, role: Role, cfg: GPTConfig, j: int, t: int, tp: int, e: int,
                  ep: int, grouped_gemm: bool = False) -> dict:
    """EP rank ``e``'s experts of one layer (``experts``: Megatron's full ``[E, 2 f, h]`` / ``[E, h, f]``), TP
    shard ``t`` of each, under their local indices (``local_experts.<i>``), or with ``grouped_gemm`` as the one
    ``GroupedMLP`` tensor that holds them (``experts.weight1`` / ``weight2``)."""
    local = experts.shape[0] // ep
    shards = []
    for i in range(local):
        x = experts[e * local + i]
        if role.take == "experts_fc1":
            x = swiglu_shard(x, tp, t) if cfg.swiglu else x.chunk(tp, dim=0)[t].clone()
        else:
            x = x.chunk(tp, dim=1)[t].clone()
        shards.append(x)
    if grouped_gemm:
        return {f"{CORE_LAYER_PREFIX}{j}.{role.core[1]}": grouped_expert_tensor(role, shards)}
    return {f"{CORE_LAYER_PREFIX}{j}.{name}": x for name, x in zip(local_expert_names(role, local), shards)}


def _shared_extra_state(cfg: GPTConfig) -> tuple[str, ...]:
    return (("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
            if cfg.moe_shared_expert_intermediate_size is not None else ())


def _extra_state_names(cfg: GPTConfig, layer: int, ep: int, grouped_gemm: bool = False) -> tuple[str, ...]:
    """The linear layers of ``layer`` whose ``_extra_state`` the local spec keeps (a mixture of experts: its
    local experts' (none for the legacy ``GroupedMLP``) and its shared expert's instead of the dense MLP's)."""
    if not cfg.is_moe_layer(layer):
        return LOCAL_EXTRA_STATE
    assert cfg.num_experts is not None
    experts = () if grouped_gemm else tuple(f"mlp.experts.local_experts.{i}.linear_fc{k}"
                                            for i in range(cfg.num_experts // ep) for k in (1, 2))
    return LOCAL_EXTRA_STATE[:2] + experts + _shared_extra_state(cfg)


def _write_torch_dist(iter_dir: str, full: _Full, cfg: GPTConfig, common: dict) -> None:
    """The ``torch_dist`` store: stacked layer keys, or per layer where megatron-core saves this model so
    (:func:`.names.per_layer_keys` of the args' ``moe_layer_freq``)."""
    writer = TorchDistWriter(iter_dir, cfg.num_layers, per_layer_keys(getattr(common["args"], "moe_layer_freq", 1)))
    first, last = global_roles(cfg)
    for role in first:
        writer.add(role, None, full(role, None))
    for i in range(cfg.num_layers):
        for role in _megatron_layer_roles(cfg, i):
            writer.add(role, i, full(role, i))
        if cfg.is_moe_layer(i):
            assert cfg.num_experts is not None
            writer.add_extra_states(i, LOCAL_EXTRA_STATE[:2] + _shared_extra_state(cfg), cfg.num_experts,
                                    ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"))
        else:
            writer.add_extra_states(i)
    for role in last:
        writer.add(role, None, full(role, None))
    writer.close(common)


def _megatron_layer_roles(cfg: GPTConfig, layer: Optional[int] = None) -> list[Role]:
    """One role per Megatron tensor of ``layer`` (grouped-query attention's c_q and c_kv are one linear_qkv)."""
    return [r for r in layer_roles(cfg, layer) if r.take != "kv"]


def checkpoint_to_megatron(path: str, dst: str, fmt: str = "torch_dist", tp: int = 1, pp: int = 1, ep: int = 1,
                           grouped_gemm: bool = False) -> str:
    """Write the tnlg checkpoint at ``path`` as a new Megatron-LM checkpoint root ``dst`` (module
    docstring); returns its iteration folder. ``ep``: a mixture of experts' experts split over that many
    expert-parallel ranks' files (legacy; ``torch_dist`` records it in the args); ``grouped_gemm``: the legacy
    files' experts as ``GroupedMLP`` weights (Megatron's ``--moe-grouped-gemm``)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: Megatron checkpoints are written as {' or '.join(FORMATS)}.")
    iter_dir = F.resolve(path, "--from")
    if iter_dir is None:
        raise UserError(f"--from {path!r} holds no tnlg checkpoint (no {F.LATEST} and no iter_* directory).")
    manifest = Manifest.read(iter_dir)
    F.check_files(iter_dir, manifest, ("model",))
    F.verify_checksums(iter_dir, manifest, {n for n in manifest.files if n.startswith("model")})
    cfg = GPTConfig.from_dict(need(manifest.config, "config"))
    check_megatron_layout(cfg, tp, pp)
    _check_experts(cfg, fmt, ep, grouped_gemm)
    padded = padded_vocab_size(cfg.vocab_size, tp, cfg.make_vocab_size_divisible_by)
    dtype = getattr(torch, need(manifest.layout.param_dtype, "layout.param_dtype"))
    iteration = int(need(manifest.iteration, "iteration"))
    args = args_for(cfg, tp, pp, iteration, int(manifest.consumed_samples), fmt, dtype, manifest.tokenizer, ep,
                    grouped_gemm)
    common = dict(args=args, checkpoint_version=3.0, iteration=iteration, num_floating_point_operations_so_far=0)
    full = _Full(iter_dir, manifest, cfg, padded)
    root = os.path.abspath(dst)
    if os.path.lexists(root) and (not os.path.isdir(root) or os.listdir(root)):
        raise UserError(f"destination {dst!r} already exists and is not empty; choose a new directory (nothing is "
                        "overwritten).")
    tmp = temporary_name(root)
    name = f"iter_{iteration:07d}"
    try:
        os.makedirs(os.path.join(tmp, name))
        if fmt == "torch_dist":
            _write_torch_dist(os.path.join(tmp, name), full, cfg, common)
        else:
            write_rank_files(os.path.join(tmp, name), common, tp, pp,
                             lambda t, p, e: _rank_state(full, cfg, t, tp, p, pp, e, ep, grouped_gemm), ep)
        with open(os.path.join(tmp, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
        if os.path.isdir(root):
            os.rmdir(root)  # empty (checked above)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # only the temporary folder this call created
        raise
    fsync_dir(os.path.dirname(root))
    return os.path.join(root, name)
