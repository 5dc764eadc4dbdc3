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

__all__ = ["inverse_frequencies", "rotary_angles", "rotate", "apply_rotary"]


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of ``x`` ``[b, heads, s, head_dim]`` by the angles
    ``(cos, sin)`` (:func:`rotary_angles`); the rest pass unchanged. The result has ``x``'s dtype."""
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
