"""The distributed optimizer's bucket layout: where each parameter's Adam state lies in Megatron's
flat buffers (``--use-distributed-optimizer`` saved in ``dp_reshardable``, its default ``torch_dist``
layout, or in the legacy ``distrib_optim.pt`` files).

megatron-core 0.16.1 (``megatron/core/distributed/param_and_grad_buffer.py``, ``_ParamAndGradBuffer``)
lays one model-parallel rank's parameters (``named_parameters()`` of its stage, one buffer for all:
tnlg reads GPTs of one parameter dtype) into a flat buffer in *reverse* order: each parameter starts
at a multiple of 64 elements; a bucket closes after the parameter that brings it to ``bucket_size``
elements or more, and its end is padded to a multiple of ``lcm(DP, 128)`` (``lcm(DP, 128, 2^16)``
with ``--ddp-pad-buckets-for-high-nccl-busbw``); the tied embedding of a pipeline (``shared_embedding``:
the first stage's embedding, the last stage's copy) has a bucket of its own. ``bucket_size`` is
Megatron-LM's ``_build_ddp_config``: ``--ddp-bucket-size``, or the rank's parameter count over
``--ddp-num-buckets``, else ``max(4e7, 1e6 x DP)``; none (one bucket) without ``--overlap-grad-reduce``,
on pipeline stages after the first, and with ``--overlap-param-gather-with-optimizer-step``. Each DP rank
owns a contiguous ``1/DP`` of every bucket (``DistributedOptimizer``).

The checkpoints keep a bucket's first ``numel_unpadded`` elements (everything but the end padding) of
the fp32 ``param`` (the master), ``exp_avg`` and ``exp_avg_sq``:

* ``dp_reshardable`` (``sharded_param_state_dp_reshardable``): one DCP tensor per bucket,
  ``optimizer.distributed.dp_group_idx_<M>.gbuf_idx_0.dtype_<(param, grad dtype)>.bucket_idx_<B>.<state>``
  of global shape ``[numel_unpadded]``, ``M`` the model-parallel rank ``pp_rank x TP + tp_rank``;
* ``distrib_optim.pt`` (``save_parameter_state``, one per model-parallel rank beside its
  ``model_optim_rng.pt``): ``{0: {(param, grad dtype): {state: [sum of numel_unpadded]}}}``, the
  buckets' kept parts one after the other (``buckets_coalesced``).

So a parameter's state is the ``numel`` elements at its offset in its bucket: within a bucket the
offsets do not depend on DP (buckets start on multiples of 64 too), which is why DP matters only
through the default bucket size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union, cast

import torch

from ...errors import UserError
from .args import whole
from .names import GLOBAL_ROLES, LAYER_ROLES, Role, global_roles, layer_roles, swiglu_join

__all__ = ["Span", "BucketLayout", "BucketStates", "bucket_size", "layout_of_rank", "span_key", "stage_roles",
           "stage_layouts", "shifted_by_padding"]

_PARAM_ALIGN = 64
# megatron-core's registration order: input_layernorm, linear_proj, linear_qkv, q/k_layernorm, then the MLP's
_LAYER_ORDER = (*LAYER_ROLES[0:2], *LAYER_ROLES[4:6], *LAYER_ROLES[2:4], *LAYER_ROLES[12:], *LAYER_ROLES[6:12])
_DEFAULT_MIN, _DEFAULT_PER_DP = 40_000_000, 1_000_000


@dataclass(frozen=True)
class Span:
    """One parameter's place: its bucket and its first element's offset in the bucket."""
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    """One model-parallel rank's buffer: per parameter (its key: ``(role, layer)``) its span, per
    bucket its padded and kept (``unpadded``) sizes."""
    spans: dict
    numel: tuple
    unpadded: tuple

    def coalesced_offset(self, span: Span) -> int:
        """The span's offset in ``distrib_optim.pt``'s tensors (the buckets' kept parts concatenated)."""
        return sum(self.unpadded[:span.bucket]) + span.offset


def bucket_size(args, rank_numel: int, dp: Optional[int], pp_rank: int,
                where: str = "Megatron checkpoint") -> Optional[int]:
    """The ``bucket_size`` megatron-core's DDP used on this rank (module docstring); ``None``: one
    bucket. ``dp`` is needed only for the default size (``None`` where the args do not say it). A
    saved count or size that is no whole number is one :class:`UserError` naming it."""
    arg = lambda name: getattr(args, name, None)  # noqa: E731
    if not arg("overlap_grad_reduce") or pp_rank > 0 or arg("overlap_param_gather_with_optimizer_step"):
        return None
    if arg("ddp_num_buckets"):
        return rank_numel // whole(arg("ddp_num_buckets"), "the saved args' ddp_num_buckets", where, 1, 1 << 40)
    if arg("ddp_bucket_size"):
        return whole(arg("ddp_bucket_size"), "the saved args' ddp_bucket_size", where, 1, 1 << 62)
    return max(_DEFAULT_MIN, _DEFAULT_PER_DP * dp) if dp else None


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def layout_of_rank(params: list, size: Optional[int], dp: int, high_busbw: bool = False) -> BucketLayout:
    """``_ParamAndGradBuffer``'s layout of ``params`` (``(key, numel, shared_embedding)`` in
    ``named_parameters()`` order) with the distributed optimizer."""
    end_divisor = math.lcm(dp, 128, 2 ** 16) if high_busbw else math.lcm(dp, 128)
    starts: dict = {}
    bounds: list = []     # (start, padded end) of each closed bucket
    unpadded: list = []
    bucket_start = start = end = 0
    members = 0

    def close(end_index: int) -> int:
        nonlocal bucket_start, members
        unpadded.append(end_index - bucket_start)
        bounds.append((bucket_start, _pad(end_index, end_divisor)))
        bucket_start, members = bounds[-1][1], 0
        return bucket_start

    for key, numel, shared in reversed(params):  # reverse: roughly the order backward produces gradients
        start = _pad(start, _PARAM_ALIGN)
        if shared and members:
            start = close(start)
        end = start + numel
        starts[key] = (len(bounds), start, numel)
        members += 1
        start = close(end) if (size is not None and end - bucket_start >= size) or shared else end
    if members:
        close(end)
    spans = {k: Span(b, s - bounds[b][0], n) for k, (b, s, n) in starts.items()}
    return BucketLayout(spans, tuple(e - s for s, e in bounds), tuple(unpadded))


def span_key(role: Role, layer) -> tuple:
    """The key of a parameter's :class:`Span`: the Megatron tensor (its local-spec name; grouped-query
    attention's ``c_q`` and ``c_kv`` roles share ``linear_qkv``'s) and its layer (``"copy"``: the last
    stage's copy of a tied embedding)."""
    return role.core[0], layer


def stage_roles(cfg) -> tuple[tuple[Role, ...], tuple[Role, ...], tuple[Role, ...]]:
    """``(first stage's, each layer's, last stage's)`` roles of ``cfg``'s Megatron tensors, one per tensor,
    in megatron-core GPTModel's ``named_parameters()`` order: the embeddings (learned positions only with
    them); per layer its input norm, the attention's output projection before its QKV (``Attention``
    registers ``linear_proj``, then ``SelfAttention`` its ``linear_qkv``), the pre-MLP norm and the two
    MLP layers, weight before bias (the biases and LayerNorm's bias only where ``cfg`` has them); then the
    final norm and an untied output layer. Grouped-query attention's ``c_q`` / ``c_kv`` roles are one
    tensor (one is kept); SwiGLU's fc1 keeps its ``take`` (its TP shards pair as ``[gate_r; up_r]``)."""
    by_tensor = {r.core: r for r in layer_roles(cfg)}
    layer = tuple(by_tensor[r.core] for r in _LAYER_ORDER if r.core in by_tensor)
    first, last = global_roles(cfg)
    return first, layer, last


def _stage_params(source, cfg, stage: int) -> list:
    """``(key, numel on one TP rank, shared_embedding)`` of pipeline ``stage``'s parameters in megatron-core
    GPTModel's ``named_parameters()`` order (:func:`stage_roles`); ``key``: :func:`span_key`. (A model
    whose order differs is refused by the stores' checks where the sizes tell it.)"""
    tp, pp = source.layout.tp, source.layout.pp
    tied = not cfg.untie_embeddings_and_output_weights
    per = cfg.num_layers // pp
    first, layer_order, last = stage_roles(cfg)
    entries: list[tuple[Role, Union[int, str, None], Optional[int], bool]] = []  # role, layer/"copy", stage, shared
    if stage == 0:
        entries += [(role, None, stage, tied and pp > 1 and role is GLOBAL_ROLES[0]) for role in first]
    entries += [(role, i, None, False) for i in range(stage * per, (stage + 1) * per) for role in layer_order]
    if stage == pp - 1:
        entries += [(role, None, stage, False) for role in last]
        if tied and pp > 1:  # the last stage's copy of the embedding: a bucket of its own
            entries.append((GLOBAL_ROLES[0], "copy", 0, True))
    out = []
    for role, layer, at, shared in entries:
        numel = math.prod(source.shape(role, None if layer == "copy" else layer, at))
        out.append((span_key(role, layer), numel // (tp if role.split is not None else 1), shared))
    return out


def _data_parallel_size(args, tp: int, pp: int, where: str) -> Optional[int]:
    """The run's DP size: ``data_parallel_size``, else ``world_size / (TP x PP)``; ``None`` where neither
    is saved (each a whole number, else one :class:`UserError` naming it)."""
    dp = getattr(args, "data_parallel_size", None)
    if dp is None and getattr(args, "world_size", None):
        dp = whole(args.world_size, "the saved args' world_size", where, 1, 1 << 40) // (tp * pp)
    elif dp is not None:
        dp = whole(dp, "the saved args' data_parallel_size", where, 0, 1 << 40)
    return dp or None


def stage_layouts(source, cfg, args, where: str) -> list:
    """The :class:`BucketLayout` of each pipeline stage's model-parallel ranks (a stage's TP ranks hold
    parameters of the same sizes), from the saved ``args``."""
    tp, pp = source.layout.tp, source.layout.pp
    dp = _data_parallel_size(args, tp, pp, where)
    out = []
    for p in range(pp):
        params = _stage_params(source, cfg, p)
        size = bucket_size(args, sum(n for _, n, _ in params), dp, p, where)
        if size is None and p == 0 and getattr(args, "overlap_grad_reduce", False) and not (
                getattr(args, "overlap_param_gather_with_optimizer_step", False)):
            raise UserError(f"{where}: the args set --overlap-grad-reduce without --ddp-bucket-size, so the "
                            "gradient buckets have Megatron's default size max(4e7, 1e6 x DP), but they give no "
                            "data_parallel_size (nor world_size). Nothing was written.")
        out.append(layout_of_rank(params, size, dp or 1, bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw",
                                                                        False))))
    return out


def shifted_by_padding(layout: BucketLayout) -> Optional[tuple]:
    """The key of the parameter that megatron-core 0.16.1's ``fully_reshardable`` save misplaces most
    (``None`` where it misplaces none). That save gathers the buckets' kept parts one after the other
    (``get_parameter_state_dp_zero``) but cuts each parameter at its offset in the padded buffer
    (``param_index_map``): every parameter after a bucket's end padding is read that many elements too
    far (its log: "param range exceeds unpadded buffer"). The stage's first parameter lies in the last
    bucket, after all the padding."""
    padding = sum(n - u for n, u in zip(layout.numel[:-1], layout.unpadded[:-1]))
    return next(reversed(layout.spans)) if padding else None


class BucketStates:
    """The distributed optimizer's states by parameter, as the checkpoint sources give tensors:
    :meth:`tensor` with ``prefix`` a state (``exp_avg``, ``exp_avg_sq``, ``param``: the master) is the
    parameter's full state, its TP ranks' spans (module docstring) read from ``store`` (one span at a
    time) and concatenated along Megatron's split; without ``prefix``, the weight (``source``'s)."""

    def __init__(self, source, cfg, args, store, where: str):
        self.source, self.layout, self.iter_dir, self.format = source, source.layout, source.iter_dir, source.format
        self.store, self.per_stage = store, cfg.num_layers // source.layout.pp
        self.stages = stage_layouts(source, cfg, args, where)
        for p, stage in enumerate(self.stages):
            for t in range(self.layout.tp):
                store.check(t, p, stage, where)

    def _span(self, role: Role, layer: Optional[int], stage: Optional[int]):
        p = cast(int, stage) if layer is None else layer // self.per_stage  # (a global role names its stage)
        return p, self.stages[p].spans.get(span_key(role, layer))

    def shape(self, role: Role, layer: Optional[int], stage: Optional[int] = None, prefix: str = ""):
        if prefix and self._span(role, layer, stage)[1] is None:
            return None
        return self.source.shape(role, layer, stage)

    def tensor(self, role: Role, layer: Optional[int], stage: Optional[int] = None, prefix: str = ""):
        if not prefix:
            return self.source.tensor(role, layer, stage)
        p, span = self._span(role, layer, stage)
        if span is None:
            return None
        shape = list(self.source.shape(role, layer, stage))
        ranks = self.layout.tp if role.split is not None else 1
        if role.split is not None:
            shape[role.split] //= ranks
        parts = [self.store.flat(t, p, prefix, self.stages[p], span).reshape(shape) for t in range(ranks)]
        if role.take == "swiglu":  # each rank's [gate_r; up_r] -> [gate; up]
            return swiglu_join(parts)
        return parts[0] if ranks == 1 or role.split is None else torch.cat(parts, dim=role.split)

    @property
    def dtype(self):
        return self.source.dtype
