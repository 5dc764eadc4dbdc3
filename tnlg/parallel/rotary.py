"""Rotary position embeddings (Su et al. 2021, RoFormer), in the layout transformers' Llama and
Megatron-core use (``rotary_interleaved=False``): *rotate-half*.

For a head vector ``x`` of which the first ``r`` dimensions are rotated (``r = int(head_dim *
rotary_percent)``, even) and position ``p``, with ``inv_freq_i = base^(-2i / r)`` for ``i < r / 2``:
the angles are ``theta = p * inv_freq`` repeated twice (``[theta, theta]``, length ``r``), and

    x_rot = x[:r] * cos(theta) + rotate_half(x[:r]) * sin(theta),   rotate_half([a, b]) = [-b, a]

(dimension ``i`` pairs with ``i + r / 2``); the remaining ``head_dim - r`` dimensions pass unchanged.
Angles are computed in fp32 (as transformers does), then cast to the input's dtype for the products.

Positions are explicit: :func:`apply_rotary` takes the (global) position of every token, so
``--reset-position-ids`` (positions restarting per document), a KV cache's offset and a sequence split
over ranks (each rank its own global positions) all rotate the same way. No communication.
"""

from __future__ import annotations

import torch

__all__ = ["inverse_frequencies", "rotary_angles", "rotate", "rotate_qk", "apply_rotary"]


def inverse_frequencies(rotary_dim: int, base: float, device=None) -> torch.Tensor:
    """``base^(-2i / rotary_dim)`` for ``i < rotary_dim / 2``, fp32 ``[rotary_dim / 2]``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (base ** exponents)


def rotary_angles(position_ids: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of every position's angles, fp32 ``[b, 1, s, rotary_dim]`` (``position_ids``:
    ``[b, s]`` or ``[s]``, integer global positions); broadcast over heads."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    inv = inverse_frequencies(rotary_dim, base, position_ids.device)
    theta = position_ids.float().unsqueeze(-1) * inv                       # [b, s, r/2]
    emb = torch.cat((theta, theta), dim=-1).unsqueeze(1)                   # [b, 1, s, r]
    return emb.cos(), emb.sin()


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """``out[..., :r] = x[..., :r] * cos + sign * rotate_half(x[..., :r]) * sin`` (``r = cos.shape[-1]``) in three
    kernels, no temporaries: ``sign = 1`` is the rotation, ``sign = -1`` its transpose (the backward; the angles
    repeat over the two halves, so ``sin``'s halves are interchangeable)."""
    r = cos.shape[-1]
    half = r // 2
    torch.mul(x[..., :r], cos, out=out[..., :r])
    out[..., :half].addcmul_(x[..., half:r], sin[..., :half], value=-sign)   # - x2 sin  (forward)
    out[..., half:r].addcmul_(x[..., :half], sin[..., half:r], value=sign)   # + x1 sin


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    out = torch.empty_like(x)  # (x's layout: a permuted view of the projection gives a permuted output)
    _rotate_into(out, x, cos, sin, sign)
    if cos.shape[-1] < x.shape[-1]:  # the dimensions past rotary_dim pass unchanged
        out[..., cos.shape[-1]:].copy_(x[..., cos.shape[-1]:])
    return out


class _Rotate(torch.autograd.Function):
    """Rope on the queries and the keys together: forward ``x cos + rotate_half(x) sin``, backward the
    transpose ``g cos - rotate_half(g) sin`` (a rotation by ``-theta``), each in three kernels per tensor
    (no ``cat`` of the rotated halves, no negated copy). Keeps only ``cos`` and ``sin`` for backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotated(q, cos, sin, 1.0), _rotated(k, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        return (None if gq is None else _rotated(gq, cos, sin, -1.0),
                None if gk is None else _rotated(gk, cos, sin, -1.0), None, None)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[b, heads, s, d]`` and keys ``[b, kv_heads, s, d]`` (the same dtype) rotated over their first
    ``cos.shape[-1]`` dimensions by the angles ``(cos, sin)`` (:func:`rotary_angles`, cast once to their
    dtype); the rest pass unchanged. The products run in that dtype, as :func:`rotate`'s. Under
    ``torch.compile`` it is :func:`rotate` (Dynamo does not trace ``out=`` into strided views, and the
    compiler fuses the formula's kernels itself)."""
    if torch.compiler.is_compiling():
        return rotate(q, cos, sin), rotate(k, cos, sin)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _Rotate.apply(q, k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of ``x`` ``[b, heads, s, head_dim]`` by the angles
    ``(cos, sin)`` (:func:`rotary_angles`); the rest pass unchanged. The result has ``x``'s dtype.
    The formula as written (``cat`` of the rotated halves), differentiable by autograd: the reference
    :func:`rotate_qk` (what the attention runs) is tested against."""
    r = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass is None else torch.cat((out, x_pass), dim=-1)


def apply_rotary(x: torch.Tensor, position_ids: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """``x`` ``[b, heads, s, head_dim]`` rotated at ``position_ids`` (``[b, s]`` or ``[s]``: every token's
    global position) over its first ``rotary_dim`` dimensions with base ``base``."""
    cos, sin = rotary_angles(position_ids, rotary_dim, base)
    return rotate(x, cos, sin)
