"""A mixture-of-experts MLP (megatron-core 0.16.1's ``MoELayer`` semantics, its flag names): the router, the
load-balancing and z losses, top-k dispatch (dropless, or a capacity with megatron-core's dropping), routed
experts run as one grouped matmul, and an optional shared expert (Qwen2-MoE's sigmoid gate too). It goes in
the block's MLP slot (:func:`tnlg.model.spec.block_spec`, ``--moe-layer-freq``). docs/moe.md has the maths.

**Routing** (:func:`topk_routing`, megatron-core's ``topk_routing_with_score_function``): softmax scores,
either top-k of the logits then a softmax over the k (the weights sum to 1: Mixtral; Qwen's
``norm_topk_prob``) or, ``--moe-router-pre-softmax``, a softmax over every expert then the top-k (not
renormalised); or sigmoid scores, the top-k chosen on ``score + expert_bias`` and renormalised (DeepSeek-V3).
``--moe-router-topk-scaling-factor`` multiplies the weights. With ``--moe-expert-capacity-factor`` each expert
keeps at most ``ceil(T k / E x factor)`` of the micro batch's ``T`` tokens (:func:`drop_to_capacity`:
those of the highest weight, or the first ones). The expert outputs are weighted by the routing weights and
summed (megatron-core's unpermute).

**Losses** (added to :attr:`~tnlg.model.forward.ForwardContext.aux`, summed over layers, only in training
with gradients, as megatron-core): the Switch load-balancing loss ``E coeff / (k T^2) sum_e P_e n_e``
(:func:`load_balancing_loss`; ``P_e`` the summed softmax scores of expert ``e``, ``n_e`` its tokens in the
top-k of the scores), per sequence and averaged with ``seq_aux_loss``, and the z-loss ``coeff mean_t
logsumexp(logits_t)^2`` (:func:`z_loss`). Megatron-core computes them on each TP (and CP) rank's positions and
divides the z-loss coefficient by TP x CP; here every TP rank routes the whole sequence (below) and the CP
ranks' parts are summed (:meth:`MoELayer._losses`), so the loss is the whole micro batch's, the value
megatron-core's ranks add up to.

**Tensor parallelism.** The experts' widths split over TP as the dense MLP's (megatron-core's default expert
TP = TP): every TP rank routes all the tokens of its micro batch and runs its slice of every expert on
them; the slices' partial outputs are summed over TP (all-reduce, or with sequence parallelism a
reduce-scatter back to the rank's positions). With sequence parallelism the router runs on the rank's
positions (its weight through ``f``) and its logits are all-gathered (backward: the rank's slice, the
gradient being the same on every TP rank); the tokens themselves are all-gathered as a column-parallel
layer's input. The routing weights pass through ``f``: their gradient is a partial sum per TP rank.

**Expert parallelism** (``ps.size("ep")``): the experts split over the EP ranks, tokens dispatched and
combined by all-to-all (:mod:`tnlg.parallel.experts`); the expert parameters' gradients are reduced over the
expert-data-parallel ranks (gradient kind ``"expert"``, :data:`tnlg.parallel.state.GRADIENT_AXES`).

**The grouped matmul** (:func:`grouped_matmul`): ``torch._grouped_mm`` (one kernel for every local expert)
where it runs (torch 2.13: CPU and CUDA, fp32 and bf16, rows of a multiple of 16 bytes; its backward too),
else a loop over the local experts. Both give the same numbers up to the kernels' summation order.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..config import GPTConfig, partition_sizes
from ..errors import UserError
from ..parallel import experts as ep_comm
from ..parallel.initialization import SelfInitializing
from ..parallel.layers import swiglu
from ..parallel.mappings import (copy_to_tp, gather_from_sequence_parallel, gather_sequence_replicated,
                                 reduce_from_tp, reduce_scatter_to_sequence_parallel)
from ..parallel.sharding import ShardSpec
from ..parallel.state import ParallelState
from .forward import ForwardContext
from .init_methods import init_methods, join_key

__all__ = ["topk_routing", "drop_to_capacity", "aux_loss_scores", "load_balancing_loss", "z_loss", "aux_loss_names",
           "even_routing_map", "Router", "GroupedExperts", "MoELayer", "grouped_matmul", "is_expert_parameter",
           "update_expert_bias"]


# ----------------------------------------------------------------------------------------------- routing
def topk_routing(logits: torch.Tensor, topk: int, pre_softmax: bool = False, score_function: str = "softmax",
                 scaling_factor: Optional[float] = None,
                 expert_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing weights [T, E], routing map [T, E] bool)`` of router ``logits [T, E]`` (module docstring)."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, idx = torch.topk(scores, k=topk, dim=1)
        else:
            top, idx = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    else:  # sigmoid
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, idx = torch.topk(scores + expert_bias, k=topk, dim=1)
            probs = torch.gather(scores, 1, idx)
        else:
            probs, idx = torch.topk(scores, k=topk, dim=1)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else probs
    if scaling_factor:
        probs = probs * scaling_factor
    weights = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return weights, routing_map


def even_routing_map(tokens: int, topk: int, num_experts: int, capacity_factor: Optional[float] = None,
                     pad: bool = False, device=None) -> torch.Tensor:
    """The routing map ``[tokens, E]`` (bool) of even routing, what the planner assumes and the fake-tensor
    simulation runs: token ``t``'s ``j``-th copy goes to expert ``(t k + j) mod E`` (``k`` different experts per
    token), so every expert gets ``T k / E`` copies (the first ``T k mod E`` experts one more). With a capacity
    factor each expert keeps its first :func:`capacity` tokens (``pad``: exactly that many, as
    :func:`drop_to_capacity` pads)."""
    cols = (torch.arange(tokens, device=device)[:, None] * topk + torch.arange(topk, device=device)) % num_experts
    rmap = torch.zeros(tokens, num_experts, dtype=torch.bool, device=device).scatter(1, cols, True)
    if capacity_factor is not None:
        cap = capacity(tokens, topk, num_experts, capacity_factor)
        first = torch.arange(tokens, device=device)[:, None] < cap
        rmap = first.expand_as(rmap) if pad else rmap & (rmap.cumsum(0) <= cap)
    return rmap


def capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Each expert's capacity: ``ceil(tokens x topk / experts x factor)`` (megatron-core's ``get_capacity``)."""
    return math.ceil(tokens * topk / num_experts * factor)


