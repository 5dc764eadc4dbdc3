"""The decoder's initialisation methods and its parameters' names (what TP-invariant init is keyed by)."""

from __future__ import annotations

import math

from ..config import GPTConfig
from ..parallel.initialization import InitMethod, init_normal

__all__ = ["init_methods", "join_key"]


def init_methods(cfg: GPTConfig) -> tuple[InitMethod, InitMethod]:
    """Weights ``N(0, std^2)``; residual projections ``N(0, std^2 / (2 L))`` (GPT-2 / Megatron scaled init)."""
    std = cfg.init_method_std
    return init_normal(std), init_normal(std / math.sqrt(2.0 * cfg.num_layers))


def join_key(prefix: str, name: str) -> str:
    """The parameter name ``prefix.name`` (``name`` alone at the top)."""
    return f"{prefix}.{name}" if prefix else name
