"""TP-invariant initialisation: draw the full weight, then keep this rank's slice.

Every parameter has an *identity*: a seed and a key (its name in the model, e.g.
``transformer.h.0.attn.c_attn.weight``). Its initial value is drawn in full (the TP=1
shape, without padding) on the CPU from a generator seeded by that identity, then
sliced with :func:`tnlg.parallel.sharding.shard_of`. A shard is therefore exactly the
matching slice of the TP=1 weight at every TP size (as fairscale's
``_initialize_affine_weight``, with a per-parameter generator so that ranks and
parameters need not be initialised in any order). No communication.

An *init method* takes the full shape and the generator and returns the full fp32 CPU
tensor: :func:`init_normal`, :func:`init_zeros`, :func:`init_ones`.
"""

from __future__ import annotations

import zlib
from typing import Callable, Mapping, Optional, cast

import torch
import torch.nn as nn

from .sharding import full_shape, shard_of

__all__ = ["InitMethod", "init_normal", "init_zeros", "init_ones", "param_generator", "initial_value",
           "SelfInitializing"]

InitMethod = Callable[[tuple, torch.Generator], torch.Tensor]


def init_normal(std: float) -> InitMethod:
    """``N(0, std^2)`` drawn from the parameter's generator."""
    def init(shape: tuple, generator: torch.Generator) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, std, generator=generator)
    init.__qualname__ = f"init_normal({std})"
    return init


def init_zeros(shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """Zeros (biases)."""
    return torch.zeros(shape)


def init_ones(shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """Ones (LayerNorm weights)."""
    return torch.ones(shape)


def param_generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator seeded by a parameter's identity ``(seed, key)``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)


def initial_value(param: torch.Tensor, init_method: InitMethod, seed: int, key: str, tp_rank: int) -> torch.Tensor:
    """This TP rank's initial value of ``param`` (fp32, CPU): the full value drawn by ``init_method``
    from the generator of ``(seed, key)``, sliced (and zero-padded) as ``param`` is split."""
    return shard_of(init_method(full_shape(param), param_generator(seed, key)), param, tp_rank)


class SelfInitializing:
    """Mixin for modules whose parameters initialise themselves TP-invariantly.

    The module calls :meth:`set_init` once its parameters exist; :meth:`reset_parameters`
    then (re)writes every parameter this module owns directly (not on the meta device), and
    :meth:`initial_shard` gives one parameter's value without writing it (a data-parallel
    engine materialises a meta-device model with it, one parameter at a time).
    """

    init_methods: Mapping[str, InitMethod]
    init_seed: int
    init_key: str

    def set_init(self, init_methods: Mapping[str, InitMethod], seed: int, key: str) -> None:
        """``init_methods``: parameter name (``weight``, ``bias``) -> init method; ``seed`` and ``key``
        (the module's name in the model; ``""`` alone) make each parameter's identity."""
        self.init_methods, self.init_seed, self.init_key = dict(init_methods), int(seed), key
        self.reset_parameters()

    def param_key(self, name: str) -> str:
        """The identity key of this module's parameter ``name``."""
        return f"{self.init_key}.{name}" if self.init_key else name

    def initial_shard(self, name: str, param: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This TP rank's initial value of this module's parameter ``name`` (fp32, CPU). ``param``: the
        marked parameter to shape it like (default: the module's own; a wrapper that replaced it,
        e.g. FSDP, passes the original)."""
        ps = getattr(self, "ps", None)
        param = getattr(self, name) if param is None else param
        return initial_value(param, self.init_methods[name], self.init_seed, self.param_key(name),
                             ps.tp_rank if ps is not None else 0)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Write every parameter of this module (not its children) from :meth:`initial_shard`; those on
        the meta device are left for a data-parallel engine to materialise. No communication."""
        for name, p in nn.Module.named_parameters(cast(nn.Module, self), recurse=False):
            if p.device.type != "meta":
                p.copy_(self.initial_shard(name))