def drop_to_capacity(weights: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float,
                     policy: str = "probs", pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most :func:`capacity` tokens per expert: those of the highest weight (``"probs"``) or the first
    ones (``"position"``); ``pad``: every expert takes exactly its capacity (the padding tokens weigh 0)."""
    T, E = weights.shape
    cap = capacity(T, topk, E, factor)
    if cap > T:
        keep = torch.ones_like(routing_map)
    else:
        key = weights if policy == "probs" else routing_map.int()
        _, rows = torch.topk(key, k=cap, dim=0, sorted=False)
        keep = torch.zeros_like(routing_map).scatter(0, rows, True)
    final = keep if pad else routing_map & keep
    return weights * final, final


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing map, scores)`` the balancing losses read: the scores over every expert (softmax, or the
    sigmoid normalised to sum 1) and their top-k, before any capacity (megatron-core's
    ``compute_routing_scores_for_aux_loss``)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, idx = torch.topk(scores, k=topk, dim=1)
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True), scores


def load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int, topk: int,
                        num_experts: int, coeff: float) -> torch.Tensor:
    """Switch Transformer's balancing loss, megatron-core's normalisation:
    ``E coeff / (k T^2) sum_e (sum_t scores[t, e]) n_e``."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (num_experts * coeff / (topk * total_tokens ** 2))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff mean_t logsumexp(logits_t)^2``."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def aux_loss_names(cfg: GPTConfig) -> tuple[str, ...]:
    """The auxiliary losses a model of ``cfg`` adds in training (:attr:`~tnlg.model.forward.ForwardContext.aux`),
    by the names the log shows, in order: ``z_loss`` (``--moe-z-loss-coeff``), then ``load_balancing_loss``
    (``aux_loss``) or ``seq_load_balancing_loss`` (``seq_aux_loss``) with ``--moe-aux-loss-coeff``; none for a
    dense model."""
    if cfg.num_experts is None or not cfg.num_moe_layers:
        return ()
    names = ["z_loss"] if cfg.moe_z_loss_coeff else []
    kind = cfg.moe_router_load_balancing_type
    if cfg.moe_aux_loss_coeff and kind != "none":
        names.append("load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss")
    return tuple(names)


# ----------------------------------------------------------------------------------------------- modules
class Router(SelfInitializing, nn.Module):
    """The gating linear ``[E, h]`` (no bias; replicated over TP and EP, initialised as the dense weights),
    and with ``--moe-router-enable-expert-bias`` the expert bias (fp32 buffer, saved) and the tokens each
    expert got since its last update (:func:`update_expert_bias`)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, device=None, init_key: str = ""):
        super().__init__()
        assert cfg.num_experts is not None
        self.ps = ps
        self.weight = ShardSpec((cfg.num_experts, cfg.hidden_size)).parameter(ps.tp_rank, device)
        self.expert_bias: Optional[torch.Tensor]
        self.local_tokens_per_expert: Optional[torch.Tensor]
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(cfg.num_experts, device=device),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        self.set_init({"weight": init_methods(cfg)[0]}, cfg.seed, init_key)


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is a routed expert's (split over EP; gradient kind ``"expert"``)."""
    return getattr(param, "gradient_kind", "dense") == "expert"


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` (rows grouped by expert, ``counts [E]`` per expert) times each group's ``w[e] [out, in]``
    transposed: ``[N, out]``. One ``torch._grouped_mm`` where it runs (module docstring), else a loop; under
    autocast in the autocast dtype."""
    grouped = getattr(torch, "_grouped_mm", None)
    kind = x.device.type
    if torch.is_autocast_enabled(kind):  # (not an autocast op: run it in the autocast dtype, as F.linear would)
        dtype = torch.get_autocast_dtype(kind)
        x, w = x.to(dtype), w.to(dtype)
    bytes_in, bytes_out = x.shape[1] * x.element_size(), w.shape[1] * w.element_size()
    if (grouped is not None and x.shape[0] > 0 and x.dtype in (torch.float32, torch.bfloat16)
            and bytes_in % 16 == 0 and bytes_out % 16 == 0):
        offs = torch.cumsum(counts.to(torch.int32), 0, dtype=torch.int32)
        return grouped(x.contiguous(), w.transpose(1, 2), offs=offs)
    outs = [F.linear(part, w[e]) for e, part in enumerate(x.split(counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))


class GroupedExperts(SelfInitializing, nn.Module):
    """This rank's routed experts, every one an MLP (SwiGLU or GELU, no biases) with its width split over
    TP: ``fc1`` ``[E_local, 2, f_r, h]`` (SwiGLU's gate and up rows, paired as the dense gated layer's) or
    ``[E_local, f_r, h]``, ``fc2`` ``[E_local, h, f_r]``.

    Initialisation is TP- and EP-invariant: each weight of all ``E`` experts is drawn in full from its
    generator (:func:`tnlg.parallel.initialization.param_generator`), then this EP rank's experts and this
    TP rank's columns are kept (the ``expert_split`` mark, :func:`tnlg.parallel.sharding.shard_of`)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, device=None, init_key: str = ""):
        super().__init__()
        E, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_hidden_size
        assert E is not None
        self.ps, self.ep, self.ep_rank = ps, ps.size("ep"), ps.rank_in("ep")
        self.num_experts, self.local = E, E // self.ep
        self.swiglu, self.gelu_approximate = cfg.swiglu, "tanh" if cfg.openai_gelu else "none"
        sizes = tuple(partition_sizes(f, ps.tp_size))
        fc1 = ShardSpec((self.local, 2, f, h), 2, sizes) if cfg.swiglu else ShardSpec((self.local, f, h), 1, sizes)
        self.fc1 = fc1.parameter(ps.tp_rank, device)
        self.fc2 = ShardSpec((self.local, h, f), 2, sizes).parameter(ps.tp_rank, device)
        for p in (self.fc1, self.fc2):
            p.gradient_kind = "expert"  # type: ignore[attr-defined]
            p.expert_split = (self.ep_rank, self.ep)  # type: ignore[attr-defined]
        init, scaled = init_methods(cfg)
        self.set_init({"fc1": init, "fc2": scaled}, cfg.seed, init_key)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [N, h]`` grouped by local expert (``counts [E_local]``) -> this TP rank's partial outputs ``[N, h]``."""
        fc1, fc2 = ep_comm.scale_grad(self.fc1, 1.0 / self.ep), ep_comm.scale_grad(self.fc2, 1.0 / self.ep)
        y = grouped_matmul(x, fc1.flatten(1, 2) if self.swiglu else fc1, counts)
        y = swiglu(y) if self.swiglu else F.gelu(y, approximate=self.gelu_approximate)
        return grouped_matmul(y, fc2, counts)


class MoELayer(nn.Module):
    """The MLP slot's mixture of experts (module docstring): ``forward(x, ctx)`` maps ``[s, b, h]`` (sequence-
    parallel ``[s_r, b, h]``) to the same layout and adds its losses to ``ctx.aux``. ``last_load``: the
    tokens each expert got in the last forward (this rank's micro batch, ``[E]``, after any dropping).
    ``shared_mlp``: the shared expert's constructor, ``(cfg, ps, device=, init_key=, ffn_hidden_size=)`` (the
    layer spec passes the dense MLP, :func:`tnlg.model.spec.moe_mlp`)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, layer_idx: int, device=None, init_key: str = "",
                 shared_mlp: Optional[Callable[..., nn.Module]] = None):
        super().__init__()
        assert cfg.num_experts is not None
        cfg.check_expert_parallel(ps.size("ep"))
        if ps.cp_size > 1 and cfg.moe_expert_capacity_factor is not None:
            raise UserError(f"--moe-expert-capacity-factor {cfg.moe_expert_capacity_factor:g} with context parallelism "
                            f"(CP {ps.cp_size}): an expert's capacity is over the micro batch's tokens, which the CP "
                            "ranks hold in parts (dropping them alike is not built); drop the factor (dropless) or "
                            "use CP 1.")
        self.cfg, self.ps, self.layer_idx = cfg, ps, layer_idx
        self.router = Router(cfg, ps, device, join_key(init_key, "router"))
        self.experts = GroupedExperts(cfg, ps, device, join_key(init_key, "experts"))
        shared = cfg.moe_shared_expert_intermediate_size
        if shared is not None and shared_mlp is None:
            raise ValueError("a shared expert (moe_shared_expert_intermediate_size) needs its constructor, shared_mlp")
        self.shared_expert = None if shared is None or shared_mlp is None else shared_mlp(
            cfg, ps, device=device, init_key=join_key(init_key, "shared_expert"), ffn_hidden_size=shared)
        self.shared_expert_gate: Optional[nn.Module] = None
        if cfg.moe_shared_expert_gate:
            self.shared_expert_gate = _Gate(cfg, ps, device, join_key(init_key, "shared_expert_gate"))
        self.last_load: Optional[torch.Tensor] = None

    def _route(self, logits: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and map of ``logits [s, b, E]`` (flattened ``[s b, E]``), dropping, and the losses."""
        cfg, (s, b, E) = self.cfg, logits.shape
        flat = logits.reshape(-1, E)
        weights, rmap = topk_routing(flat, cfg.moe_router_topk, cfg.moe_router_pre_softmax,
                                     cfg.moe_router_score_function, cfg.moe_router_topk_scaling_factor,
                                     self.router.expert_bias)
        if cfg.moe_expert_capacity_factor is not None:
            weights, rmap = drop_to_capacity(weights, rmap, cfg.moe_router_topk, cfg.moe_expert_capacity_factor,
                                             cfg.moe_token_drop_policy, cfg.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled():
            self._losses(flat, s, b, ctx)
            counted = self.router.local_tokens_per_expert
            if counted is not None:
                with torch.no_grad():
                    counted += rmap.sum(0)
        return weights, rmap

    def _losses(self, flat: torch.Tensor, s: int, b: int, ctx: ForwardContext) -> None:
        """The balancing and z losses of the micro batch (module docstring). With context parallelism this rank
        holds ``s`` of each sequence's ``s x CP`` positions: the expert counts are summed over the CP group and
        each loss is the whole micro batch's (its value all-reduced; its gradient ``CP`` times this rank's
        part, which the engine's average over DP x CP divides back, as :func:`tnlg.parallel.loss.loss_sum`)."""
        cfg, k, E = self.cfg, self.cfg.moe_router_topk, flat.shape[1]
        cp, group = self.ps.cp_size, self.ps.cp_group
        terms, coeff = {}, cfg.moe_aux_loss_coeff
        for name in aux_loss_names(cfg):
            if name == "z_loss":  # (over the whole micro batch: the sum over the CP ranks' positions)
                terms[name] = z_loss(flat, float(cfg.moe_z_loss_coeff or 0.0)) / cp
                continue
            rmap, scores = aux_loss_scores(flat, k, cfg.moe_router_score_function)
            if name == "load_balancing_loss":
                counts = _summed(rmap.sum(0), group)
                terms[name] = load_balancing_loss(scores, counts, s * b * cp, k, E, coeff)
            else:  # seq_aux_loss: each sequence's loss (experts x sequences as megatron-core reshapes), averaged
                counts = _summed(rmap.reshape(s, b * E).sum(0), group)
                terms[name] = load_balancing_loss(scores.reshape(s, b * E), counts, s * cp, k, E, coeff) / b
        for name, value in terms.items():
            value = _whole(value, cp, group)
            ctx.aux[name] = ctx.aux[name] + value if name in ctx.aux else value

    def forward(self, x: torch.Tensor, ctx: ForwardContext, synced_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        ps, h = self.ps, x.shape[-1]
        sp = ctx.sequence_parallel and ps.tp_size > 1
        weight = copy_to_tp(self.router.weight, ps) if sp else self.router.weight
        logits = F.linear(x, weight)
        # the tokens in the dtype the experts compute in (under autocast its 16-bit one, as the dense MLP's
        # column layer casts before its collective): the gather and the all-to-all move half an fp32's bytes
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if sp:
            logits = gather_sequence_replicated(logits, ps, ctx.sp)
            tokens = gather_from_sequence_parallel(x.to(dt), ps, ctx.sp)
        else:
            tokens = copy_to_tp(x.to(dt), ps)
        s, b = logits.shape[:2]
        weights, rmap = self._route(logits, ctx)
        weights = copy_to_tp(weights, ps)  # (their gradient is a partial sum on each TP rank)
        expert_idx, token_idx, counts = self.assignment(rmap)
        self.last_load = counts.detach()
        flat = tokens.reshape(-1, h)
        routed = self._run_experts(flat.index_select(0, token_idx), counts)
        contrib = routed * weights[token_idx, expert_idx].unsqueeze(-1).to(routed.dtype)  # (autocast: its dtype)
        out = torch.zeros_like(flat, dtype=routed.dtype).index_add(0, token_idx, contrib)
        out = out.view(s, b, h)
        out = reduce_scatter_to_sequence_parallel(out, ps, ctx.sp) if sp else reduce_from_tp(out, ps)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, ctx)
            if self.shared_expert_gate is not None:
                shared = shared * self.shared_expert_gate(x, sp)
            out = out + shared
        return out

    @staticmethod
    def assignment(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routed copies of ``routing_map [T, E]``: ``(expert index, token index)`` of each, sorted by expert
        (tokens in order within one), and the copies per expert ``[E]``: where the routing's values become sizes
        (``nonzero``), so the fake-tensor simulation, which has no values, replaces it with
        :func:`even_routing_map`'s assignment (:func:`tnlg.training.simulate.even_routing`)."""
        expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)
        return expert_idx, token_idx, routing_map.sum(0)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert (``counts [E]``) through their experts, wherever they live (EP)."""
        ep, group = self.ps.size("ep"), self.ps.group("ep")
        received, got = ep_comm.dispatch(rows, counts, ep, group)
        perm, local_counts = ep_comm.regroup(got)
        y = self.experts(received.index_select(0, perm), local_counts)
        y = y.index_select(0, torch.argsort(perm))  # back to the arrival order
        return ep_comm.combine(y, counts, got, ep, group)


def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    """Expert token counts summed over the context-parallel ``group`` (no gradient; unchanged without one)."""
    if group is None:
        return counts
    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return counts


def _whole(partial: torch.Tensor, cp: int, group) -> torch.Tensor:
    """A loss summed over the CP ranks' parts: its value the sum (one all-reduce), its gradient ``cp`` times this
    rank's part (:meth:`MoELayer._losses`)."""
    if group is None:
        return partial
    total = partial.detach().clone()
    dist.all_reduce(total, group=group)
    scaled = partial * cp
    return scaled + (total - scaled).detach()


class _Gate(SelfInitializing, nn.Module):
    """Qwen2-MoE's shared-expert gate: ``sigmoid(x w)`` per token, ``w [1, h]`` replicated (through ``f``
    when sequence-parallel: each TP rank sees its own positions)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, device, init_key: str):
        super().__init__()
        self.ps = ps
        self.weight = ShardSpec((1, cfg.hidden_size)).parameter(ps.tp_rank, device)
        self.set_init({"weight": init_methods(cfg)[0]}, cfg.seed, init_key)

    def forward(self, x: torch.Tensor, sp: bool) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, copy_to_tp(self.weight, self.ps) if sp else self.weight))


@torch.no_grad()
def update_expert_bias(model: nn.Module, ps: ParallelState) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (megatron-core's ``get_updated_expert_bias``), after a
    step: every router's expert bias moves by its ``--moe-router-bias-update-rate`` towards the experts that got
    fewer tokens than the mean, ``b += rate * sign(mean - n)`` (the counts ``n`` since the last update summed
    over DP x CP: one all-reduce per router; every TP rank counts the same tokens), and the counts restart.
    Nothing for a model without expert biases."""
    import torch.distributed as dist
    for m in model.modules():
        if isinstance(m, Router) and m.expert_bias is not None and m.local_tokens_per_expert is not None:
            counts = m.local_tokens_per_expert
            if ps.group("dp_cp") is not None:
                dist.all_reduce(counts, group=ps.group("dp_cp"))
            m.expert_bias += torch.sign(counts.mean() - counts) * m.bias_update_rate
            counts.zero_()
