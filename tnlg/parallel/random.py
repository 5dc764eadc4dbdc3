"""Dropout randomness that is right for tensor parallelism.

Outside sharded regions (hidden dropout on the replicated residual stream) all
TP ranks must drop the same elements: they use the default generator, seeded
identically on every TP rank. Inside sharded regions ranks must differ:
:class:`TPRandom` keeps a separate generator state per TP rank and
:meth:`TPRandom.fork` swaps it in. The sharded regions are the attention
probabilities of this rank's heads and, with sequence parallelism, everything
between the TP regions (embedding and hidden dropout on this rank's positions of
the sequence): each rank drops different elements of different tokens, as one
process would over the whole sequence.

Recomputation (activation checkpointing) must draw the same masks again:
:meth:`TPRandom.snapshot` captures the state before the original forward and
:meth:`TPRandom.replay` runs a recomputation from it. Whether a block is a
recomputation is decided by the identity of the state tensor (every draw replaces it
by a new one), never by comparing tensor values: no host read, and nothing that fake
tensors (:mod:`tnlg.training.simulate`) or a compiler's tracing cannot follow. States are
never modified in place, so a snapshot needs no copy.

The two draws inside sharded regions go through :meth:`TPRandom.dropout` and
:meth:`TPRandom.attention`. Eagerly they run in :meth:`TPRandom.fork`. Inside
``torch.compile`` (Dynamo does not trace reading or writing a generator's state: it would
break the graph there) they are the custom operators ``tnlg::tp_dropout`` and
``tnlg::tp_attention``: functional (this rank's state in, the operator's output and the
new state out), opaque to the compiler, so the graph does not break. Each runs, inside,
exactly the eager code under :meth:`fork` (the same masks as an eager run), and its
backward draws the same masks again from the state it was given (the dropout mask redrawn;
attention's forward recomputed and differentiated, about one attention forward more per
block when attention dropout is on). A recomputation under the compiler replays the same
graph on the same state input, so it draws the forward's masks without :meth:`replay`.

Works for any device type (CPU, CUDA, ...): states are read and written
through the device's own RNG API.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["TPRandom", "seed_everything"]

_TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type in ("cpu", "meta"):
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type in ("cpu", "meta"):
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class TPRandom:
    """A per-TP-rank generator state for dropout inside sharded regions."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = torch.device(device)
        self.seed(seed, tp_rank)

    @property
    def state(self) -> torch.Tensor:
        """This rank's generator state (a tensor that is replaced, never modified in place)."""
        return self._state

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self._state = value

    def snapshot(self) -> torch.Tensor:
        """The live state: what :meth:`replay` needs to recompute a block later."""
        return self._state

    def seed(self, seed: int, tp_rank: int) -> None:
        dev = "cpu" if self.device.type == "meta" else self.device
        gen = torch.Generator(device=dev).manual_seed(seed + _TP_SEED_OFFSET + 100 * tp_rank)
        self.state = gen.get_state()

    @contextlib.contextmanager
    def fork(self):
        """Run the block with this rank's generator; the default stream is untouched."""
        new: list = []
        try:
            with _drawing_from(self.device, self.state, new):
                yield
        finally:
            self.state = new[0]

    @contextlib.contextmanager
    def replay(self, snapshot: Optional[torch.Tensor]):
        """Run the block from ``snapshot`` (:meth:`snapshot` before the original forward) when the state
        has moved on since, i.e. when the block is a recomputation in backward; the live state is
        restored after. ``None`` or a snapshot of the live state: a first forward, nothing changes."""
        if snapshot is None or snapshot is self._state:
            yield
            return
        live, self._state = self._state, snapshot
        try:
            yield
        finally:  # (a checkpoint may stop a recomputation early by raising)
            self._state = live

    def dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """``F.dropout(x, p)`` (training) with this rank's generator (module docstring)."""
        if torch.compiler.is_compiling():
            out, self.state = torch.ops.tnlg.tp_dropout(x, float(p), self._state)
            return out
        with self.fork():
            return F.dropout(x, p, True)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  dropout_p: float, is_causal: bool) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` with dropout from this rank's generator (module docstring)."""
        if torch.compiler.is_compiling():
            out, self.state = torch.ops.tnlg.tp_attention(q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                                                          self._state)
            return out
        with self.fork():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal)

    def state_dict(self) -> dict:
        return {"state": self.state.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd["state"].clone()


# --------------------------------------------------------------------------- the compiler's operators
@contextlib.contextmanager
def _drawing_from(device: torch.device, state: torch.Tensor, new_state: list):
    """The device's generator set to ``state`` for the block; its state after the block is appended to
    ``new_state`` and the default stream restored."""
    saved = _get_state(device)
    _set_state(device, state)
    try:
        yield
    finally:
        new_state.append(_get_state(device))
        _set_state(device, saved)


def _sdpa(q, k, v, attn_mask, dropout_p: float, is_causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)


@torch.library.custom_op("tnlg::tp_dropout", mutates_args=())
def _tp_dropout(x: torch.Tensor, p: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new: list = []
    with _drawing_from(x.device, state, new):
        out = F.dropout(x, p, True)
    return out, new[0]


@torch.library.custom_op("tnlg::tp_dropout_backward", mutates_args=())
def _tp_dropout_backward(grad: torch.Tensor, p: float, state: torch.Tensor) -> torch.Tensor:
    with _drawing_from(grad.device, state, []):  # the forward's mask again (it depends on state and shape only)
        return grad * F.dropout(torch.ones_like(grad), p, True)


@torch.library.custom_op("tnlg::tp_attention", mutates_args=())
def _tp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  dropout_p: float, is_causal: bool, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new: list = []
    with _drawing_from(q.device, state, new):
        out = _sdpa(q, k, v, attn_mask, dropout_p, is_causal)
    return _bshd(out), new[0]


@torch.library.custom_op("tnlg::tp_attention_backward", mutates_args=())
def _tp_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
                           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward recomputed from ``state`` (the same masks) and differentiated by autograd."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with _drawing_from(q.device, state, []), _autograd_inside_an_operator(), torch.enable_grad():
        out = _sdpa(leaves[0], leaves[1], leaves[2], attn_mask, dropout_p, is_causal)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """``[b, heads, s, d]`` laid out as ``[b, s, heads, d]`` in memory (what CUDA's attention kernels
    return; a copy elsewhere): the operators' outputs need a layout their fake kernels can state."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


_AUTOGRAD_KEYS = [getattr(torch._C.DispatchKey, n) for n in dir(torch._C.DispatchKey) if n.startswith("Autograd")]


def _autograd_inside_an_operator():
    """Autograd's dispatch keys back on inside an operator's kernel (the dispatcher excludes them below
    an operator's autograd kernel), every other exclusion kept."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@_tp_dropout.register_fake
def _(x, p, state):
    return torch.empty_like(x), torch.empty_like(state)


@_tp_dropout_backward.register_fake
def _(grad, p, state):
    return torch.empty_like(grad)


@_tp_attention.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, state):
    return _bshd(q.new_empty(*q.shape[:-1], v.shape[-1])), torch.empty_like(state)


@_tp_attention_backward.register_fake
def _(grad, q, k, v, attn_mask, dropout_p, is_causal, state):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_dropout(ctx, inputs, output) -> None:
    ctx.p = inputs[1]
    ctx.save_for_backward(inputs[2])


def _dropout_grad(ctx, grad, _grad_state):
    (state,) = ctx.saved_tensors
    return torch.ops.tnlg.tp_dropout_backward(grad, ctx.p, state), None, None


def _save_attention(ctx, inputs, output) -> None:
    q, k, v, attn_mask, ctx.dropout_p, ctx.is_causal, state = inputs
    ctx.save_for_backward(q, k, v, attn_mask, state)


def _attention_grad(ctx, grad, _grad_state):
    q, k, v, attn_mask, state = ctx.saved_tensors
    dq, dk, dv = torch.ops.tnlg.tp_attention_backward(grad, q, k, v, attn_mask, ctx.dropout_p, ctx.is_causal, state)
    return dq, dk, dv, None, None, None, None


_tp_dropout.register_autograd(_dropout_grad, setup_context=_save_dropout)
_tp_attention.register_autograd(_attention_grad, setup_context=_save_attention)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) with the same seed."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
