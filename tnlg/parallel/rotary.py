"""Rotary position embeddings (Su et al. 2021, RoFormer), in the layout transformers' Llama and
Megatron-core use (``rotary_interleaved=False``): *rotate-half*.

For a head vector ``x`` of which the first ``r`` dimensions are rotated (``r = int(head_dim *
rotary_percent)``, even) and position ``p``, with ``inv_freq_i = base^(-2i / r)`` for ``i < r / 2``:
the angles are ``theta = p * inv_freq`` repeated twice (``[theta, theta]``, length ``r``), and

    x_rot = x[:r] * cos(theta) + rotate_half(x[:r]) * sin(theta),   rotate_half([a, b]) = [-b, a]

(dimension ``i`` pairs with ``i + r / 2``); the remaining ``head_dim - r`` dimensions pass unchanged.
Angles are computed in fp32 (as transformers does), then cast to the input's dtype for the products.

**Scaled rope** (``scaling``: :attr:`tnlg.config.GPTConfig.rope_scaling`) changes ``inv_freq`` as
transformers' ``ROPE_INIT_FUNCTIONS`` do, in fp32 (docs/llama.md gives each formula): ``linear`` divides
it by the factor; ``llama3`` divides the low frequencies by the factor and interpolates the middle ones;
``yarn`` blends interpolated and extrapolated frequencies over a ramp and multiplies cos and sin by its
attention factor; ``dynamic`` (NTK) raises the base once a sequence is longer than ``max_position``,
which no tnlg forward is (positions stay below ``max_position_embeddings``), so its frequencies are the default's.

Positions are explicit: :func:`apply_rotary` takes the (global) position of every token, so
``--reset-position-ids`` (positions restarting per document), a KV cache's offset and a sequence split
over ranks (each rank its own global positions) all rotate the same way. No communication.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["inverse_frequencies", "scaled_frequencies", "rotary_angles", "rotate", "rotate_qk", "apply_rotary"]


def inverse_frequencies(rotary_dim: int, base: float, device=None) -> torch.Tensor:
    """``base^(-2i / rotary_dim)`` for ``i < rotary_dim / 2``, fp32 ``[rotary_dim / 2]``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (base ** exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict, device) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) as transformers' ``_compute_yarn_parameters``."""
    factor, original = s["factor"], s["original_max_position"]
    attention = s["attention_factor"]
    if attention is None:
        attention = (_yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
                     if s["mscale"] and s["mscale_all_dim"] else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # the share of the unscaled frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's scaling as transformers' ``_compute_llama3_parameters`` (megatron-core's ``_apply_scaling``)."""
    factor, low, high, original = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def scaled_frequencies(rotary_dim: int, base: float, scaling: Optional[dict], device=None,
                       seq_len: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies (fp32 ``[rotary_dim / 2]``) and the factor on cos and sin of rope with
    ``scaling`` (:attr:`tnlg.config.GPTConfig.rope_scaling`; ``None``: unscaled, factor 1), as transformers'
    ``ROPE_INIT_FUNCTIONS[rope_type]`` computes them. ``seq_len`` (a 0-dim integer tensor, the largest
    position + 1) matters to ``dynamic`` alone, from ``max_position`` on; ``None``: ``max_position``."""
    inv = inverse_frequencies(rotary_dim, base, device)
    kind = None if scaling is None else scaling["type"]
    if kind is None:
        return inv, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, base, scaling, device)
    if kind == "dynamic":
        longest = scaling["max_position"]
        if seq_len is None or int(seq_len) <= longest:
            return inv, 1.0
        factor, dim = scaling["factor"], rotary_dim  # (tensor arithmetic in fp32, as transformers' update)
        grown = base * ((factor * seq_len / longest) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (grown ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
                                / dim)), 1.0
    raise ValueError(f"unknown rope scaling {kind!r}")


def rotary_angles(position_ids: torch.Tensor, rotary_dim: int, base: float,
                  scaling: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of every position's angles, fp32 ``[b, 1, s, rotary_dim]`` (``position_ids``:
    ``[b, s]`` or ``[s]``, integer global positions); broadcast over heads. ``scaling``: a scaled rope's
    frequencies and factor on cos and sin (:func:`scaled_frequencies`)."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    inv, factor = scaled_frequencies(rotary_dim, base, scaling, position_ids.device)
    theta = position_ids.float().unsqueeze(-1) * inv                       # [b, s, r/2]
    emb = torch.cat((theta, theta), dim=-1).unsqueeze(1)                   # [b, 1, s, r]
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


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


def apply_rotary(x: torch.Tensor, position_ids: torch.Tensor, rotary_dim: int, base: float,
                 scaling: Optional[dict] = None) -> torch.Tensor:
    """``x`` ``[b, heads, s, head_dim]`` rotated at ``position_ids`` (``[b, s]`` or ``[s]``: every token's
    global position) over its first ``rotary_dim`` dimensions with base ``base`` (and ``scaling``:
    :func:`scaled_frequencies`)."""
    cos, sin = rotary_angles(position_ids, rotary_dim, base, scaling)
    return rotate(x, cos, sin)
